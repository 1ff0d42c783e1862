"""The fused RMS norm + projection of mHC (:func:`kernels.mhc.reference.norm_fn`), forward:
``mixes = (flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` and ``rstd`` (the backward's input), with
``flat = x.view(T, N*D)`` read once, in its own dtype, and every product in float32 on the CUDA
cores (``fn`` as given, or TF32-rounded by the wrapper, as the reference does).

A CTA is ``WARPS`` warps of ``TOKENS_PER_WARP`` tokens each. It walks ``K = N*D`` in chunks of one
16-byte vector per lane (the next chunk's loads in flight while this one multiplies): the chunk's ``[M, chunk]`` slice of ``fn`` is staged in shared memory
once for the CTA's tokens, and each lane multiplies its vector of each of its warp's tokens by
the ``M`` rows (``TOKENS_PER_WARP`` products per float read from shared memory, what keeps the FMA
pipe, not shared memory, the limit). The reference instead copies the streams to float32, squares
them, takes the mean and runs a float32 GEMM: five passes over ``[T, K]`` floats.

Shape suffixes: T tokens, K = N*D, M mixes.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.mhc.pre_apply_kernel import KERNEL_DTYPES
from kernels.mhc.reference import PARAM_DTYPES, round_to_tf32
from kernels.quant.tiles import PASS_CONFIGS, aligned, check_cuda, tl_dtype, vector_width
from kernels.rows import WARP
from kernels.validate import check_tensor

WARPS = 4
TOKENS_PER_WARP = 4
THREADS = WARPS * WARP


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_norm_fn_kernel(k: int, m: int, dtype: str, eps: float):
    """``(x_TK, fn_MK, mixes_TM, rstd_T)`` kernel for ``K = k`` columns of ``dtype``, ``M = m``
    float32 rows of ``fn`` (the token count is dynamic)."""
    num_tokens = T.dynamic("num_tokens")
    vec = vector_width(k, T.dtype(dtype).bytes)
    chunk = WARP * vec
    chunks = -(-k // chunk)
    wvec = vector_width(k, 4)  # fn's staging vectors (float32)
    staging = -(-m * chunk // (THREADS * wvec))
    tpw, tile_t = TOKENS_PER_WARP, WARPS * TOKENS_PER_WARP

    @T.macro
    def load_x(x_TK, x_local, b, warp, lane, c, num_tokens):
        """The lane's vector of chunk ``c`` of each of its warp's tokens (zeros past the ends)."""
        col = c * chunk + lane * vec
        for t in T.unroll(tpw):
            token = b * tile_t + warp * tpw + t
            for j in T.vectorized(vec):
                x_local[t * vec + j] = T.if_then_else(token < num_tokens and col < k, x_TK[token, col + j],
                                                      T.cast(0, dtype))

    @T.prim_func
    def norm_fn_kernel(
        x_TK: T.Tensor[(num_tokens, k), dtype],
        fn_MK: T.Tensor[(m, k), T.float32],
        mixes_TM: T.Tensor[(num_tokens, m), T.float32],
        rstd_T: T.Tensor[(num_tokens,), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tile_t), threads=THREADS) as b:
            tid = T.get_thread_binding()
            warp, lane = tid // WARP, tid % WARP
            fn_S = T.alloc_shared((m, chunk), T.float32)
            x_local = T.alloc_local((tpw * vec,), dtype)
            x_next = T.alloc_local((tpw * vec,), dtype)  # the next chunk's, loaded while this one multiplies
            w_local = T.alloc_local((vec,), T.float32)
            acc = T.alloc_local((tpw * m,), T.float32)
            sq = T.alloc_local((tpw,), T.float32)
            for i in T.unroll(tpw * m):
                acc[i] = T.float32(0)
            for t in T.unroll(tpw):
                sq[t] = T.float32(0)
            load_x(x_TK, x_next, b, warp, lane, 0, num_tokens)
            for c in T.serial(chunks):
                for s in T.unroll(staging):
                    flat = (s * THREADS + tid) * wvec
                    row, col = flat // chunk, flat % chunk
                    if row < m:
                        for j in T.vectorized(wvec):
                            fn_S[row, col + j] = T.if_then_else(c * chunk + col < k, fn_MK[row, c * chunk + col + j],
                                                                T.float32(0))
                for i in T.unroll(tpw * vec):
                    x_local[i] = x_next[i]
                if c + 1 < chunks:
                    load_x(x_TK, x_next, b, warp, lane, c + 1, num_tokens)
                for t in T.unroll(tpw):
                    for j in T.unroll(vec):
                        sq[t] = sq[t] + T.cast(x_local[t * vec + j], T.float32) * T.cast(x_local[t * vec + j],
                                                                                        T.float32)
                T.sync_threads()
                for r in T.unroll(m):
                    for j in T.vectorized(vec):
                        w_local[j] = fn_S[r, lane * vec + j]
                    for t in T.unroll(tpw):
                        for j in T.unroll(vec):
                            acc[t * m + r] = acc[t * m + r] + T.cast(x_local[t * vec + j], T.float32) * w_local[j]
                T.sync_threads()
            for i in T.unroll(tpw * m):
                acc[i] = T.warp_reduce_sum(acc[i])
            for t in T.unroll(tpw):
                sq[t] = T.warp_reduce_sum(sq[t])
            for t in T.unroll(tpw):
                token = b * tile_t + warp * tpw + t
                if lane == 0 and token < num_tokens:
                    rstd = T.ieee_fdiv(T.float32(1), T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(sq[t], T.float32(k)),
                                                                             T.float32(eps))))
                    rstd_T[token] = rstd
                    for r in T.unroll(m):
                        mixes_TM[token, r] = acc[t * m + r] * rstd

    return norm_fn_kernel


def supports(x_TND: torch.Tensor, fn_MK: torch.Tensor) -> bool:
    """Streams bfloat16/float16/float32 with a float32 ``fn`` (float64 stays with the reference)."""
    return x_TND.dtype in KERNEL_DTYPES and fn_MK.dtype == torch.float32


def norm_fn(x_TND: torch.Tensor, fn_MK: torch.Tensor, *, eps: float, tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mixes_TM, rstd_T)`` float32 as :func:`kernels.mhc.reference.norm_fn` (up to float32
    summation order); shapes, dtypes and devices checked, not values."""
    check_tensor("x_TND", x_TND, dtype=KERNEL_DTYPES, ndim=3)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    check_tensor("fn_MK", fn_MK, dtype=PARAM_DTYPES[:1], ndim=2, device=x_TND.device)
    if fn_MK.shape[1] != n * d:
        raise ValueError(f"fn_MK: expected {n * d} columns (N*D) for x_TND of shape {tuple(x_TND.shape)}, "
                         f"got {tuple(fn_MK.shape)}")
    m = fn_MK.shape[0]
    mixes_TM = torch.empty((t, m), dtype=torch.float32, device=x_TND.device)
    rstd_T = torch.empty((t,), dtype=torch.float32, device=x_TND.device)
    if t == 0:
        return mixes_TM, rstd_T
    w_MK = round_to_tf32(fn_MK) if tf32 else fn_MK
    kernel = get_norm_fn_kernel(n * d, m, tl_dtype(x_TND.dtype), float(eps))
    kernel(aligned(x_TND).view(t, n * d), aligned(w_MK), mixes_TM, rstd_T)
    return mixes_TM, rstd_T
