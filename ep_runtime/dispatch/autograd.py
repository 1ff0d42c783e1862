"""Autograd for dispatch and combine, in one place, for every backend.

A backend supplies the transport (``send``: rows from their home rank to the ranks of their
experts, ``send_back``: the reverse, both by a ``RowSplits``); the local work around it (gather,
FP8 cast, expand, weighted reduce, sum at home) is the same for all backends and uses the kernel
ops. The backward of dispatch is an unweighted combine, the backward of combine a dispatch.

Every collective of a layer's backward runs inside one of two autograd nodes, combine's then
dispatch's (the tokens and their router weights travel in the same node), so all ranks issue their
collectives in the same order whatever order the autograd engine picks among independent nodes.

Shape letters as in ``protocol``: T tokens, K routes, D hidden, S sent rows, R received rows,
P layout rows.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.permute import expand, unexpand
from kernels.quant import cast_back, per_token_cast
from kernels.reduce import weighted_reduce

from .protocol import RowSplits, TokenRoute


class Transport(Protocol):
    def send(self, rows_SX: torch.Tensor, splits: RowSplits) -> torch.Tensor: ...

    def send_back(self, rows_RX: torch.Tensor, splits: RowSplits) -> torch.Tensor: ...


def send_tokens(transport: Transport, x_SD: torch.Tensor, splits: RowSplits, fp8: bool) -> torch.Tensor:
    """Sends token rows, as FP8 e4m3 with per-token 1x128 scales travelling alongside when ``fp8``."""
    if not fp8:
        return transport.send(x_SD, splits)
    q_SD, sf_SG = per_token_cast(x_SD)
    q_RD = transport.send(q_SD.view(torch.uint8), splits).view(torch.float8_e4m3fn)
    return cast_back(q_RD, transport.send(sf_SG, splits), block=(1, 128), out_dtype=x_SD.dtype)


def sum_at_home(rows_SX: torch.Tensor, route: TokenRoute) -> torch.Tensor:
    """Adds the rows that came home into their tokens, in float32."""
    out_TX = rows_SX.new_zeros((route.num_tokens, *rows_SX.shape[1:]), dtype=torch.float32)
    return out_TX.index_add_(0, route.send_token_S, rows_SX.float()).to(rows_SX.dtype)


class DispatchFn(torch.autograd.Function):
    """(x_TD, weights_SK) -> (x_PD in the local experts' layout, weights_RK of the received rows)."""

    @staticmethod
    def forward(ctx, x_TD, weights_SK, route: TokenRoute, transport: Transport, fp8: bool):
        ctx.route, ctx.transport = route, transport
        x_RD = send_tokens(transport, x_TD.index_select(0, route.send_token_S), route.splits, fp8)
        return expand(x_RD, route.layout), transport.send(weights_SK, route.splits)

    @staticmethod
    def backward(ctx, grad_PD, grad_weights_RK):
        route, transport = ctx.route, ctx.transport
        pos_RK = route.layout.pos_TK
        grad_RD = weighted_reduce(grad_PD.contiguous(), pos_RK, (pos_RK >= 0).float())
        grad_TD = sum_at_home(transport.send_back(grad_RD, route.splits), route)
        if grad_weights_RK is None:
            grad_weights_RK = torch.zeros(pos_RK.shape, dtype=torch.float32, device=pos_RK.device)
        grad_weights_SK = transport.send_back(grad_weights_RK.contiguous(), route.splits)
        return grad_TD, grad_weights_SK, None, None, None


class CombineFn(torch.autograd.Function):
    """(y_PD, weights_RK) -> out_TD: weighted reduce per received row, send home, sum there."""

    @staticmethod
    def forward(ctx, y_PD, weights_RK, route: TokenRoute, transport: Transport):
        ctx.route, ctx.transport = route, transport
        ctx.save_for_backward(y_PD, weights_RK)
        out_RD = weighted_reduce(y_PD, route.layout.pos_TK, weights_RK, out_dtype=y_PD.dtype)
        return sum_at_home(transport.send_back(out_RD, route.splits), route)

    @staticmethod
    def backward(ctx, grad_TD):
        y_PD, weights_RK = ctx.saved_tensors
        route, layout = ctx.route, ctx.route.layout
        grad_RD = ctx.transport.send(grad_TD.contiguous().index_select(0, route.send_token_S), route.splits)
        grad_weights_RK = torch.einsum("rkd,rd->rk", unexpand(y_PD, layout).float(), grad_RD.float())
        src_P = layout.src_P.long()
        row_weight_P = torch.where(src_P >= 0, weights_RK.flatten()[src_P.clamp(min=0)], 0.0)
        grad_PD = (expand(grad_RD, layout).float() * row_weight_P[:, None]).to(y_PD.dtype)
        return grad_PD, grad_weights_RK, None, None
