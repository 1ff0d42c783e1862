"""The routed experts' SwiGLU MLP in FP8 (DeepSeek-V3's recipe), forward and backward, over an
expert-major layout whose segments are multiples of 128 rows (``model.moe.fp8_experts``).

Forward: ``x`` cast per token (1 x 128), ``h = x @ W13`` on the FP8 grouped GEMM with the weights
cast per 128 x 128 block, the SwiGLU fused with the next per-token cast, ``y = swiglu(h) @ W2``.
Backward: the data gradients on the same GEMM (the output gradient cast per token, the weights'
own casts: a block's scale is the same for a matrix and its transpose, so one cast a weight serves
both directions; ``WeightCasts`` keeps it until the weight changes), the weight gradients on the
K-grouped GEMM with both operands cast per channel (one scale per 128 rows per column) and
transposed K-major. ``x`` is kept for the backward as its forward cast, as DeepSeek-V3 caches a
Linear's input in FP8: half the bytes of bf16 rows, and its per-channel cast is requantized from it
(:func:`kernels.quant.requant`, 1 x 128 to 128 x 1 blocks), which reads 1 byte an element, not 2.
Every GEMM accumulates in float32 with per-128 promotion; the GEMMs' outputs are bfloat16, the
weight gradients in the weights' dtype (float32, or bfloat16 for bfloat16 weights: half the bytes
of the GEMM's largest output, and no cast of it after).

Rows at or past ``offsets_E[-1]`` (a static capacity's spare rows) are unspecified in the output
and in ``x``'s gradient, as in the bf16 path.

Shape letters: P layout rows, D hidden, I expert intermediate size, E local experts.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from kernels.gemm import cast_weights, grouped_fp8_mm, grouped_fp8_mm_wgrad, k_major
from kernels.quant import per_channel_cast, per_token_cast, requant, swiglu, swiglu_backward, swiglu_per_token_cast
from kernels.transpose import batched_transpose

FP8_BLOCK = 128  # DeepSeek-V3's: 1 x 128 activation tiles, 128 x 1 for the weight gradients' operands


class FP8ExpertsFn(torch.autograd.Function):
    """``swiglu(x @ W13[e]) @ W2[e]`` for each expert's rows, in FP8 (see the module doc).

    Args of ``apply``: ``x_PD`` ``[P, D]``, ``w13_EDI2`` ``[E, D, 2 * I]``, ``w2_EID`` ``[E, I, D]``
    (``GroupedExperts``' parameters) and ``offsets_E`` int32 ``[E]`` (the layout's segment ends,
    multiples of 128). Returns ``y_PD`` in ``x_PD``'s dtype."""

    @staticmethod
    def forward(ctx, x_PD, w13_EDI2, w2_EID, offsets_E):
        (q13_EDI2, sf13), forward13 = WEIGHT_CASTS.of(w13_EDI2)
        (q2_EID, sf2), forward2 = WEIGHT_CASTS.of(w2_EID)
        qx_PD, sx_PG = per_token_cast(x_PD.detach(), group=FP8_BLOCK)
        h_PI2 = grouped_fp8_mm(qx_PD, sx_PG, *forward13, offsets_E)
        y_PD = grouped_fp8_mm(*swiglu_per_token_cast(h_PI2), *forward2, offsets_E)
        ctx.save_for_backward(qx_PD, sx_PG, h_PI2, q13_EDI2, sf13, q2_EID, sf2, offsets_E)
        ctx.grad_dtypes = tuple(torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32
                                for w in (w13_EDI2, w2_EID))
        return y_PD.to(x_PD.dtype)

    @staticmethod
    def backward(ctx, grad_PD):
        qx_PD, sx_PG, h_PI2, q13_EDI2, sf13, q2_EID, sf2, offsets_E = ctx.saved_tensors
        grad_PD = grad_PD.contiguous()
        rows = offsets_E[-1:]
        grad_h_PI = grouped_fp8_mm(*per_token_cast(grad_PD), q2_EID, sf2, offsets_E)
        grad13_dtype, grad2_dtype = ctx.grad_dtypes
        grad_w2_EID = _wgrad(per_channel_cast(swiglu(h_PI2, rows=rows)), grad_PD, offsets_E, grad2_dtype)
        grad_h_PI2 = swiglu_backward(h_PI2, grad_h_PI, rows=rows)
        grad_x_PD = grouped_fp8_mm(*per_token_cast(grad_h_PI2), q13_EDI2, sf13, offsets_E)
        x_per_channel = requant(qx_PD, sx_PG, in_block=(1, FP8_BLOCK), out_block=(FP8_BLOCK, 1))
        grad_w13_EDI2 = _wgrad(x_per_channel, grad_h_PI2, offsets_E, grad13_dtype)
        return grad_x_PD, grad_w13_EDI2, grad_w2_EID, None  # autograd casts each to its input's dtype


class WeightCasts:
    """Each weight's FP8 cast and its transpose, kept until the weight changes: one cast a step
    however many micro-batches run forward, and one copy saved for all their backwards. Every
    optimizer's step drops them all as it starts, freeing their memory for it (a fused step leaves
    the weights' version counters as they were); any other in-place update (a checkpoint's load, an
    expert moved) moves the weight's version counter. A weight's entry goes with the weight."""

    def __init__(self):
        self._casts = WeakIdKeyDictionary()
        register_optimizer_step_pre_hook(lambda *_: self._casts.clear())

    def of(self, w_ENK: torch.Tensor):
        """``((q, sf), (q^T, sf^T))``: the cast of ``w_ENK`` (:func:`kernels.gemm.cast_weights`) and
        of its transpose."""
        key = (w_ENK._version, w_ENK.data_ptr(), w_ENK.shape, w_ENK.dtype, w_ENK.device)
        kept = self._casts.get(w_ENK)
        if kept is not None and kept[0] == key:
            return kept[1]
        self._casts.pop(w_ENK, None)  # before the new cast: never two of a weight at once
        cast = cast_weights(w_ENK.detach())
        self._casts[w_ENK] = key, (cast, _transposed(*cast))
        return self._casts[w_ENK][1]


WEIGHT_CASTS = WeightCasts()


def _transposed(q_ENK: torch.Tensor, sf_EJG: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast of the transposed weights, from the weights' cast (the same blocks and scales)."""
    return batched_transpose(q_ENK), sf_EJG.transpose(1, 2).contiguous()


def _wgrad(x_cast: tuple[torch.Tensor, torch.Tensor], grad_PN: torch.Tensor, offsets_E: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """``x[rows of e]^T @ grad[rows of e]`` per expert, ``[E, M, N]`` in ``out_dtype``, from ``x``'s
    cast per channel (``per_channel_cast``'s ``(q_PM, sf_CM)``)."""
    qx_PM, sx_CM = x_cast
    qg_PN, sg_CN = per_channel_cast(grad_PN)
    return grouped_fp8_mm_wgrad(k_major(qx_PM), sx_CM, k_major(qg_PN), sg_CN, offsets_E, out_dtype=out_dtype)
