"""The fused RMS norm + projection of mHC (:func:`kernels.mhc.reference.norm_fn`), forward:
``mixes = (flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` and ``rstd`` (the backward's input), and the
backward's ``grad_x = (g * rstd) @ fn - coef * flat``, with ``flat = x.view(T, N*D)`` read once, in
its own dtype (``fn`` as given, or TF32-rounded by the wrapper, as the reference does).

bfloat16 streams take the tensor cores (:func:`get_norm_fn_mma_kernel`): ``fn`` is split exactly
into three bfloat16 parts (8 significant bits each: ``hi + lo + lo2 == fn`` for every float32), so
each product of a bfloat16 element with a part is exact in float32 and the MMAs' float32 sums give
the float32 projection up to summation order, at the streams' read speed instead of the FMA pipe's.
A small kernel writes the parts once a call (every CTA splitting every chunk itself took 223
against 179 us at D = 7168); then a CTA of one warpgroup owns ``block_t`` tokens and
walks ``K`` in ``block_k`` chunks, pipelined: the chunks of ``x`` and of the parts arrive by
``cp.async``, one MMA of ``[block_t, block_k] x [block_k, 3M]`` sums each chunk, and the sum of
squares is taken from the same shared tile. Their backward takes the tensor cores too
(:func:`get_norm_fn_backward_mma_kernel`). The forward of float16 streams takes them as well, each
chunk split in shared memory into two exact bfloat16 parts, an MMA each (``MMA_STREAMS``).

float32 streams (training's), and float16 ones in the backward, use the CUDA cores: a CTA is
``WARPS`` warps of ``TOKENS_PER_WARP`` tokens each, walking ``K = N*D`` in chunks of 16 bytes per
lane (the next chunk's loads in flight while this one multiplies); the chunk's ``[M, chunk]`` slice
of ``fn`` is staged in shared memory once for the CTA's tokens, and each lane multiplies its
elements of each of its warp's tokens by the ``M`` rows (``TOKENS_PER_WARP`` FMAs per float read
from shared memory; ``docs/design/mhc.md`` has the measurements). The reference instead copies the streams to
float32, squares them, takes the mean and runs a float32 GEMM: five passes over ``[T, K]`` floats.

Shape suffixes: T tokens, K = N*D, M mixes.
"""

from typing import Callable, NamedTuple

import tilelang
import torch
from tilelang import language as T

from kernels.mhc.pre_apply_kernel import KERNEL_DTYPES
from kernels.mhc.functions import norm_fn_backward_terms, round_to_tf32
from kernels.mhc.reference import check_norm_fn_args
from kernels.tiles import PASS_CONFIGS, aligned, check_cuda, tl_dtype, vector_width
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


def split_parts(v, parts):
    """``parts`` bfloat16 values summing to float32 ``v`` (each the nearest to what is left): three
    hold all of it (24 significant bits), two all but ``2**-16`` of it."""
    out = [T.cast(v, T.bfloat16)]
    rest = v
    for _ in range(parts - 1):
        rest = rest - T.cast(out[-1], T.float32)
        out.append(T.cast(rest, T.bfloat16))
    return out


FN_PARTS = 3  # bfloat16 parts of a float32: 3 x 8 significant bits hold its 24
BACKWARD_BLOCK_T = 64  # tokens of one MMA of the tensor-core backward (a warpgroup's rows)


def fn_rows(m: int) -> int:
    """Rows of the tensor-core kernels' ``fn`` operand: its three parts, then zeros to a multiple
    of 16 (one wgmma that wide per 16 columns; 72 rows lower to nine 8-wide ones)."""
    return -(-FN_PARTS * m // 16) * 16


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_fn_parts_kernel(k: int, m: int, threads: int = 256):
    """``(fn_MK, w_RK)`` kernel: ``fn``'s three bfloat16 parts as rows ``[hi; lo; lo2]`` (``M``
    each), then zero rows up to :func:`fn_rows`; a thread a column."""
    rows = fn_rows(m)

    @T.prim_func
    def fn_parts_kernel(fn_MK: T.Tensor[(m, k), T.float32], w_RK: T.Tensor[(rows, k), T.bfloat16]):
        with T.Kernel(T.ceildiv(k, threads), threads=threads) as b:
            col = b * threads + T.get_thread_binding()
            if col < k:
                for r in T.unroll(m):
                    for q, part in enumerate(split_parts(fn_MK[r, col], FN_PARTS)):
                        w_RK[q * m + r, col] = part
                for r in T.unroll(rows - FN_PARTS * m):
                    w_RK[FN_PARTS * m + r, col] = T.bfloat16(0)

    return fn_parts_kernel


X_PARTS = {"bfloat16": 1, "float16": 2, "float32": 3}  # bfloat16 parts that hold a stream element exactly
# Streams whose forward takes the tensor cores. float32 in three parts took 416 / 727 us at D = 4096 /
# 7168 against the CUDA cores' 358 / 638 (float16 in two: 257 / 453 against 299 / 516; H100): the
# split in shared memory and three MMAs a chunk, one
# warpgroup an SM doing each in turn, cost more than the FMAs they replace.
MMA_STREAMS = (torch.bfloat16, torch.float16)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_norm_fn_mma_kernel(k: int, m: int, eps: float, block_t: int = 64, block_k: int | None = None,
                           stages: int = 4, threads: int = 128, dtype: str = "bfloat16"):
    """``(x_TK, w_RK, mixes_TM, rstd_T)`` kernel for ``x`` of ``K = k`` columns of ``dtype`` and the
    parts ``w_RK`` of ``M = m`` rows of ``fn`` (:func:`get_fn_parts_kernel`), on the tensor cores
    (see the module docstring). ``block_t`` tokens a CTA of ``threads`` (128 per 64 tokens: one
    warpgroup's MMA rows), ``block_k`` columns a chunk (128 for bfloat16, 64 otherwise: shared
    memory), ``stages`` chunks in flight. float16 / float32 streams are split in shared memory
    into their exact bfloat16 parts (``X_PARTS``: 2 / 3), one MMA each, so every product of a part
    with a part of ``fn`` is still exact. Each chunk's MMAs sum into a fresh accumulator that the
    CUDA cores add to the running one (the tensor cores' float32 adds truncate: over 3K terms they
    drifted 1.6e-5 of the largest mix)."""
    num_tokens = T.dynamic("num_tokens")
    rows = fn_rows(m)
    parts = X_PARTS[dtype]
    block_k = block_k or (128 if parts == 1 else 64)
    elems = 16 // T.dtype(dtype).bytes  # a 16-byte vector of x
    lanes = threads // block_t  # threads summing a token's squares, block_k / lanes columns each
    vectors = block_k // lanes // elems  # vectors of x a thread reads a chunk

    @T.prim_func
    def norm_fn_mma_kernel(
        x_TK: T.Tensor[(num_tokens, k), dtype],
        w_RK: T.Tensor[(rows, k), T.bfloat16],
        mixes_TM: T.Tensor[(num_tokens, m), T.float32],
        rstd_T: T.Tensor[(num_tokens,), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_t), threads=threads) as b:
            tid = T.get_thread_binding()
            x_S = T.alloc_shared((block_t, block_k), dtype)
            w_S = T.alloc_shared((rows, block_k), T.bfloat16)
            x_parts_S = [T.alloc_shared((block_t, block_k), T.bfloat16) for _ in range(parts if parts > 1 else 0)]
            chunk = T.alloc_fragment((block_t, rows), T.float32)
            acc = T.alloc_fragment((block_t, rows), T.float32)
            x_local = T.alloc_local((elems,), dtype)
            sq = T.alloc_local((elems,), T.float32)  # several chains, not one
            sq_S = T.alloc_shared((threads,), T.float32)
            acc_S = T.alloc_shared((block_t, rows), T.float32)
            T.clear(acc)
            for e in T.unroll(elems):
                sq[e] = T.float32(0)
            for c in T.Pipelined(T.ceildiv(k, block_k), num_stages=stages):
                T.copy(x_TK[b * block_t, c * block_k], x_S)
                T.copy(w_RK[0, c * block_k], w_S)
                if parts == 1:
                    T.gemm(x_S, w_S, chunk, transpose_B=True, clear_accum=True)
                else:
                    for i, j in T.Parallel(block_t, block_k):
                        for q, part in enumerate(split_parts(T.cast(x_S[i, j], T.float32), parts)):
                            x_parts_S[q][i, j] = part
                    for q, x_part_S in enumerate(x_parts_S):
                        T.gemm(x_part_S, w_S, chunk, transpose_B=True, clear_accum=q == 0)
                for i, r in T.Parallel(block_t, rows):
                    acc[i, r] += chunk[i, r]
                for v in T.unroll(vectors):
                    for e in T.vectorized(elems):
                        x_local[e] = x_S[tid // lanes, (tid % lanes * vectors + v) * elems + e]
                    for e in T.unroll(elems):
                        sq[e] += T.cast(x_local[e], T.float32) * T.cast(x_local[e], T.float32)
            sq_S[tid] = sum(sq[e] for e in range(elems))
            T.copy(acc, acc_S)
            for i, r in T.Parallel(block_t, m):
                token = b * block_t + i
                rstd = rstd_of(sum(sq_S[i * lanes + q] for q in range(1, lanes)) + sq_S[i * lanes], k, eps)
                if token < num_tokens:
                    mixes_TM[token, r] = sum((acc_S[i, q * m + r] for q in range(1, FN_PARTS)), acc_S[i, r]) * rstd
                    if r == 0:
                        rstd_T[token] = rstd

    return norm_fn_mma_kernel


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


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_norm_fn_backward_mma_kernel(k: int, m: int, chunks: int, block_t: int = BACKWARD_BLOCK_T, block_k: int = 64,
                                    stages: int = 2):
    """``(x_TK, fn_MK, gproj_TM, coef_T, grad_TK, grad_fn_SMK)`` kernel for bfloat16 ``x``, on the
    tensor cores: ``grad = gproj @ fn - coef * x`` and the partial ``grad_fn = gproj.T @ x`` of each
    split of ``block_t * chunks`` tokens (the caller sums the splits), ``x`` read once for both.

    A CTA (one warpgroup) owns ``block_k`` columns of one split and walks its tokens ``block_t`` at
    a time, pipelined. Both operands of ``gproj @ fn`` are split into two bfloat16 parts and the
    three products ``hH + hL + lH`` summed (within ``3 * 2**-16`` of each term, ample for a
    bfloat16 ``grad``; six products of three parts would double the operands); ``gproj.T @ x``
    takes the same two parts of ``gproj`` (``x`` is exact): within ``2**-16`` of each term, where
    TF32 would be ``2**-11``."""
    num_tokens = T.dynamic("num_tokens")
    inner = -(-3 * m // 16) * 16  # grad's MMA depth: [h h l] . [H L H]
    rows = -(-2 * m // 64) * 64  # grad_fn's MMA rows: [h l] of gproj, zeros to a warpgroup's 64

    @T.prim_func
    def norm_fn_backward_mma_kernel(
        x_TK: T.Tensor[(num_tokens, k), T.bfloat16],
        fn_MK: T.Tensor[(m, k), T.float32],
        gproj_TM: T.Tensor[(num_tokens, m), T.float32],
        coef_T: T.Tensor[(num_tokens,), T.float32],
        grad_TK: T.Tensor[(num_tokens, k), T.bfloat16],
        grad_fn_SMK: T.Tensor[(T.ceildiv(num_tokens, block_t * chunks), m, k), T.float32],
    ):
        with T.Kernel(T.ceildiv(k, block_k), T.ceildiv(num_tokens, block_t * chunks), threads=128) as (kb, split):
            fn_S = T.alloc_shared((m, block_k), T.float32)
            b_S = T.alloc_shared((inner, block_k), T.bfloat16)
            x_S = T.alloc_shared((block_t, block_k), T.bfloat16)
            gp_S = T.alloc_shared((block_t, m), T.float32)
            coef_S = T.alloc_shared((block_t,), T.float32)
            a_S = T.alloc_shared((block_t, inner), T.bfloat16)
            at_S = T.alloc_shared((block_t, rows), T.bfloat16)
            out_S = T.alloc_shared((block_t, block_k), T.bfloat16)
            grad = T.alloc_fragment((block_t, block_k), T.float32)
            grad_fn = T.alloc_fragment((rows, block_k), T.float32)
            grad_fn_S = T.alloc_shared((rows, block_k), T.float32)
            T.copy(fn_MK[0, kb * block_k], fn_S)
            T.clear(b_S)
            T.clear(a_S)
            T.clear(at_S)
            for r, j in T.Parallel(m, block_k):
                hi, lo = split_parts(fn_S[r, j], 2)
                for q, part in enumerate((hi, lo, hi)):
                    b_S[q * m + r, j] = part
            T.clear(grad_fn)
            for cc in T.Pipelined(chunks, num_stages=stages):
                c = split * chunks + cc
                T.copy(x_TK[c * block_t, kb * block_k], x_S)
                T.copy(gproj_TM[c * block_t, 0], gp_S)
                for i in T.Parallel(block_t):
                    coef_S[i] = T.if_then_else(c * block_t + i < num_tokens, coef_T[c * block_t + i], T.float32(0))
                for i, r in T.Parallel(block_t, m):
                    hi, lo = split_parts(gp_S[i, r], 2)
                    for q, part in enumerate((hi, hi, lo)):
                        a_S[i, q * m + r] = part
                    at_S[i, r] = hi
                    at_S[i, m + r] = lo
                T.gemm(a_S, b_S, grad, clear_accum=True)
                T.gemm(at_S, x_S, grad_fn, transpose_A=True)
                for i, j in T.Parallel(block_t, block_k):
                    out_S[i, j] = T.cast(grad[i, j] - coef_S[i] * T.cast(x_S[i, j], T.float32), T.bfloat16)
                T.copy(out_S, grad_TK[c * block_t, kb * block_k])
            T.copy(grad_fn, grad_fn_S)
            for r, j in T.Parallel(m, block_k):
                if kb * block_k + j < k:
                    grad_fn_SMK[split, r, kb * block_k + j] = grad_fn_S[r, j] + grad_fn_S[m + r, j]

    return norm_fn_backward_mma_kernel


def backward_chunks(num_tokens: int, block_t: int = BACKWARD_BLOCK_T, most: int = 32) -> int:
    """Token blocks a CTA of the tensor-core backward walks: all of them up to ``most`` (a power of
    two, so few token counts compile apart), then splits of ``most`` whose ``grad_fn`` partials the
    caller sums (TileLang pipelines only loops of a static length)."""
    return min(most, 1 << max(0, (-(-num_tokens // block_t) - 1).bit_length()))


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
    if x_TND.dtype in MMA_STREAMS:
        parts_RK = torch.empty((fn_rows(m), n * d), dtype=torch.bfloat16, device=x_TND.device)
        get_fn_parts_kernel(n * d, m)(aligned(w_MK), parts_RK)
        kernel = get_norm_fn_mma_kernel(n * d, m, eps, dtype=tl_dtype(x_TND.dtype))
        kernel(aligned(x_TND).view(t, n * d), parts_RK, mixes_TM, rstd_T)
    else:
        kernel = get_norm_fn_kernel(n * d, m, tl_dtype(x_TND.dtype), eps)
        kernel(aligned(x_TND).view(t, n * d), aligned(w_MK), mixes_TM, rstd_T)
    return mixes_TM, rstd_T


def norm_fn_backward(x_TND: torch.Tensor, fn_MK: torch.Tensor, mixes_TM: torch.Tensor, rstd_T: torch.Tensor,
                     g_TM: torch.Tensor, tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_fn)`` as :func:`kernels.mhc.functions.norm_fn_backward`: ``grad_x`` from a
    kernel in ``x``'s dtype (one pass over the streams, not the reference's five over float32
    copies); ``grad_fn = (g * rstd).T @ flat`` from the same pass for bfloat16 streams (the
    tensor-core kernel's splits summed by torch), else by torch over a float32 copy."""
    t, n, d = x_TND.shape
    w_MK = round_to_tf32(fn_MK) if tf32 else fn_MK
    gproj_TM, coef_T = norm_fn_backward_terms(g_TM.float(), mixes_TM, rstd_T, n * d)
    grad_x = torch.empty_like(x_TND, memory_format=torch.contiguous_format)
    if t > 0 and x_TND.dtype == torch.bfloat16:
        chunks = backward_chunks(t)
        splits = -(-t // (BACKWARD_BLOCK_T * chunks))
        grad_fn_SMK = torch.empty((splits, *fn_MK.shape), dtype=torch.float32, device=x_TND.device)
        kernel = get_norm_fn_backward_mma_kernel(n * d, fn_MK.shape[0], chunks)
        kernel(aligned(x_TND).view(t, n * d), aligned(w_MK), gproj_TM.contiguous(), coef_T.contiguous(),
               grad_x.view(t, n * d), grad_fn_SMK)
        return grad_x, grad_fn_SMK.sum(0)
    if t > 0:
        kernel = get_norm_fn_backward_kernel(n * d, fn_MK.shape[0], tl_dtype(x_TND.dtype))
        kernel(aligned(x_TND).view(t, n * d), aligned(w_MK), gproj_TM.contiguous(), coef_T.contiguous(),
               grad_x.view(t, n * d))
    grad_fn_MK = gproj_TM.T @ x_TND.reshape(t, n * d).float()
    return grad_x, grad_fn_MK
