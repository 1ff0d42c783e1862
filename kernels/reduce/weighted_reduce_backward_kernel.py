"""The TileLang kernel of :func:`kernels.reduce.reference.weighted_reduce_backward`: both gradients
of a weighted reduce in one pass, touching only the layout rows that routes use.

One CTA per token (``row_geometry``: hidden 7168 in bf16 is 128 threads of 7 vectors): it loads the
token's gradient row once, then for each of its K routes with a row, loads that row of ``y``, adds
``y * grad`` into the thread's partial dot product for the route and stores ``grad * weight`` to
the route's row of ``grad_PD``; one CTA-wide reduction (``row_reduction``, K sums) then gives the K
router-weight gradients. A token whose routes are all masked (an unused row of a static receive
buffer) loads nothing. The grid's first CTAs zero the padding rows inside the segments,
``PAD_ROWS`` rows each; rows past the last segment (``offsets_E[-1]``) are never written, so a
static capacity of several times the routes in use costs no memory traffic (as in ``expand``).

Bytes moved: per routed row, ``y`` read and ``grad_PD`` written once; per token with a route,
``grad`` read once. ``grad_PD`` is bit-exact (one IEEE product, rounded); the dot products are
float32 sums in the threads' and warps' order, not the reference's. Values are not checked on the
host (no host sync): a position outside ``[0, P)`` is treated as -1.

Shape suffixes: T tokens, K routes per token, P layout rows, E experts, D hidden.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.launch import launcher
from kernels.permute.reference import ExpertLayout
from kernels.tiles import PASS_CONFIGS, aligned, as_int32, check_cuda, tl_dtype
from kernels.reduce.reference import check_weighted_reduce_backward_tensors
from kernels.validate import per_signature
from kernels.rows import row_geometry, row_reduction


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_weighted_reduce_backward_kernel(d: int, topk: int, dtype: str):
    """``(grad_TD, y_PD, pos_TK, weights_TK, src_P, offsets_E, grad_PD, grad_weights_TK)`` kernel
    for rows of ``d`` elements of ``dtype`` and ``topk`` routes per token (token, row and expert
    counts are dynamic)."""
    num_tokens, num_rows, num_experts = T.dynamic("num_tokens"), T.dynamic("num_rows"), T.dynamic("num_experts")
    vec, nv, threads, per_thread, warps = row_geometry(d, dtype)
    pad_rows = threads  # one src_P entry a thread
    reduce = row_reduction(topk, warps)

    @T.prim_func
    def weighted_reduce_backward(
        grad_TD: T.Tensor[(num_tokens, d), dtype],
        y_PD: T.Tensor[(num_rows, d), dtype],
        pos_TK: T.Tensor[(num_tokens, topk), T.int32],
        weights_TK: T.Tensor[(num_tokens, topk), T.float32],
        src_P: T.Tensor[(num_rows,), T.int32],
        offsets_E: T.Tensor[(num_experts,), T.int32],
        grad_PD: T.Tensor[(num_rows, d), dtype],
        grad_weights_TK: T.Tensor[(num_tokens, topk), T.float32],
    ):
        pad_blocks = T.ceildiv(num_rows, pad_rows)
        with T.Kernel(pad_blocks + num_tokens, threads=threads) as bm:
            tid = T.get_thread_binding()
            pad_M = T.alloc_shared((pad_rows,), T.int32)  # M: rows of the padding tile, 1 = padding
            rows = T.alloc_local((topk,), T.int64)
            weights = T.alloc_local((topk,), T.float32)
            grad_buf = T.alloc_local((per_thread * vec,), dtype)
            y_buf = T.alloc_local((vec,), dtype)
            out_buf = T.alloc_local((vec,), dtype)
            sums = T.alloc_local((topk,), T.float32)
            stats = T.alloc_local((topk,), T.float32)
            partial_KW = T.alloc_shared((topk, warps), T.float32)
            routed = T.alloc_var(T.int32)
            if bm < pad_blocks:
                # Padding rows inside the segments: zeros (the grouped GEMMs' backward reads them).
                row = bm * pad_rows + tid
                pad_M[tid] = 0
                if row < num_rows and row < offsets_E[num_experts - 1]:
                    pad_M[tid] = T.Cast(T.int32, src_P[row] < 0)
                T.sync_threads()
                for i in T.serial(pad_rows):
                    if pad_M[i] == 1:
                        for p in T.unroll(per_thread):
                            c = p * threads + tid
                            if c < nv:
                                for j in T.vectorized(vec):
                                    grad_PD[T.Cast(T.int64, bm * pad_rows + i), c * vec + j] = T.cast(0, dtype)
            else:
                t = T.Cast(T.int64, bm - pad_blocks)
                routed = 0
                for k in T.unroll(topk):
                    rows[k] = T.Cast(T.int64, pos_TK[t, k])
                    if rows[k] >= num_rows:  # values are not checked on the host: out of range reads as -1
                        rows[k] = -1
                    if rows[k] >= 0:
                        routed = 1
                    weights[k] = weights_TK[t, k]
                    sums[k] = T.float32(0)
                if routed == 1:
                    for p in T.unroll(per_thread):
                        c = p * threads + tid
                        if c < nv:
                            for j in T.vectorized(vec):
                                grad_buf[p * vec + j] = grad_TD[t, c * vec + j]
                    for k in T.unroll(topk):
                        if rows[k] >= 0:
                            for p in T.unroll(per_thread):
                                c = p * threads + tid
                                if c < nv:
                                    for j in T.vectorized(vec):
                                        y_buf[j] = y_PD[rows[k], c * vec + j]
                                    for j in T.serial(vec):
                                        g = T.cast(grad_buf[p * vec + j], T.float32)
                                        sums[k] = T.ieee_add(sums[k], T.ieee_mul(T.cast(y_buf[j], T.float32), g))
                                        out_buf[j] = T.cast(T.ieee_mul(g, weights[k]), dtype)
                                    for j in T.vectorized(vec):
                                        grad_PD[rows[k], c * vec + j] = out_buf[j]
                reduce(sums, partial_KW, stats, tid)
                if tid == 0:
                    for k in T.unroll(topk):
                        grad_weights_TK[t, k] = T.if_then_else(rows[k] >= 0, stats[k], T.float32(0))

    return weighted_reduce_backward


def weighted_reduce_backward(
    grad_TD: torch.Tensor, y_PD: torch.Tensor, weights_TK: torch.Tensor, layout: ExpertLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of :func:`kernels.reduce.reference.weighted_reduce_backward` (``grad_PD``
    bit for bit, ``grad_weights_TK`` up to float32 summation order); tensors on a CUDA device."""
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout: expected an ExpertLayout, got {type(layout).__name__}")
    launch = _plan(grad_TD, y_PD, weights_TK, layout.pos_TK, layout.src_P, layout.offsets_E)
    (p, d), (t, k) = y_PD.shape, layout.pos_TK.shape
    if launch is None:  # no route has a row, and every row is padding
        return torch.zeros_like(y_PD), torch.zeros((t, k), dtype=torch.float32, device=y_PD.device)
    grad_PD = torch.empty((p, d), dtype=y_PD.dtype, device=y_PD.device)
    grad_weights_TK = torch.empty((t, k), dtype=torch.float32, device=y_PD.device)
    launch(aligned(grad_TD), aligned(y_PD), as_int32(layout.pos_TK), weights_TK.contiguous(), as_int32(layout.src_P),
           as_int32(layout.offsets_E), grad_PD, grad_weights_TK)
    return grad_PD, grad_weights_TK


@per_signature
def _plan(grad_TD, y_PD, weights_TK, pos_TK, src_P, offsets_E):
    """:func:`weighted_reduce_backward`'s checks and launch (None: nothing to launch), once per
    signature of its arguments (``kernels.validate.per_signature``)."""
    check_weighted_reduce_backward_tensors(grad_TD, y_PD, weights_TK, pos_TK, src_P)
    check_cuda("y_PD", y_PD)
    (p, d), (t, k) = y_PD.shape, pos_TK.shape
    if t * p * d * k == 0 or offsets_E.numel() == 0:
        return None
    return launcher(get_weighted_reduce_backward_kernel(d, k, tl_dtype(y_PD.dtype)))
