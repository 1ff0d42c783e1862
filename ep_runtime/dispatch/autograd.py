"""Autograd for dispatch and combine, in one place, for every backend.

A backend supplies the transport (``send``: rows from their home rank to the ranks of their
experts, ``send_back``: the reverse, both by the handle's ``RowSplits``); the local work around it
(gather, FP8 cast, expand, weighted reduce, sum at home) is the same for all backends and uses the
kernel ops. The backward of dispatch is an unweighted combine, the backward of combine a dispatch.

Shape letters as in ``protocol``: T tokens, K routes, D hidden, S sent rows, R received rows,
P layout rows.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.permute import expand, unexpand
from kernels.quant import cast_back, per_token_cast
from kernels.reduce import weighted_reduce

from .protocol import DispatchHandle, RowSplits


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


def sum_at_home(rows_SD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Adds the rows that came home into their tokens, in float32."""
    out_TD = rows_SD.new_zeros((handle.num_tokens, rows_SD.shape[1]), dtype=torch.float32)
    return out_TD.index_add_(0, handle.send_token_S, rows_SD.float()).to(rows_SD.dtype)


class SendRows(torch.autograd.Function):
    """Differentiable ``send`` of small per-row tensors (the router weights)."""

    @staticmethod
    def forward(ctx, rows_SX, splits, transport):
        ctx.splits, ctx.transport = splits, transport
        return transport.send(rows_SX, splits)

    @staticmethod
    def backward(ctx, grad_RX):
        return ctx.transport.send_back(grad_RX.contiguous(), ctx.splits), None, None


class DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, handle: DispatchHandle, transport: Transport, fp8: bool):
        ctx.handle, ctx.transport = handle, transport
        x_RD = send_tokens(transport, x_TD.index_select(0, handle.send_token_S), handle.splits, fp8)
        return expand(x_RD, handle.layout)

    @staticmethod
    def backward(ctx, grad_PD):
        handle = ctx.handle
        ones_RK = (handle.layout.pos_TK >= 0).float()
        grad_RD = weighted_reduce(grad_PD.contiguous(), handle.layout.pos_TK, ones_RK)
        return sum_at_home(ctx.transport.send_back(grad_RD, handle.splits), handle), None, None, None


class CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_PD, weights_RK, handle: DispatchHandle, transport: Transport):
        ctx.handle, ctx.transport = handle, transport
        ctx.save_for_backward(y_PD, weights_RK)
        out_RD = weighted_reduce(y_PD, handle.layout.pos_TK, weights_RK, out_dtype=y_PD.dtype)
        return sum_at_home(transport.send_back(out_RD, handle.splits), handle)

    @staticmethod
    def backward(ctx, grad_TD):
        y_PD, weights_RK = ctx.saved_tensors
        handle, layout = ctx.handle, ctx.handle.layout
        grad_RD = ctx.transport.send(grad_TD.contiguous().index_select(0, handle.send_token_S), handle.splits)
        grad_weights_RK = torch.einsum("rkd,rd->rk", unexpand(y_PD, layout).float(), grad_RD.float())
        src_P = layout.src_P.long()
        row_weight_P = torch.where(src_P >= 0, weights_RK.flatten()[src_P.clamp(min=0)], 0.0)
        grad_PD = (expand(grad_RD, layout).float() * row_weight_P[:, None]).to(y_PD.dtype)
        return grad_PD, grad_weights_RK, None, None
