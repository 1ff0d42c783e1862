"""Autograd for dispatch and combine, in one place, for every backend.

A backend supplies the transport over a route it planned (``scatter``: each token's row to every
rank that holds one of its experts; ``gather_home``: each received row back to its token's home
rank, summed there in float32; ``reduce_home``: a weighted reduce of each received row's routes,
then ``gather_home``, which a backend may fuse into one pass) and moves the tokens forward itself
(fused with its FP8 cast, its route planning) into the local experts' layout (``expand_rows``,
fused with the FP8 cast back when the rows travelled as FP8, unless the backend fuses more; FP4
rows are cast back, then expanded); every
backward is the same for all backends and uses the kernel ops. The backward of dispatch is an
unweighted combine, the backward of combine a dispatch.

Every collective of a layer's backward runs inside one of two autograd nodes, combine's then
dispatch's (the tokens and their router weights travel in the same node), so all ranks issue their
collectives in the same order whatever order the autograd engine picks among independent nodes.

Shape letters as in ``protocol``: T tokens, K routes, D hidden, R received rows, P layout rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.permute import ExpertLayout, expand
from kernels.permute import expand_cast_back
from kernels.quant import cast_back_fp4
from kernels.reduce import weighted_reduce_backward

if TYPE_CHECKING:
    from .protocol import Dispatcher, Route

FP8_GROUP = 128  # columns per scale of tokens that travel as FP8 (DeepSeek's 1x128)
FP4_GROUP = 16  # columns per e4m3 scale of tokens that travel as FP4 (NVFP4's)


@dataclass(frozen=True)
class Fp8Rows:
    """Rows as FP8 dispatch moves them: ``q_RD`` [R, D] e4m3 and ``sf_RG`` [R, ceil(D / 128)]
    float32 per-token scales, standing for rows of ``dtype``."""

    q_RD: torch.Tensor
    sf_RG: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class Fp4Rows:
    """Rows as FP4 dispatch moves them (``kernels.quant.per_token_cast_fp4_e4m3_sf``): ``q_RH``
    [R, D / 2] uint8, two e2m1 codes a byte, ``sf_RG`` [R, ceil(D / 16)] e4m3 scales and ``gsf_R``
    [R] float32 per-row scales, standing for rows of ``dtype``."""

    q_RH: torch.Tensor
    sf_RG: torch.Tensor
    gsf_R: torch.Tensor
    dtype: torch.dtype


def expand_rows(rows_RD: torch.Tensor | Fp8Rows | Fp4Rows, layout: ExpertLayout) -> torch.Tensor:
    """Received rows into the local experts' layout, in the tokens' dtype (FP8 rows dequantized
    on the way, in one pass: ``kernels.permute.expand_cast_back``; FP4 rows dequantized first)."""
    if isinstance(rows_RD, Fp4Rows):
        rows = cast_back_fp4(rows_RD.q_RH, rows_RD.sf_RG, group=FP4_GROUP, gsf_T=rows_RD.gsf_R, out_dtype=rows_RD.dtype)
        return expand(rows, layout)
    if isinstance(rows_RD, Fp8Rows):
        return expand_cast_back(rows_RD.q_RD, rows_RD.sf_RG, layout, group=FP8_GROUP, out_dtype=rows_RD.dtype)
    return expand(rows_RD, layout)


class DispatchFn(torch.autograd.Function):
    """(x_TD, weights_TK) -> (x_PD in the local experts' layout, weights_RK of the received rows),
    given what the backend already moved and laid out (``x_PD`` and ``weights_RK``: no gradient of
    their own). Both come back as they are (autograd makes the outputs views of them, no copy), so
    a backend hands over tensors of its own, never views of a buffer it reuses."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, x_PD, weights_RK, route: Route, transport: Dispatcher):
        ctx.route, ctx.transport = route, transport
        return x_PD, weights_RK

    @staticmethod
    def backward(ctx, grad_PD, grad_weights_RK):
        route, transport = ctx.route, ctx.transport
        pos_RK = route.layout.pos_TK
        routed_RK = pos_RK >= 0
        grad_TD = transport.reduce_home(grad_PD.contiguous(), routed_RK.float(), route)
        grad_weights_TK = None
        # Weights that reach no loss get zeros here, not None (autograd materializes the gradient).
        if ctx.needs_input_grad[1]:  # the same on every rank, so the collectives stay in step
            # where, not a product: rows of routes elsewhere may hold anything (a backend's stale rows).
            grad_weights_TK = transport.gather_weights_home(torch.where(routed_RK, grad_weights_RK, 0.0), route)
        return grad_TD, grad_weights_TK, None, None, None, None


class CombineFn(torch.autograd.Function):
    """(y_PD, weights_RK) -> out_TD: weighted reduce per received row, send home, sum there (the
    rows as FP8 when ``fp8``: the backward then passes the gradient straight through the cast)."""

    @staticmethod
    def forward(ctx, y_PD, weights_RK, route: Route, transport: Dispatcher, fp8: bool):
        ctx.route, ctx.transport = route, transport
        ctx.save_for_backward(y_PD, weights_RK)
        if fp8:
            return transport.reduce_home(y_PD, weights_RK, route, fp8=True)
        return transport.reduce_home(y_PD, weights_RK, route)

    @staticmethod
    def backward(ctx, grad_TD):
        y_PD, weights_RK = ctx.saved_tensors
        grad_RD = ctx.transport.scatter(grad_TD.contiguous(), ctx.route)
        # Over the routed rows only: a static receive capacity costs nothing here.
        grad_PD, grad_weights_RK = weighted_reduce_backward(grad_RD, y_PD, weights_RK, ctx.route.layout)
        return grad_PD, grad_weights_RK, None, None, None
