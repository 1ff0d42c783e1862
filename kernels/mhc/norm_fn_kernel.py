"""The fused RMS norm + projection of mHC (:func:`kernels.mhc.reference.norm_fn`), forward:
``mixes = (flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` and ``rstd`` (the backward's input), and the
backward's ``grad_x = (g * rstd) @ fn - coef * flat``, with
``flat = x.view(T, N*D)`` read once, in its own dtype, and every product in float32 on the CUDA
cores (``fn`` as given, or TF32-rounded by the wrapper, as the reference does).

A CTA is ``WARPS`` warps of ``TOKENS_PER_WARP`` tokens each. It walks ``K = N*D`` in chunks of 16
bytes per lane (the next chunk's loads in flight while this one multiplies): the chunk's
``[M, chunk]`` slice of ``fn`` is staged in shared memory once for the CTA's tokens, and each lane
multiplies its elements of each of its warp's tokens by the ``M`` rows (``TOKENS_PER_WARP`` FMAs per
float read from shared memory; NOTES.md has the measurements). The reference instead copies the streams to float32, squares
them, takes the mean and runs a float32 GEMM: five passes over ``[T, K]`` floats.

Shape suffixes: T tokens, K = N*D, M mixes.
"""

from typing import Callable, NamedTuple

import tilelang
import torch
from tilelang import language as T

from kernels.mhc.pre_apply_kernel import KERNEL_DTYPES
from kernels.mhc.reference import check_norm_fn_args, norm_fn_backward_terms, round_to_tf32
from kernels.quant.tiles import PASS_CONFIGS, aligned, check_cuda, tl_dtype, vector_width
from kernels.rows import WARP
from kernels.validate import check_tensor

WARPS = 4
TOKENS_PER_WARP = 4
THREADS = WARPS * WARP


class Walk(NamedTuple):
    """A walk over ``K`` columns in chunks of ``vec`` elements a lane (see :func:`chunk_walk`)."""

    vec: int
    chunk: int
    chunks: int
    parts: int
    sub: int
    tile_t: int
    lane_col: Callable
    stage_fn: Callable
    load_x: Callable
    load_w: Callable
    norm_walk: Callable


def chunk_walk(k: int, m: int, dtype: str) -> Walk:
    """The walk over ``K = k`` columns of ``dtype`` in chunks of 16 bytes per lane:
    ``stage_fn(fn_MK, fn_S, c, tid)`` copies the chunk's ``[M, chunk]`` slice of ``fn`` to shared
    memory (no barrier); ``load_x(x_TK, x_local, b, warp, lane, c, num_tokens)`` loads the lane's
    elements of each of its warp's tokens (zeros past the ends), ``load_w(fn_S, w_local, r, lane)``
    the matching ones of ``fn``'s row ``r``; ``lane_col(lane, q)`` is where part ``q`` of them sits in
    the chunk; ``norm_walk`` the forward's sums (the next chunk's loads in flight while this one
    multiplies)."""
    vec = vector_width(k, T.dtype(dtype).bytes)
    chunk = WARP * vec
    # A lane's vec elements are `parts` runs of `sub` (16 bytes of float32 fn), WARP * sub apart, so
    # that each 16-byte shared read of fn is one contiguous 512 bytes across the warp (no bank
    # conflicts; whole 16-byte vectors a lane made them 2-way conflicted).
    sub = min(vec, 4)
    parts = vec // sub
    wvec = vector_width(k, 4)  # fn's staging vectors (float32)
    staging = -(-m * chunk // (THREADS * wvec))
    tpw, tile_t = TOKENS_PER_WARP, WARPS * TOKENS_PER_WARP

    @T.macro
    def stage_fn(fn_MK, fn_S, c, tid):
        for s in T.unroll(staging):
            flat = (s * THREADS + tid) * wvec
            row, col = flat // chunk, flat % chunk
            if row < m:
                for j in T.vectorized(wvec):
                    fn_S[row, col + j] = T.if_then_else(c * chunk + col < k, fn_MK[row, c * chunk + col + j],
                                                        T.float32(0))

    def lane_col(lane, q):
        """The column in its chunk of part ``q`` of the lane's elements."""
        return q * (WARP * sub) + lane * sub

    @T.macro
    def load_x(x_TK, x_local, b, warp, lane, c, num_tokens):
        for t in T.unroll(tpw):
            token = b * tile_t + warp * tpw + t
            for q in T.unroll(parts):
                col = c * chunk + lane_col(lane, q)
                for j in T.vectorized(sub):
                    x_local[t * vec + q * sub + j] = T.if_then_else(token < num_tokens and col < k,
                                                                    x_TK[token, col + j], T.cast(0, dtype))

    @T.macro
    def load_w(fn_S, w_local, r, lane):
        for q in T.unroll(parts):
            for j in T.vectorized(sub):
                w_local[q * sub + j] = fn_S[r, lane_col(lane, q) + j]

    chunks = -(-k // chunk)

    @T.macro
    def norm_walk(x_TK, fn_MK, acc, sq, b, tid, num_tokens):
        """``acc[t * M + r] = sum_k x[t, k] * fn[r, k]`` and ``sq[t] = sum_k x[t, k]^2`` for the
        warp's tokens, every lane holding the totals."""
        warp, lane = tid // WARP, tid % WARP
        fn_S = T.alloc_shared((m, chunk), T.float32)
        x_local = T.alloc_local((tpw * vec,), dtype)
        x_next = T.alloc_local((tpw * vec,), dtype)  # the next chunk's, loaded while this one multiplies
        w_local = T.alloc_local((vec,), T.float32)
        for i in T.unroll(tpw * m):
            acc[i] = T.float32(0)
        for t in T.unroll(tpw):
            sq[t] = T.float32(0)
        load_x(x_TK, x_next, b, warp, lane, 0, num_tokens)
        for c in T.serial(chunks):
            stage_fn(fn_MK, fn_S, c, tid)
            for i in T.unroll(tpw * vec):
                x_local[i] = x_next[i]
            if c + 1 < chunks:
                load_x(x_TK, x_next, b, warp, lane, c + 1, num_tokens)
            for t in T.unroll(tpw):
                for j in T.unroll(vec):
                    sq[t] = sq[t] + T.cast(x_local[t * vec + j], T.float32) * T.cast(x_local[t * vec + j], T.float32)
            T.sync_threads()
            for r in T.unroll(m):
                load_w(fn_S, w_local, r, lane)
                for t in T.unroll(tpw):
                    for j in T.unroll(vec):
                        acc[t * m + r] = acc[t * m + r] + T.cast(x_local[t * vec + j], T.float32) * w_local[j]
            T.sync_threads()
        for i in T.unroll(tpw * m):
            acc[i] = T.warp_reduce_sum(acc[i])
        for t in T.unroll(tpw):
            sq[t] = T.warp_reduce_sum(sq[t])

    return Walk(vec, chunk, chunks, parts, sub, tile_t, lane_col, stage_fn, load_x, load_w, norm_walk)


def rstd_of(sq, k: int, eps: float):
    """``1 / sqrt(sq / K + eps)`` in IEEE operations."""
    return T.ieee_fdiv(T.float32(1), T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(sq, T.float32(k)), T.float32(eps))))


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_norm_fn_kernel(k: int, m: int, dtype: str, eps: float):
    """``(x_TK, fn_MK, mixes_TM, rstd_T)`` kernel for ``K = k`` columns of ``dtype``, ``M = m``
    float32 rows of ``fn`` (the token count is dynamic)."""
    num_tokens = T.dynamic("num_tokens")
    walk = chunk_walk(k, m, dtype)
    tile_t, tpw = walk.tile_t, TOKENS_PER_WARP

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
            acc = T.alloc_local((tpw * m,), T.float32)
            sq = T.alloc_local((tpw,), T.float32)
            walk.norm_walk(x_TK, fn_MK, acc, sq, b, tid, num_tokens)
            for t in T.unroll(tpw):
                token = b * tile_t + warp * tpw + t
                if lane == 0 and token < num_tokens:
                    rstd = rstd_of(sq[t], k, eps)
                    rstd_T[token] = rstd
                    for r in T.unroll(m):
                        mixes_TM[token, r] = acc[t * m + r] * rstd

    return norm_fn_kernel


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_norm_fn_backward_kernel(k: int, m: int, dtype: str):
    """``(x_TK, fn_MK, gproj_TM, coef_T, grad_TK)`` kernel: ``grad = gproj @ fn - coef * x`` in
    ``dtype`` (``gproj = g * rstd``, ``coef = sum_m(g * mixes) * rstd^2 / K``: the reference
    backward's terms, computed by torch on ``[T, M]``). The same walk as the forward: per chunk a
    lane's ``vec`` outputs for each of its warp's tokens, ``M`` FMAs each."""
    num_tokens = T.dynamic("num_tokens")
    walk = chunk_walk(k, m, dtype)
    vec, chunk, tile_t, tpw = walk.vec, walk.chunk, walk.tile_t, TOKENS_PER_WARP

    @T.prim_func
    def norm_fn_backward_kernel(
        x_TK: T.Tensor[(num_tokens, k), dtype],
        fn_MK: T.Tensor[(m, k), T.float32],
        gproj_TM: T.Tensor[(num_tokens, m), T.float32],
        coef_T: T.Tensor[(num_tokens,), T.float32],
        grad_TK: T.Tensor[(num_tokens, k), dtype],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tile_t), threads=THREADS) as b:
            tid = T.get_thread_binding()
            warp, lane = tid // WARP, tid % WARP
            fn_S = T.alloc_shared((m, chunk), T.float32)
            x_local = T.alloc_local((tpw * vec,), dtype)
            x_next = T.alloc_local((tpw * vec,), dtype)
            w_local = T.alloc_local((vec,), T.float32)
            gp = T.alloc_local((tpw * m,), T.float32)
            coef = T.alloc_local((tpw,), T.float32)
            acc = T.alloc_local((tpw * vec,), T.float32)
            out = T.alloc_local((vec,), dtype)
            for t in T.unroll(tpw):
                token = b * tile_t + warp * tpw + t
                coef[t] = T.if_then_else(token < num_tokens, coef_T[token], T.float32(0))
                for r in T.unroll(m):
                    gp[t * m + r] = T.if_then_else(token < num_tokens, gproj_TM[token, r], T.float32(0))
            walk.load_x(x_TK, x_next, b, warp, lane, 0, num_tokens)
            for c in T.serial(walk.chunks):
                walk.stage_fn(fn_MK, fn_S, c, tid)
                for i in T.unroll(tpw * vec):
                    x_local[i] = x_next[i]
                    acc[i] = T.float32(0)
                if c + 1 < walk.chunks:
                    walk.load_x(x_TK, x_next, b, warp, lane, c + 1, num_tokens)
                T.sync_threads()
                for r in T.unroll(m):
                    walk.load_w(fn_S, w_local, r, lane)
                    for t in T.unroll(tpw):
                        for j in T.unroll(vec):
                            acc[t * vec + j] = acc[t * vec + j] + gp[t * m + r] * w_local[j]
                T.sync_threads()
                for t in T.unroll(tpw):
                    token = b * tile_t + warp * tpw + t
                    for j in T.unroll(vec):
                        out[j] = T.cast(acc[t * vec + j] - coef[t] * T.cast(x_local[t * vec + j], T.float32), dtype)
                    for q in T.unroll(walk.parts):
                        col = c * chunk + walk.lane_col(lane, q)
                        if token < num_tokens and col < k:
                            for j in T.vectorized(walk.sub):
                                grad_TK[token, col + j] = out[q * walk.sub + j]

    return norm_fn_backward_kernel


def supports(x_TND: torch.Tensor, fn_MK: torch.Tensor) -> bool:
    """Streams bfloat16/float16/float32 with a float32 ``fn`` (float64 stays with the reference)."""
    return x_TND.dtype in KERNEL_DTYPES and fn_MK.dtype == torch.float32


def norm_fn(x_TND: torch.Tensor, fn_MK: torch.Tensor, *, eps: float, tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mixes_TM, rstd_T)`` float32 as :func:`kernels.mhc.reference.norm_fn` (up to float32
    summation order); shapes, dtypes and devices checked, not values."""
    eps = check_norm_fn_args(x_TND, fn_MK, eps, values=False)
    check_tensor("x_TND", x_TND, dtype=KERNEL_DTYPES)
    check_tensor("fn_MK", fn_MK, dtype=torch.float32)
    check_cuda("x_TND", x_TND)
    (t, n, d), m = x_TND.shape, fn_MK.shape[0]
    mixes_TM = torch.empty((t, m), dtype=torch.float32, device=x_TND.device)
    rstd_T = torch.empty((t,), dtype=torch.float32, device=x_TND.device)
    if t == 0:
        return mixes_TM, rstd_T
    w_MK = round_to_tf32(fn_MK) if tf32 else fn_MK
    kernel = get_norm_fn_kernel(n * d, m, tl_dtype(x_TND.dtype), eps)
    kernel(aligned(x_TND).view(t, n * d), aligned(w_MK), mixes_TM, rstd_T)
    return mixes_TM, rstd_T


def norm_fn_backward(x_TND: torch.Tensor, fn_MK: torch.Tensor, mixes_TM: torch.Tensor, rstd_T: torch.Tensor,
                     g_TM: torch.Tensor, tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_fn)`` as :func:`kernels.mhc.reference.norm_fn_backward`: ``grad_x`` from the
    kernel in ``x``'s dtype (one pass over the streams, not the reference's five over float32
    copies), ``grad_fn = (g * rstd).T @ flat`` by torch."""
    t, n, d = x_TND.shape
    w_MK = round_to_tf32(fn_MK) if tf32 else fn_MK
    gproj_TM, coef_T = norm_fn_backward_terms(g_TM.float(), mixes_TM, rstd_T, n * d)
    grad_x = torch.empty_like(x_TND, memory_format=torch.contiguous_format)
    if t > 0:
        kernel = get_norm_fn_backward_kernel(n * d, fn_MK.shape[0], tl_dtype(x_TND.dtype))
        kernel(aligned(x_TND).view(t, n * d), aligned(w_MK), gproj_TM.contiguous(), coef_T.contiguous(),
               grad_x.view(t, n * d))
    grad_fn_MK = gproj_TM.T @ x_TND.reshape(t, n * d).float()
    return grad_x, grad_fn_MK
