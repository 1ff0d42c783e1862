"""TileLang kernels of :func:`kernels.engram.reference.gate`, forward and backward: per token ``t``
and mHC stream ``h``, ``dot = sum_d x * wh * we * k * rstd(x) * rstd(k) / sqrt(D)``,
``gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))``, ``out = x + gate * v`` (or ``gate * v``).

Memory-bound: one CTA per (token, stream) row. Each thread loads its vectors of ``x`` (kept in
registers), ``k``, ``wh`` and ``we`` (``vec`` elements, 16 bytes of ``x``'s dtype or fewer when
``D`` is not a multiple of that), accumulates ``sum x^2``, ``sum k^2`` and ``sum x*w*k`` in float32,
the CTA reduces them (warp shuffles, then one value per warp through shared memory, summed in warp
order by every thread), and the threads write ``x + gate * v`` from their registers and a load of
``v``. ``v`` is read once per stream (N times per token; the stream CTAs of a token are neighbours on
the grid's fastest axis, so they run together and the repeats hit L2: with the token on that axis
instead, v came from memory N times and the kernel reached 77% of copy on an H200).

The float32 math mirrors the reference's operations (``(x * (wh * we)) * k``; ``sqrt`` and the
divisions IEEE, no FMA contraction) but sums over ``D`` in another order than PyTorch's reduction,
so results match within the tolerance the GPU tests state, not bit for bit. The forward also
writes each row's ``(rstd_x, rstd_k, raw)`` (12 bytes), from which the backward
(:mod:`kernels.engram.gate_backward_kernel`: one persistent kernel for all five gradients, then one
summing its CTAs' weight-gradient partials) starts.

Shape suffixes (as in :mod:`kernels.engram.reference`): T tokens, N mHC streams, D hidden size.
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.engram.reference import check_gate_args
from kernels.rows import row_geometry, row_reduction
from kernels.tiles import PASS_CONFIGS, aligned, check_cuda, tl_dtype

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float64 stays with the reference


def gate_value(d: int, clamp: float):
    """A macro ``(raw, rstd_x, rstd_k, out, i)`` writing the row's gate to ``out[i]``: ``dot = raw *
    rstd_x * rstd_k / sqrt(D)``, ``gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))``; IEEE
    operations."""
    sqrt_d = math.sqrt(d)

    @T.macro
    def macro(raw, rstd_x, rstd_k, out, i):
        dot = T.ieee_fdiv(T.ieee_mul(T.ieee_mul(raw, rstd_x), rstd_k), T.float32(sqrt_d))
        root = T.ieee_fsqrt(T.max(T.abs(dot), T.float32(clamp)))
        z = T.if_then_else(dot > 0, root, T.if_then_else(dot < 0, -root, T.float32(0)))
        out[i] = T.ieee_fdiv(T.float32(1), T.ieee_add(T.float32(1), T.exp(-z)))

    return macro


def gate_scalars(d: int, eps: float, clamp: float):
    """A macro ``(stats, out)``: from a row's ``stats = (sum x^2, sum k^2, raw = sum x*w*k)`` it
    writes ``out = (rstd_x, rstd_k, gate)`` as the forward defines them: ``rstd = 1 / sqrt(sum / D +
    eps)`` and :func:`gate_value`; IEEE operations."""
    gate = gate_value(d, clamp)

    @T.macro
    def macro(stats, out):
        out[0] = T.ieee_fdiv(T.float32(1), T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(stats[0], T.float32(d)), T.float32(eps))))
        out[1] = T.ieee_fdiv(T.float32(1), T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(stats[1], T.float32(d)), T.float32(eps))))
        gate(stats[2], out[0], out[1], out, 2)

    return macro


def gate_sums(vec: int):
    """A macro ``(x, k, off, wh, we, sums)`` adding a vector's ``x^2``, ``k^2`` and ``x*w*k``
    (``w = wh * we``) to ``sums[0:3]``, ``x`` and ``k`` read from ``[off:]``."""

    @T.macro
    def add(x, k, off, wh, we, sums):
        for j in T.serial(vec):
            xf = T.cast(x[off + j], T.float32)
            kf = T.cast(k[off + j], T.float32)
            w = T.ieee_mul(T.cast(wh[j], T.float32), T.cast(we[j], T.float32))
            sums[0] = T.ieee_add(sums[0], T.ieee_mul(xf, xf))
            sums[1] = T.ieee_add(sums[1], T.ieee_mul(kf, kf))
            sums[2] = T.ieee_add(sums[2], T.ieee_mul(T.ieee_mul(xf, w), kf))

    return add


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_gate_kernel(
    n: int, d: int, dtype: str, k_dtype: str, v_dtype: str, w_dtype: str, clamp: float, eps: float, add_residual: bool
):
    """``(x_TND, k_TND, v_TD, wh_ND, we_ND, out_TND, stats_TN3)`` kernel for ``N = n`` streams of
    ``D = d`` elements (``x``/``out`` of ``dtype``, ``k``, ``v`` and both weights of their own
    dtypes; the token count is dynamic; ``stats_TN3[t, h] = (rstd_x, rstd_k, raw)`` in float32, for
    the backward). A thread loads its ``v`` before the row reduction, so that latency
    hides behind the reduction's (286 vs 290 us at T = 8192, N = 4, D = 4096 on an H100)."""
    num_tokens = T.dynamic("num_tokens")
    vec, nv, threads, per_thread, warps = row_geometry(d, dtype)
    scalars, reduce, add_sums = gate_scalars(d, eps, clamp), row_reduction(3, warps), gate_sums(vec)

    @T.prim_func
    def gate_kernel(
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
        v_TD: T.Tensor[(num_tokens, d), v_dtype],
        wh_ND: T.Tensor[(n, d), w_dtype],
        we_ND: T.Tensor[(n, d), w_dtype],
        out_TND: T.Tensor[(num_tokens, n, d), dtype],
        stats_TN3: T.Tensor[(num_tokens, n, 3), T.float32],
    ):
        # One grid axis, streams fastest: a token's N CTAs launch together, so v's re-reads hit L2
        # (and the grid's y axis, at most 65535, does not bound the tokens).
        with T.Kernel(num_tokens * n, threads=threads) as b:
            bt, h = b // n, b % n
            tid = T.get_thread_binding()
            x_local = T.alloc_local((per_thread * vec,), dtype)
            k_local = T.alloc_local((per_thread * vec,), k_dtype)
            wh_local = T.alloc_local((vec,), w_dtype)
            we_local = T.alloc_local((vec,), w_dtype)
            v_local = T.alloc_local((per_thread * vec,), v_dtype)
            out_local = T.alloc_local((vec,), dtype)
            sums = T.alloc_local((3,), T.float32)  # sum x^2, sum k^2, sum x*w*k
            partial_3W = T.alloc_shared((3, warps), T.float32)
            stats = T.alloc_local((3,), T.float32)
            row_scalars = T.alloc_local((3,), T.float32)  # rstd_x, rstd_k, gate
            row = T.Cast(T.int64, bt)
            for s in T.serial(3):
                sums[s] = T.float32(0)
            for p in T.unroll(per_thread):
                c = p * threads + tid
                if c < nv:
                    for j in T.vectorized(vec):
                        x_local[p * vec + j] = x_TND[row, h, c * vec + j]
                    for j in T.vectorized(vec):
                        k_local[p * vec + j] = k_TND[row, h, c * vec + j]
                    for j in T.vectorized(vec):
                        wh_local[j] = wh_ND[h, c * vec + j]
                    for j in T.vectorized(vec):
                        we_local[j] = we_ND[h, c * vec + j]
                    add_sums(x_local, k_local, p * vec, wh_local, we_local, sums)
                    for j in T.vectorized(vec):
                        v_local[p * vec + j] = v_TD[row, c * vec + j]
            reduce(sums, partial_3W, stats, tid)
            scalars(stats, row_scalars)
            if tid == 0:
                stats_TN3[row, h, 0] = row_scalars[0]
                stats_TN3[row, h, 1] = row_scalars[1]
                stats_TN3[row, h, 2] = stats[2]
            for p in T.unroll(per_thread):
                c = p * threads + tid
                if c < nv:
                    for j in T.serial(vec):
                        gv = T.ieee_mul(row_scalars[2], T.cast(v_local[p * vec + j], T.float32))
                        if add_residual:
                            out_local[j] = T.cast(T.ieee_add(T.cast(x_local[p * vec + j], T.float32), gv), dtype)
                        else:
                            out_local[j] = T.cast(gv, dtype)
                    for j in T.vectorized(vec):
                        out_TND[row, h, c * vec + j] = out_local[j]

    return gate_kernel


def supports(x_TND, k_TND, v_TD, wh_ND, we_ND) -> bool:
    """True when the kernel takes these dtypes: bfloat16/float16/float32 everywhere, ``wh`` and
    ``we`` of one dtype (float64 anywhere stays with the reference)."""
    tensors = (x_TND, k_TND, v_TD, wh_ND, we_ND)
    return all(t.dtype in KERNEL_DTYPES for t in tensors) and wh_ND.dtype == we_ND.dtype


def check_supported(x_TND, k_TND, v_TD, wh_ND, we_ND) -> None:
    """A TypeError naming the dtypes unless :func:`supports` takes them."""
    if not supports(x_TND, k_TND, v_TD, wh_ND, we_ND):
        raise TypeError(
            "x_TND/k_TND/v_TD/wh_ND/we_ND: the kernel takes bfloat16/float16/float32 tensors with wh and we "
            f"of one dtype, got {x_TND.dtype}, {k_TND.dtype}, {v_TD.dtype}, {wh_ND.dtype}, {we_ND.dtype} "
            "(use kernels.engram.reference.gate)"
        )


def gate(
    x_TND: torch.Tensor,
    k_TND: torch.Tensor,
    v_TD: torch.Tensor,
    wh_ND: torch.Tensor,
    we_ND: torch.Tensor,
    *,
    clamp: float = 1e-6,
    eps: float = 1e-6,
    add_residual: bool = True,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """TileLang :func:`kernels.engram.reference.gate`, the forward (no autograd here: ``kernels.engram.gate``
    pairs it with :func:`gate_backward`).

    Args:
        x_TND: ``[T, N, D]`` bfloat16/float16/float32 on a CUDA device.
        k_TND: ``[T, N, D]``; v_TD: ``[T, D]``; wh_ND, we_ND: ``[N, D]`` of one dtype; all
            bfloat16/float16/float32 (copied first if not contiguous or not 16-byte aligned).
        clamp, eps, add_residual: as the reference.

    Returns:
        ``out_TND`` ``[T, N, D]`` in ``x_TND``'s dtype; with ``return_stats``, also ``stats_TN3``:
        each row's ``(rstd_x, rstd_k, raw = sum x*w*k)`` in float32, for :func:`gate_backward`.
    """
    check_gate_args(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps, values=False)
    check_cuda("x_TND", x_TND)
    check_supported(x_TND, k_TND, v_TD, wh_ND, we_ND)
    t, n, d = x_TND.shape
    out_TND = torch.empty((t, n, d), dtype=x_TND.dtype, device=x_TND.device)
    stats_TN3 = torch.empty((t, n, 3), dtype=torch.float32, device=x_TND.device)  # unread when empty rows
    if t * n * d:
        kernel = get_gate_kernel(
            n, d, *(tl_dtype(a.dtype) for a in (x_TND, k_TND, v_TD, wh_ND)), float(clamp), float(eps), bool(add_residual)
        )
        kernel(aligned(x_TND), aligned(k_TND), aligned(v_TD), aligned(wh_ND), aligned(we_ND), out_TND, stats_TN3)
    return (out_TND, stats_TN3) if return_stats else out_TND
