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

from kernels.mhc.pre_apply_kernel import KERNEL_DTYPES, THREADS, aligned, row_tile
from kernels.mhc.reference import STREAM_DTYPES, _check_param, _check_stream
from kernels.quant.tiles import PASS_CONFIGS, check_cuda, tl_dtype, vector_width
from kernels.validate import check_finite, check_tensor


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_post_kernel(n: int, d: int, dtype: str, f_dtype: str):
    """``(f_TD, x_TND, post_TN, comb_TNN, out_TND)`` kernel for ``N = n`` streams of ``D = d``
    elements of ``dtype`` (``f_TD`` of ``f_dtype``; coefficients float32; the token count is
    dynamic)."""
    num_tokens = T.dynamic("num_tokens")
    vec = vector_width(d, T.dtype(dtype).bytes)
    nv = d // vec
    tile_m, tile_v = row_tile(nv)

    @T.prim_func
    def post_kernel(
        f_TD: T.Tensor[(num_tokens, d), f_dtype],
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        post_TN: T.Tensor[(num_tokens, n), T.float32],
        comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
        out_TND: T.Tensor[(num_tokens, n, d), dtype],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tile_m), T.ceildiv(nv, tile_v), threads=THREADS) as (bm, bn):
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
    """True when the kernel takes these dtypes (``f``/``x`` bfloat16/float16/float32, coefficients
    float32); float64 stays with the reference."""
    return (
        f_TD.dtype in KERNEL_DTYPES
        and x_TND.dtype in KERNEL_DTYPES
        and post_TN.dtype == torch.float32
        and comb_TNN.dtype == torch.float32
    )


def post(f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> torch.Tensor:
    """TileLang :func:`kernels.mhc.reference.post` (forward only; no autograd).

    Args:
        f_TD: ``[T, D]`` the sublayer's output, bfloat16/float16/float32.
        x_TND: ``[T, N, D]`` bfloat16/float16/float32 streams on a CUDA device.
        post_TN: ``[T, N]`` float32.
        comb_TNN: ``[T, N, N]`` float32; ``comb[t, i, j]`` weighs input ``i`` in output ``j``.
        (Inputs are copied first if not contiguous or not 16-byte aligned.)

    Returns:
        ``out_TND`` ``[T, N, D]`` in ``x_TND``'s dtype, computed in float32 and rounded once.
    """
    _check_stream("x_TND", x_TND)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    check_tensor("f_TD", f_TD, dtype=STREAM_DTYPES, shape=(t, d), device=x_TND.device)
    check_finite("f_TD", f_TD)
    _check_param("post_TN", post_TN, (t, n), x_TND.device)
    _check_param("comb_TNN", comb_TNN, (t, n, n), x_TND.device)
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
