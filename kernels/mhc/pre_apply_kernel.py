"""TileLang kernel of :func:`kernels.mhc.reference.pre_apply`: ``y_TD = sum_i pre_TN[:, i] * x_TND[:, i, :]``.

Memory-bound: every byte of ``x`` is read once and ``y`` written once. A CTA of ``THREADS`` threads
covers ``tile_m`` tokens x ``tile_v`` vectors of ``vec`` elements (16 bytes of ``x``'s dtype, fewer
when ``D`` is not a multiple of that); each thread loads its vector of all ``N`` streams
(``ld.global.v4``), accumulates in float32 and stores one vector of ``y`` (``st.global.v4``).

The float32 math is separate IEEE multiplies and adds (``T.ieee_mul``/``T.ieee_add``, so nvcc cannot
contract them into FMAs), summed over the streams in order ``i = 0 .. N-1``, as the reference's
``(pre[:, :, None] * x).sum(1)`` evaluates it.

Shape suffixes (as in :mod:`kernels.mhc.reference`): T tokens, N streams, D hidden size of a stream.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.mhc.reference import _check_param, _check_stream
from kernels.quant.tiles import (
    PASS_CONFIGS,
    VECTOR_BYTES,
    check_cuda,
    tl_dtype,
    vector_width,
)

THREADS = 128  # one vector of the output per thread
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # streams; float64 stays with the reference


def row_tile(nv: int) -> tuple[int, int]:
    """``(tile_m, tile_v)``: a CTA tile of ``tile_m`` tokens x ``tile_v`` vectors for rows of ``nv``
    vectors; ``tile_v`` a power of two up to ``THREADS`` (a static divisor; few values, few compiles)
    and ``tile_m * tile_v = THREADS``, so short rows (D = 64) still fill the CTA."""
    tile_v = min(THREADS, 1 << max(0, nv - 1).bit_length())
    return THREADS // tile_v, tile_v


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous and 16-byte aligned (vector accesses need both), else a copy."""
    if t.is_contiguous() and t.data_ptr() % VECTOR_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_pre_apply_kernel(n: int, d: int, dtype: str):
    """``(x_TND, pre_TN, y_TD)`` kernel for ``N = n`` streams of ``D = d`` elements of ``dtype``
    (``pre_TN`` float32; the token count is dynamic)."""
    num_tokens = T.dynamic("num_tokens")
    vec = vector_width(d, T.dtype(dtype).bytes)
    nv = d // vec
    tile_m, tile_v = row_tile(nv)

    @T.prim_func
    def pre_apply_kernel(
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        pre_TN: T.Tensor[(num_tokens, n), T.float32],
        y_TD: T.Tensor[(num_tokens, d), dtype],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tile_m), T.ceildiv(nv, tile_v), threads=THREADS) as (bm, bn):
            tid = T.get_thread_binding()
            x_local = T.alloc_local((n * vec,), dtype)
            acc = T.alloc_local((vec,), T.float32)
            token = bm * tile_m + tid // tile_v
            c = bn * tile_v + tid % tile_v
            if token < num_tokens and c < nv:
                row = T.Cast(T.int64, token)
                for i in T.unroll(n):  # all N loads issue before the first use
                    for j in T.vectorized(vec):
                        x_local[i * vec + j] = x_TND[row, i, c * vec + j]
                for j in T.serial(vec):
                    acc[j] = T.ieee_mul(pre_TN[row, 0], T.cast(x_local[j], T.float32))
                for i in T.unroll(1, n):
                    for j in T.serial(vec):
                        acc[j] = T.ieee_add(acc[j], T.ieee_mul(pre_TN[row, i], T.cast(x_local[i * vec + j], T.float32)))
                for j in T.vectorized(vec):
                    y_TD[row, c * vec + j] = T.cast(acc[j], dtype)

    return pre_apply_kernel


def supports(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> bool:
    """True when the kernel takes these dtypes (streams bfloat16/float16/float32, ``pre`` float32);
    float64 stays with the reference."""
    return x_TND.dtype in KERNEL_DTYPES and pre_TN.dtype == torch.float32


def pre_apply(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
    """TileLang :func:`kernels.mhc.reference.pre_apply` (forward only; no autograd).

    Args:
        x_TND: ``[T, N, D]`` bfloat16/float16/float32 streams on a CUDA device (copied first if not
            contiguous or not 16-byte aligned).
        pre_TN: ``[T, N]`` float32 weights.

    Returns:
        ``y_TD`` ``[T, D]`` in ``x_TND``'s dtype, accumulated in float32.
    """
    _check_stream("x_TND", x_TND)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    _check_param("pre_TN", pre_TN, (t, n), x_TND.device)
    if not supports(x_TND, pre_TN):
        raise TypeError(
            f"x_TND/pre_TN: the kernel takes bfloat16/float16/float32 streams and float32 weights, got "
            f"{x_TND.dtype} and {pre_TN.dtype} (use kernels.mhc.reference.pre_apply)"
        )
    y_TD = torch.empty((t, d), dtype=x_TND.dtype, device=x_TND.device)
    if t == 0 or d == 0:
        return y_TD
    kernel = get_pre_apply_kernel(n, d, tl_dtype(x_TND.dtype))
    kernel(aligned(x_TND), pre_TN.contiguous(), y_TD)
    return y_TD
