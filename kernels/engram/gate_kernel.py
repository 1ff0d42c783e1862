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
(:func:`get_gate_backward_kernel`, one persistent kernel for all five gradients) starts.

Shape suffixes (as in :mod:`kernels.engram.reference`): T tokens, N mHC streams, D hidden size.
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.engram.reference import check_gate_args
from kernels.quant.tiles import (
    PASS_CONFIGS,
    aligned,
    check_cuda,
    tl_dtype,
)
from kernels.rows import row_geometry, row_reduction
from kernels.validate import check_tensor

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


# The persistent grid (bench/scripts/sweep.py, H100, T = 8192, N = 4): 512 threads, one CTA per
# SM: 541 / 967 us at D = 4096 / 7168; 256 threads 592 / 1170, 1024 threads 540 / 1214; two CTAs
# per SM 1-2% slower.
BACKWARD_THREADS = 512
BACKWARD_CTAS_PER_SM = 1  # at most one per token


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_gate_backward_kernel(
    n: int, d: int, dtype: str, k_dtype: str, v_dtype: str, clamp: float, add_residual: bool,
    max_threads: int = BACKWARD_THREADS,
):
    """``(x_TND, k_TND, v_TD, w_ND, g_TND, stats_TN3, grad_x_TND, grad_k_TND, grad_v_TD,
    grad_w_CND)`` kernel (``w = wh * we`` in float32, ``stats_TN3`` the forward's ``(rstd_x, rstd_k,
    raw)``): the gradients of the gate (:func:`kernels.engram.reference._gate_bwd`'s formulas), the
    weights' as ``grad_w_CND[c] = sum over CTA c's tokens of dL/draw * x * k`` (float32; the caller
    sums over ``C`` and multiplies by ``we`` and ``wh``).

    A persistent grid of ``C`` CTAs (``C`` <= tokens), CTA ``c`` taking tokens ``c, c + C, ...``,
    so that ``x`` and ``k`` are read once for every gradient: the weight gradients accumulate in
    shared memory (each thread its ``N`` streams times its columns, a thread's a stride apart) and
    are stored once at the end. Per token, a thread loads its vectors of ``g`` for every stream and
    of ``v``, and of the first stream's ``x`` and ``k``; ``dL/dgate = sum g*v`` of all N streams is
    one CTA reduction (warp shuffles, then the warps in order); then stream by stream, with the next
    stream's ``x`` and ``k`` loading, it derives the row's coefficients from the saved statistics
    and stores ``grad_x`` and ``grad_k``, adding ``g * gate`` to its ``grad_v`` registers. The
    per-element arithmetic may contract into FMAs (the gradients are held to a reassociation bound,
    not bits)."""
    num_tokens = T.dynamic("num_tokens")
    num_ctas = T.dynamic("num_ctas")
    vec, nv, threads, per_thread, warps = row_geometry(d, dtype, max_threads)
    reduce, gate_of = row_reduction(n, warps), gate_value(d, clamp)
    width = per_thread * vec  # a thread's elements of a row

    @T.macro
    def load(src, row, h, dst, off, tid):
        """A thread's vectors of ``src[row, h]`` into ``dst[off:]``."""
        for p in T.unroll(per_thread):
            c = p * threads + tid
            if c < nv:
                for j in T.vectorized(vec):
                    dst[off + p * vec + j] = src[row, h, c * vec + j]

    def acc_index(e, tid):
        return e * threads + tid  # a thread's accumulators a stride apart: a warp's accesses hit 32 banks

    @T.prim_func
    def gate_backward_kernel(
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
        v_TD: T.Tensor[(num_tokens, d), v_dtype],
        w_ND: T.Tensor[(n, d), T.float32],
        g_TND: T.Tensor[(num_tokens, n, d), dtype],
        stats_TN3: T.Tensor[(num_tokens, n, 3), T.float32],
        grad_x_TND: T.Tensor[(num_tokens, n, d), dtype],
        grad_k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
        grad_v_TD: T.Tensor[(num_tokens, d), v_dtype],
        grad_w_CND: T.Tensor[(num_ctas, n, d), T.float32],
    ):
        with T.Kernel(num_ctas, threads=threads) as cta:
            tid = T.get_thread_binding()
            g_rows = T.alloc_local((n * width,), dtype)
            v_row = T.alloc_local((width,), v_dtype)
            x_rows = T.alloc_local((2 * width,), dtype)  # this stream's and the next's (unrolled: registers)
            k_rows = T.alloc_local((2 * width,), k_dtype)
            wl = T.alloc_local((vec,), T.float32)
            out_x = T.alloc_local((vec,), dtype)
            out_k = T.alloc_local((vec,), k_dtype)
            out_v = T.alloc_local((vec,), v_dtype)
            grad_v = T.alloc_local((width,), T.float32)
            grad_w = T.alloc_shared((n * width * threads,), T.float32)
            dgate = T.alloc_local((n,), T.float32)  # dL/dgate per stream: this thread's part, then the CTA's
            totals = T.alloc_local((n,), T.float32)
            partial_NW = T.alloc_shared((n, warps), T.float32)
            coefs = T.alloc_local((4,), T.float32)  # gate, dL/draw, raw rstd_x^2 / D, raw rstd_k^2 / D
            for e in T.serial(n * width):
                grad_w[acc_index(e, tid)] = T.float32(0)
            for i in T.serial(T.ceildiv(num_tokens - cta, num_ctas)):
                row = T.Cast(T.int64, cta + i * num_ctas)
                for h in T.unroll(n):
                    load(g_TND, row, h, g_rows, h * width, tid)
                for p in T.unroll(per_thread):
                    c = p * threads + tid
                    if c < nv:
                        for j in T.vectorized(vec):
                            v_row[p * vec + j] = v_TD[row, c * vec + j]
                load(x_TND, row, 0, x_rows, 0, tid)
                load(k_TND, row, 0, k_rows, 0, tid)
                for h in T.unroll(n):
                    dgate[h] = T.float32(0)
                    for p in T.unroll(per_thread):
                        if p * threads + tid < nv:
                            for j in T.serial(vec):
                                e = p * vec + j
                                dgate[h] += T.cast(g_rows[h * width + e], T.float32) * T.cast(v_row[e], T.float32)
                reduce(dgate, partial_NW, totals, tid)
                T.sync_threads()  # every thread has read the partials before the next token writes them
                for e in T.unroll(width):
                    grad_v[e] = T.float32(0)
                for h in T.unroll(n):
                    if h < n - 1:
                        load(x_TND, row, h + 1, x_rows, ((h + 1) % 2) * width, tid)
                        load(k_TND, row, h + 1, k_rows, ((h + 1) % 2) * width, tid)
                    rstd_x, rstd_k, raw = stats_TN3[row, h, 0], stats_TN3[row, h, 1], stats_TN3[row, h, 2]
                    gate_of(raw, rstd_x, rstd_k, coefs, 0)
                    scale = T.ieee_fdiv(T.ieee_mul(rstd_x, rstd_k), T.float32(math.sqrt(d)))  # dot = raw * scale
                    live = T.abs(T.ieee_mul(raw, scale)) >= T.float32(clamp)
                    slope = T.ieee_mul(T.ieee_mul(T.ieee_mul(totals[h], coefs[0]), T.ieee_sub(T.float32(1), coefs[0])),
                                       T.float32(0.5))
                    root = T.ieee_fsqrt(T.ieee_fdiv(scale, T.if_then_else(live, T.abs(raw), T.float32(1))))
                    coefs[1] = T.if_then_else(live, T.ieee_mul(slope, root), T.float32(0))
                    coefs[2] = T.ieee_fdiv(T.ieee_mul(raw, T.ieee_mul(rstd_x, rstd_x)), T.float32(d))
                    coefs[3] = T.ieee_fdiv(T.ieee_mul(raw, T.ieee_mul(rstd_k, rstd_k)), T.float32(d))
                    for p in T.unroll(per_thread):
                        c = p * threads + tid
                        if c < nv:
                            for j in T.vectorized(vec):
                                wl[j] = w_ND[h, c * vec + j]
                            for j in T.serial(vec):
                                e = p * vec + j
                                xf = T.cast(x_rows[(h % 2) * width + e], T.float32)
                                kf = T.cast(k_rows[(h % 2) * width + e], T.float32)
                                gf = T.cast(g_rows[h * width + e], T.float32)
                                dx = coefs[1] * (wl[j] * kf - xf * coefs[2])
                                out_x[j] = T.cast(dx + gf if add_residual else dx, dtype)
                                out_k[j] = T.cast(coefs[1] * (wl[j] * xf - kf * coefs[3]), k_dtype)
                                grad_v[e] += gf * coefs[0]
                                grad_w[acc_index(h * width + e, tid)] += coefs[1] * xf * kf
                            for j in T.vectorized(vec):
                                grad_x_TND[row, h, c * vec + j] = out_x[j]
                            for j in T.vectorized(vec):
                                grad_k_TND[row, h, c * vec + j] = out_k[j]
                for p in T.unroll(per_thread):
                    c = p * threads + tid
                    if c < nv:
                        for j in T.serial(vec):
                            out_v[j] = T.cast(grad_v[p * vec + j], v_dtype)
                        for j in T.vectorized(vec):
                            grad_v_TD[row, c * vec + j] = out_v[j]
            for h in T.unroll(n):
                for p in T.unroll(per_thread):
                    c = p * threads + tid
                    if c < nv:
                        for j in T.vectorized(vec):
                            grad_w_CND[cta, h, c * vec + j] = grad_w[acc_index(h * width + p * vec + j, tid)]

    return gate_backward_kernel


ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # unit roundoff, times two


def backward_excess(grads: tuple, want: tuple) -> dict[str, float]:
    """How far each of :func:`gate_backward`'s ``(grad_x, grad_k, grad_v, grad_wh, grad_we)`` lies
    beyond its tolerance around the reference autograd's ``want`` (<= 0: within), by name. Per
    element the bound is ``2 u |want| + 1e-3 max |want|`` (``u`` of the gradient's dtype): the row
    statistics and the sums over D (and over tokens for ``wh``/``we``) are reassociated, which moves
    the gate by well under 1e-4 (the forward's bound), and the backward's slope ``gate (1 - gate) /
    2 sqrt(c / |raw|)`` amplifies it a little more. The GPU tests and the benchmark's check use it."""
    excess = {}
    for name, got, ref in zip(("x", "k", "v", "wh", "we"), grads, want):
        if ref.numel():
            bound = 2 * ULP[ref.dtype] * ref.double().abs() + 1e-3 * float(ref.double().abs().max()) + 1e-30
            excess[name] = float(((got.double() - ref.double()).abs() - bound).max())
    return excess


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


def backward_shared_bytes(n: int, d: int, dtype: torch.dtype, threads: int = BACKWARD_THREADS) -> int:
    """Shared memory of a backward CTA: the weight gradients' float32 accumulators (``N`` times a
    row, padded to whole thread vectors) and the row reduction's partials."""
    vec, _, threads, per_thread, warps = row_geometry(d, tl_dtype(dtype), threads)
    return 4 * (n * per_thread * vec * threads + 4 * warps)


def backward_fits(x_TND: torch.Tensor, threads: int = BACKWARD_THREADS) -> bool:
    """Whether the backward's CTA fits the device's shared memory for ``x_TND``'s ``N`` and ``D``
    (about ``4 N D`` bytes: N * D up to ~56K elements on a Hopper GPU)."""
    _, n, d = x_TND.shape
    limit = torch.cuda.get_device_properties(x_TND.device).shared_memory_per_block_optin
    return backward_shared_bytes(n, d, x_TND.dtype, threads) <= limit


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


def gate_backward(
    x_TND: torch.Tensor,
    k_TND: torch.Tensor,
    v_TD: torch.Tensor,
    wh_ND: torch.Tensor,
    we_ND: torch.Tensor,
    g_TND: torch.Tensor,
    stats_TN3: torch.Tensor,
    *,
    clamp: float = 1e-6,
    add_residual: bool = True,
    threads: int = BACKWARD_THREADS,
    ctas_per_sm: int = BACKWARD_CTAS_PER_SM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TileLang backward of :func:`kernels.engram.reference.gate`: ``(grad_x, grad_k, grad_v,
    grad_wh, grad_we)`` in the dtypes of their inputs, for ``g_TND = dL/dout`` (``x_TND``'s dtype)
    and the forward's row statistics ``stats_TN3`` (``gate(..., return_stats=True)``). Same inputs
    as :func:`gate`. ``threads`` (at most, per CTA) and ``ctas_per_sm`` shape the persistent grid
    (tuning, bench/scripts/sweep.py; the defaults are measured)."""
    check_gate_args(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, 0.0, values=False)
    check_cuda("x_TND", x_TND)
    check_tensor("g_TND", g_TND, dtype=x_TND.dtype, shape=x_TND.shape, device=x_TND.device)
    check_tensor("stats_TN3", stats_TN3, dtype=torch.float32, shape=(*x_TND.shape[:2], 3), device=x_TND.device)
    check_supported(x_TND, k_TND, v_TD, wh_ND, we_ND)
    if not backward_fits(x_TND, threads):
        raise ValueError(
            f"x_TND: N * D = {x_TND.shape[1]} * {x_TND.shape[2]} needs "
            f"{backward_shared_bytes(*x_TND.shape[1:], x_TND.dtype, threads)} bytes of shared memory for the weight "
            "gradients' accumulators, more than this device gives a CTA (use kernels.engram.reference.gate)"
        )
    t, n, d = x_TND.shape
    grad_x = torch.empty_like(x_TND, memory_format=torch.contiguous_format)
    grad_k = torch.empty_like(k_TND, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v_TD, memory_format=torch.contiguous_format)
    if t * n * d == 0:
        grad_v.zero_()
        zeros = torch.zeros_like(wh_ND, memory_format=torch.contiguous_format)
        return grad_x, grad_k, grad_v, zeros, zeros.clone()
    sms = torch.cuda.get_device_properties(x_TND.device).multi_processor_count
    grad_w_CND = torch.empty((min(t, sms * ctas_per_sm), n, d), dtype=torch.float32, device=x_TND.device)
    w_ND = torch.mul(wh_ND.float(), we_ND)  # the reference's float32 w (we promoted in the product: one launch fewer)
    dtypes = [tl_dtype(a.dtype) for a in (x_TND, k_TND, v_TD)]
    args = [aligned(a) for a in (x_TND, k_TND, v_TD, w_ND, g_TND)] + [stats_TN3.contiguous()]
    get_gate_backward_kernel(n, d, *dtypes, float(clamp), bool(add_residual), threads)(
        *args, grad_x, grad_k, grad_v, grad_w_CND)
    grad_w_ND = grad_w_CND.sum(0)
    # products in float32 stored straight in the weights' dtypes (out=: one launch each, not two)
    grad_wh = torch.mul(grad_w_ND, we_ND, out=torch.empty_like(wh_ND, memory_format=torch.contiguous_format))
    grad_we = torch.mul(grad_w_ND, wh_ND, out=torch.empty_like(we_ND, memory_format=torch.contiguous_format))
    return grad_x, grad_k, grad_v, grad_wh, grad_we
