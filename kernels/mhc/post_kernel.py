"""TileLang kernel of :func:`kernels.mhc.reference.post` (forward):
``out_TND[:, j] = post_TN[:, j] * f_TD + sum_i comb_TNN[:, i, j] * x_TND[:, i]`` (comb transposed).

Memory-bound: ``x`` and ``f`` are read once, ``out`` written once. The tiling is
:mod:`kernels.mhc.pre_apply_kernel`'s: a CTA covers ``tile_m`` tokens x ``tile_v`` vectors of
``vec`` elements (16 bytes of ``x``'s dtype, fewer when ``D`` is not a multiple of that); a thread
loads its vector of ``f`` and of all ``N`` streams, then stores its vector of all ``N`` output
streams.

The float32 math is separate IEEE operations (no FMA contraction), in the reference's order:
``mixed_j = sum_i comb[i, j] * x_i`` over ``i = 0 .. N-1``, then ``post_j * f + mixed_j``. The
reference's ``einsum`` is a batched matmul whose summation order (and FMA use) is cuBLAS's, so the
two may differ by rounding; the GPU tests state the tolerance.

Shape suffixes (as in :mod:`kernels.mhc.reference`): T tokens, N streams, D hidden size of a stream.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.mhc.pre_apply_kernel import KERNEL_DTYPES, THREADS, row_tile
from kernels.mhc.reference import STREAM_DTYPES, _check_param, _check_stream
from kernels.tiles import PASS_CONFIGS, aligned, check_cuda, row_major, tl_dtype, vector_width
from kernels.rows import WARP, row_geometry, row_reduction
from kernels.validate import check_tensor


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_post_kernel(n: int, d: int, dtype: str, f_dtype: str):
    """``(f_TD, x_TND, post_TN, comb_TNN, out_TND)`` kernel for ``N = n`` streams of ``D = d``
    elements of ``dtype`` (``f_TD`` of ``f_dtype``; coefficients float32; the token count is
    dynamic)."""
    num_tokens = T.dynamic("num_tokens")
    vec = vector_width(d, T.dtype(dtype).bytes)
    nv = d // vec
    tile_m, tile_v = row_tile(nv)
    tiles_v = T.ceildiv(nv, tile_v)

    @T.prim_func
    def post_kernel(
        f_TD: T.Tensor[(num_tokens, d), f_dtype],
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        post_TN: T.Tensor[(num_tokens, n), T.float32],
        comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
        out_TND: T.Tensor[(num_tokens, n, d), dtype],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tile_m) * tiles_v, threads=THREADS) as pid:
            bm, bn = row_major(pid, tiles_v)
            tid = T.get_thread_binding()
            x_local = T.alloc_local((n * vec,), dtype)
            f_local = T.alloc_local((vec,), f_dtype)
            acc = T.alloc_local((vec,), T.float32)
            out_local = T.alloc_local((vec,), dtype)
            token = bm * tile_m + tid // tile_v
            c = bn * tile_v + tid % tile_v
            if token < num_tokens and c < nv:
                row = T.Cast(T.int64, token)
                for j in T.vectorized(vec):
                    f_local[j] = f_TD[row, c * vec + j]
                for i in T.unroll(n):  # all loads issue before the first use
                    for j in T.vectorized(vec):
                        x_local[i * vec + j] = x_TND[row, i, c * vec + j]
                for o in T.unroll(n):  # output stream o
                    for j in T.serial(vec):
                        acc[j] = T.ieee_mul(comb_TNN[row, 0, o], T.cast(x_local[j], T.float32))
                    for i in T.unroll(1, n):
                        for j in T.serial(vec):
                            acc[j] = T.ieee_add(
                                acc[j], T.ieee_mul(comb_TNN[row, i, o], T.cast(x_local[i * vec + j], T.float32))
                            )
                    for j in T.serial(vec):
                        out_local[j] = T.cast(
                            T.ieee_add(T.ieee_mul(post_TN[row, o], T.cast(f_local[j], T.float32)), acc[j]), dtype
                        )
                    for j in T.vectorized(vec):
                        out_TND[row, o, c * vec + j] = out_local[j]

    return post_kernel


def supports(f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> bool:
    """True when the kernels take these inputs (``f``/``x`` bfloat16/float16/float32, up to ``WARP``
    streams, coefficients float32); float64 stays with the reference."""
    return (
        f_TD.dtype in KERNEL_DTYPES
        and x_TND.dtype in KERNEL_DTYPES
        and post_TN.dtype == torch.float32
        and comb_TNN.dtype == torch.float32
        and x_TND.dim() == 3
        and x_TND.shape[1] <= WARP
    )


def post(f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> torch.Tensor:
    """TileLang :func:`kernels.mhc.reference.post`, the forward (no autograd here: ``kernels.mhc.post`` pairs
    it with :func:`post_backward`).

    Args:
        f_TD: ``[T, D]`` the sublayer's output, bfloat16/float16/float32.
        x_TND: ``[T, N, D]`` bfloat16/float16/float32 streams on a CUDA device.
        post_TN: ``[T, N]`` float32.
        comb_TNN: ``[T, N, N]`` float32; ``comb[t, i, j]`` weighs input ``i`` in output ``j``.
        (Inputs are copied first if not contiguous or not 16-byte aligned.)

    Returns:
        ``out_TND`` ``[T, N, D]`` in ``x_TND``'s dtype, computed in float32 and rounded once.
    """
    _check_stream("x_TND", x_TND, values=False)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    check_tensor("f_TD", f_TD, dtype=STREAM_DTYPES, shape=(t, d), device=x_TND.device)
    _check_param("post_TN", post_TN, (t, n), x_TND.device, values=False)
    _check_param("comb_TNN", comb_TNN, (t, n, n), x_TND.device, values=False)
    if not supports(f_TD, x_TND, post_TN, comb_TNN):
        raise TypeError(
            "f_TD/x_TND/post_TN/comb_TNN: the kernel takes bfloat16/float16/float32 f and x and float32 "
            f"coefficients, got {f_TD.dtype}, {x_TND.dtype}, {post_TN.dtype}, {comb_TNN.dtype} "
            "(use kernels.mhc.reference.post)"
        )
    out_TND = torch.empty((t, n, d), dtype=x_TND.dtype, device=x_TND.device)
    if t == 0 or d == 0:
        return out_TND
    kernel = get_post_kernel(n, d, tl_dtype(x_TND.dtype), tl_dtype(f_TD.dtype))
    kernel(aligned(f_TD), aligned(x_TND), post_TN.contiguous(), comb_TNN.contiguous(), out_TND)
    return out_TND


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_post_backward_kernel(n: int, d: int, dtype: str, f_dtype: str):
    """``(g_TND, f_TD, x_TND, post_TN, comb_TNN, grad_f_TD, grad_x_TND, grad_post_TN, grad_comb_TNN)``
    kernel: the gradients of ``out_j = post_j f + sum_i comb[i, j] x_i`` given ``g = dL/dout``
    (``x``'s dtype): ``grad_f = sum_j post_j g_j`` and ``grad_x_i = sum_j comb[i, j] g_j`` (float32
    over ``j`` in order, rounded once), ``grad_post_j = sum_d g_j f`` and ``grad_comb[i, j] = sum_d
    x_i g_j`` (float32: each thread over its vectors, warp shuffles, then the warps in order). The
    products and sums may contract into FMAs (a third fewer instructions: the gradients are held to
    a reassociation bound, not to the reference's bits).

    One CTA per token (as :func:`kernels.mhc.pre_apply_kernel.get_pre_apply_backward_kernel`):
    a thread loads its vector of ``g`` for all N streams and of ``f``, then each stream of ``x``
    in turn, storing ``grad_f`` and ``grad_x`` and keeping the ``N + N^2`` partial sums."""
    num_tokens = T.dynamic("num_tokens")
    vec, nv, threads, per_thread, warps = row_geometry(d, dtype)
    sums = n + n * n  # grad_post_j at j, grad_comb[i, j] at n + i * n + j
    reduce = row_reduction(sums, warps)

    @T.prim_func
    def post_backward_kernel(
        g_TND: T.Tensor[(num_tokens, n, d), dtype],
        f_TD: T.Tensor[(num_tokens, d), f_dtype],
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        post_TN: T.Tensor[(num_tokens, n), T.float32],
        comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
        grad_f_TD: T.Tensor[(num_tokens, d), f_dtype],
        grad_x_TND: T.Tensor[(num_tokens, n, d), dtype],
        grad_post_TN: T.Tensor[(num_tokens, n), T.float32],
        grad_comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
    ):
        with T.Kernel(num_tokens, threads=threads) as bt:
            tid = T.get_thread_binding()
            g_local = T.alloc_local((n * vec,), dtype)
            f_local = T.alloc_local((vec,), f_dtype)
            x_local = T.alloc_local((vec,), dtype)
            grad_f_local = T.alloc_local((vec,), f_dtype)
            grad_x_local = T.alloc_local((vec,), dtype)
            acc = T.alloc_local((sums,), T.float32)
            partial_SW = T.alloc_shared((sums, warps), T.float32)
            totals = T.alloc_local((sums,), T.float32)
            mix = T.alloc_var(T.float32)
            row = T.Cast(T.int64, bt)
            for s in T.serial(sums):
                acc[s] = T.float32(0)
            for p in T.unroll(per_thread):
                c = p * threads + tid
                if c < nv:
                    for j in T.unroll(n):  # all N loads issue before the first use
                        for e in T.vectorized(vec):
                            g_local[j * vec + e] = g_TND[row, j, c * vec + e]
                    for e in T.vectorized(vec):
                        f_local[e] = f_TD[row, c * vec + e]
                    for e in T.serial(vec):
                        ff = T.cast(f_local[e], T.float32)
                        mix = post_TN[row, 0] * T.cast(g_local[e], T.float32)
                        acc[0] = acc[0] + T.cast(g_local[e], T.float32) * ff
                        for j in T.unroll(1, n):
                            gj = T.cast(g_local[j * vec + e], T.float32)
                            mix = mix + post_TN[row, j] * gj
                            acc[j] = acc[j] + gj * ff
                        grad_f_local[e] = T.cast(mix, f_dtype)
                    for e in T.vectorized(vec):
                        grad_f_TD[row, c * vec + e] = grad_f_local[e]
                    for i in T.unroll(n):
                        for e in T.vectorized(vec):
                            x_local[e] = x_TND[row, i, c * vec + e]
                        for e in T.serial(vec):
                            xf = T.cast(x_local[e], T.float32)
                            mix = comb_TNN[row, i, 0] * T.cast(g_local[e], T.float32)
                            acc[n + i * n] = acc[n + i * n] + xf * T.cast(g_local[e], T.float32)
                            for j in T.unroll(1, n):
                                gj = T.cast(g_local[j * vec + e], T.float32)
                                mix = mix + comb_TNN[row, i, j] * gj
                                acc[n + i * n + j] = acc[n + i * n + j] + xf * gj
                            grad_x_local[e] = T.cast(mix, dtype)
                        for e in T.vectorized(vec):
                            grad_x_TND[row, i, c * vec + e] = grad_x_local[e]
            reduce(acc, partial_SW, totals, tid)
            if tid == 0:
                for j in T.unroll(n):
                    grad_post_TN[row, j] = totals[j]
                for i in T.unroll(n):
                    for j in T.unroll(n):
                        grad_comb_TNN[row, i, j] = totals[n + i * n + j]

    return post_backward_kernel


def post_backward(
    f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor, g_TND: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TileLang backward of :func:`kernels.mhc.reference.post`: ``(grad_f_TD, grad_x_TND,
    grad_post_TN, grad_comb_TNN)`` for ``g_TND = dL/dout`` (``[T, N, D]`` in ``x_TND``'s dtype), in
    the dtypes of ``f``, ``x`` and float32. Same inputs as :func:`post`."""
    _check_stream("x_TND", x_TND, values=False)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    check_tensor("f_TD", f_TD, dtype=STREAM_DTYPES, shape=(t, d), device=x_TND.device)
    _check_param("post_TN", post_TN, (t, n), x_TND.device, values=False)
    _check_param("comb_TNN", comb_TNN, (t, n, n), x_TND.device, values=False)
    check_tensor("g_TND", g_TND, dtype=x_TND.dtype, shape=(t, n, d), device=x_TND.device)
    if not supports(f_TD, x_TND, post_TN, comb_TNN):
        raise TypeError(
            "f_TD/x_TND/post_TN/comb_TNN: the kernel takes bfloat16/float16/float32 f and x and float32 "
            f"coefficients, got {f_TD.dtype}, {x_TND.dtype}, {post_TN.dtype}, {comb_TNN.dtype} "
            "(use kernels.mhc.reference.post)"
        )
    grad_f_TD = torch.empty((t, d), dtype=f_TD.dtype, device=x_TND.device)
    grad_x_TND = torch.empty((t, n, d), dtype=x_TND.dtype, device=x_TND.device)
    grad_post_TN = torch.empty((t, n), dtype=torch.float32, device=x_TND.device)  # the kernel writes every row
    grad_comb_TNN = torch.empty((t, n, n), dtype=torch.float32, device=x_TND.device)
    if t == 0 or d == 0:
        return grad_f_TD, grad_x_TND, grad_post_TN.zero_(), grad_comb_TNN.zero_()
    kernel = get_post_backward_kernel(n, d, tl_dtype(x_TND.dtype), tl_dtype(f_TD.dtype))
    kernel(aligned(g_TND), aligned(f_TD), aligned(x_TND), post_TN.contiguous(), comb_TNN.contiguous(), grad_f_TD,
           grad_x_TND, grad_post_TN, grad_comb_TNN)
    return grad_f_TD, grad_x_TND, grad_post_TN, grad_comb_TNN
