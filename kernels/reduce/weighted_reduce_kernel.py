"""Weighted reduce kernel, optionally fused with FP8 dequantization of the expert outputs (see
:mod:`kernels.reduce.reference` for the function).

A CTA covers one token's columns ``[pn * threads * vec, (pn + 1) * threads * vec)``; each thread
owns one 16-byte vector of ``y`` (``vec`` elements: 8 bf16, 16 e4m3, 4 float32; 8 bytes of e4m3 rows
for a small batch, :func:`reduce_vector_bytes`). A thread first
reads the token's K routes (rows and weights), then issues all K row loads (each predicated on its
row being >= 0; with e4m3 rows, the row's scale too) before the first add, so K x 16 bytes per
thread are in flight instead of one vector at a time. 16-byte vectors land in shared memory by
``cp.async`` (each thread's own slots, so no barrier), not in registers: bf16 rows take 48
registers instead of 88 and an SM holds 6 CTAs of 224 threads instead of 3 (by registers), and the
kernel, bound by the bytes in flight behind each CTA's two dependent round trips (the routes, then
the rows), went from 54% to 100.6% of copy at 16384 tokens (``docs/design/reduce.md``). Then it adds ``w[t, k] * y[pos[t, k]]`` (dequantized with its per-token scale for e4m3 ``y``)
into float32 registers for k = 0 .. K-1.
Every product and sum is an IEEE round-to-nearest operation in the reference's order (no FMA), and
a masked route (-1) adds nothing (not ``+0``, which would turn a ``-0`` sum into ``+0``), so the
result is bit-exact. Rows are not checked on the host (no host sync): one outside ``[0, P)`` is
treated as -1. The peer variant (``reduce_put``) can cast its rows to e4m3 on the way (the threads
of a scale group meet their amax by warp shuffles), and ``reduce_sum_home`` dequantizes such
returned rows in its sum. ``reduce_sum_home`` stages its own rows too, and so does ``reduce_put``
of e4m3 rows home, whose pace the expert rows' reads set; ``reduce_put`` of rows in
y's dtype keeps them in registers, bound by the link either way. The columns are split into the
fewest tiles of at most ``MAX_THREADS`` vectors (for the peer variant ``PUT_THREADS``, or
``FP8_PUT_THREADS`` where its rows are cast to e4m3), evenly (hidden 7168: 4 CTAs of 224 threads
per token for bf16 ``y``, 2 for e4m3 ``y``; one of 896 for the peer variant, 4 of 224 where it
casts), so no CTA runs half empty.

Shape suffixes: T tokens, K routes per token, P layout rows, D hidden, G scale groups, S rows
returned home, W ranks, C and V vectors of a peer region.
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.comm.signal import Signal
from kernels.comm.signal_kernel import barrier_alone, check_signal, in_kernel_barrier, signal_args
from kernels.pdl import chained
from kernels.reduce.reference import check_reduce_sum_home_args, check_weighted_reduce_args
from kernels.reduce.reference import reduce_sum_home as reference_reduce_sum_home
from kernels.validate import check_tensor
from kernels.rows import vector_cp_async
from kernels.tiles import (
    HAND_SYNC_PASS_CONFIGS,
    PEER_PASS_CONFIGS,
    VECTOR_BYTES,
    aligned,
    check_cuda,
    row_major,
    scale_and_inverse,
    sm_count,
    tl_dtype,
    to_e4m3,
    unpack_scale,
)

MAX_THREADS = 256
# reduce_put and reduce_sum_home (peers' memory; their loads guarded by hand) also place their own CTA
# barriers: staged rows are thread-private
PEER_SYNC_PASS_CONFIGS = {**PEER_PASS_CONFIGS, **HAND_SYNC_PASS_CONFIGS}
MAX_THREADS_PER_SM = 2048  # Hopper's
# e4m3 rows take 8 bytes a thread while the 16-byte grid holds under this share of the GPU's thread
# slots: at hidden 7168 on an H100 8 bytes won at 128 and 160 tokens (5.15 / 6.02 us against 5.71 /
# 6.75), staged 16 bytes from 192 (7.17 / 8.13 / 13.76 us at 192 / 256 / 512 against 7.44 / 8.83 /
# 15.59); the 16-byte grid fills 26.5% / 31.8% of the slots at 160 / 192 (GPU time)
SMALL_GRID_SHARE = 0.3
# reduce_put's CTAs: storing the rows bound for the peers only (the home rank reduces its own in
# reduce_sum_home), 1024 threads (one CTA of 896 per row of 7168 bf16) took 188.2 us against 128's
# 214.1 and 256's 203.0 with the barrier, at 4096 tokens per rank on two H100s; 16.3 against 16.2 us at
# 128. Staged: 189.3 against 189.0, bound by the link either way.
PUT_THREADS = 1024
# FP8 rows home halve the link's bytes, so the expert rows' reads set the pace: CTAs of at most 256
# threads (224 at hidden 7168) staging them (6 CTAs an SM by registers, 48 each) took 129.7 us with
# the barrier against 1024 threads' 148.4 in registers (152.5 staged), two H100s, 4096 tokens per
# rank
FP8_PUT_THREADS = 256


def reduce_tile(num_cols: int, y_bytes: int, max_threads: int = MAX_THREADS,
                vector_bytes: int = VECTOR_BYTES) -> tuple[int, int, int]:
    """``(vec, threads, tiles)``: elements per thread (one ``vector_bytes`` vector of ``y``, narrower
    where ``num_cols`` needs it), threads per CTA (a multiple of 32, at most ``max_threads``) and
    CTAs per token row."""
    vec = math.gcd(max(vector_bytes // y_bytes, 1), num_cols)
    num_vectors = num_cols // vec
    tiles = -(-num_vectors // max_threads)
    threads = -(-(-(-num_vectors // tiles)) // 32) * 32
    return vec, threads, tiles


def _row_reducer(num_cols: int, topk: int, y_dtype: str, out_dtype: str, group: int, packed: bool,
                 unit: bool = False, max_threads: int = MAX_THREADS, vector_bytes: int = VECTOR_BYTES,
                 staged: bool | None = False):
    """``(vec, threads, tiles, reduce_row)``: the tile and the macro that reduces vector ``c`` of
    row ``t`` into ``out_buf`` (``vec`` values of ``out_dtype``), for both kernels below; ``unit``:
    every weight is 1 and ``weights_TK`` is never read (``1 * y`` is ``y``: the same bits);
    ``staged``: the K row vectors land in shared memory by ``cp.async`` (each thread's own slots, read
    back by it alone: the kernel needs TileLang's automatic barriers off) instead of registers; None:
    staged where a thread's vector is 16 bytes (measured: ``docs/design/reduce.md``)."""
    y_bytes = T.dtype(y_dtype).bytes
    vec, threads, tiles = reduce_tile(num_cols, y_bytes, max_threads, vector_bytes)
    if staged is None:
        staged = vec * y_bytes == VECTOR_BYTES
    if staged and vec * y_bytes < 4:
        raise ValueError(f"staged: cp.async moves 4, 8 or 16 bytes; a thread's vector of {num_cols} columns "
                         f"here is {vec * y_bytes} bytes")
    fetch_y = vector_cp_async(vec, y_bytes)
    dequantize = y_dtype == "float8_e4m3fn"
    one_scale = group % vec == 0  # a thread's vector lies in one scale group

    @T.macro
    def reduce_row(y_PD, sf_PG, pos_TK, weights_TK, num_rows, t, c, out_buf):
        rows = T.alloc_local((topk,), "int64")
        weights = T.alloc_local((topk,), "float32")
        scales = T.alloc_local((topk,), "float32")
        y_buf = T.alloc_local((1,) if staged else (topk * vec,), y_dtype)
        stage = T.alloc_shared((topk, threads * vec) if staged else (1, 1), y_dtype)
        slot = c % threads * vec  # the thread's columns of the stage
        y_f32 = T.alloc_local((vec,), "float32")
        acc = T.alloc_local((vec,), "float32")
        for k in T.unroll(topk):
            rows[k] = T.Cast("int64", pos_TK[t, k])
            if rows[k] >= num_rows:  # values are not checked on the host: out of range reads as -1
                rows[k] = -1
            if not unit:
                weights[k] = weights_TK[t, k]
        for k in T.unroll(topk):  # every load in flight before the first add
            if rows[k] >= 0:
                if staged:
                    fetch_y(stage[k, slot], y_PD[rows[k], c * vec])
                else:
                    for j in T.vectorized(vec):
                        y_buf[k * vec + j] = y_PD[rows[k], c * vec + j]
                if dequantize and one_scale:
                    scales[k] = unpack_scale(sf_PG[rows[k], c * vec // group], packed)
        if staged:
            T.ptx_commit_group()
            T.ptx_wait_group(0)
        for j in T.unroll(vec):
            acc[j] = T.float32(0)
        for k in T.unroll(topk):
            if rows[k] >= 0:
                for j in T.vectorized(vec):  # converted as vectors (e4m3 in pairs), not value by value
                    y_f32[j] = T.cast(stage[k, slot + j] if staged else y_buf[k * vec + j], "float32")
                for j in T.unroll(vec):
                    y = y_f32[j]
                    if dequantize:
                        if one_scale:
                            y = T.ieee_mul(y, scales[k])
                        else:
                            y = T.ieee_mul(y, unpack_scale(sf_PG[rows[k], (c * vec + j) // group], packed))
                    acc[j] = T.ieee_add(acc[j], y if unit else T.ieee_mul(weights[k], y))
        for j in T.unroll(vec):
            out_buf[j] = T.cast(acc[j], out_dtype)

    return vec, threads, tiles, reduce_row


@tilelang.jit(pass_configs=HAND_SYNC_PASS_CONFIGS)  # staged rows are thread-private
def get_weighted_reduce_kernel(
    num_cols: int, topk: int, y_dtype: str, index_dtype: str, out_dtype: str, group: int, packed: bool,
    unit: bool = False, vector_bytes: int = VECTOR_BYTES, min_ctas: int | None = None, staged: bool | None = None,
):
    """``(y_PD, sf_PG, pos_TK, weights_TK, out_TD)`` kernel; ``sf_PG`` is read only for e4m3 ``y``
    (pass any ``[P, G]`` tensor of the scale dtype otherwise), ``weights_TK`` only without ``unit``
    (weights of 1); ``vector_bytes`` of ``y`` a thread, ``min_ctas`` an SM (registers bounded to
    fit them), for tuning sweeps, and ``staged`` rows (:func:`_row_reducer`; by default where a
    thread's vector is 16 bytes)."""
    num_tokens, num_rows = T.dynamic("num_tokens"), T.dynamic("num_rows")
    vec, threads, tiles, reduce_row = _row_reducer(num_cols, topk, y_dtype, out_dtype, group, packed, unit,
                                                   vector_bytes=vector_bytes, staged=staged)
    sf_dtype = "uint8" if packed else "float32"

    @T.prim_func
    def weighted_reduce(
        y_PD: T.Tensor[(num_rows, num_cols), y_dtype],
        sf_PG: T.Tensor[(num_rows, T.ceildiv(num_cols, group)), sf_dtype],
        pos_TK: T.Tensor[(num_tokens, topk), index_dtype],
        weights_TK: T.Tensor[(num_tokens, topk), "float32"],
        out_TD: T.Tensor[(num_tokens, num_cols), out_dtype],
    ):
        with T.Kernel(num_tokens * tiles, threads=threads) as pid:
            if min_ctas:
                T.annotate_min_blocks_per_sm(min_ctas)
            chained()
            t, pn = row_major(pid, tiles)
            c = pn * threads + T.get_thread_binding()  # this thread's vector of the row
            out_buf = T.alloc_local((vec,), out_dtype)
            if c < num_cols // vec:
                reduce_row(y_PD, sf_PG, pos_TK, weights_TK, num_rows, t, c, out_buf)
                for j in T.vectorized(vec):
                    out_TD[t, c * vec + j] = out_buf[j]

    return weighted_reduce


def fp8_lanes(num_cols: int, y_bytes: int, group: int) -> int:
    """Threads that share one scale group in ``reduce_put``'s FP8 variant (their amax meets by warp
    shuffles), 0 where the kernel cannot cast (a group not a whole number of vectors, or wider than a
    warp's): the reference takes those. A thread's vector does not depend on the CTA's size."""
    vec = reduce_tile(num_cols, y_bytes)[0]
    lanes = group // vec
    return lanes if group % vec == 0 and lanes <= 32 and lanes & (lanes - 1) == 0 else 0


@T.macro
def cast_vector(out_buf, q_buf, lanes: int):
    """A thread's ``vec`` values to e4m3 with its scale group's float32 scale (returned), the group
    being ``lanes`` adjacent threads of a warp (every one of them must call this): the amax meets by
    shuffles, then each value is multiplied by the quantizing inverse, as ``cast_per_token`` does."""
    vec = out_buf.shape[0]
    amax = T.alloc_local((1,), "float32")  # local, not a var: its initializer would precede PDL's wait
    amax[0] = T.float32(0)
    for j in T.unroll(vec):
        amax[0] = T.max(amax[0], T.abs(T.cast(out_buf[j], "float32")))
    for o in T.unroll(lanes.bit_length() - 1):
        amax[0] = T.max(amax[0], T.shfl_xor(amax[0], lanes >> (o + 1)))
    sf, inv = scale_and_inverse(amax[0], False, False)
    for j in T.unroll(vec):
        q_buf[j] = to_e4m3(T.cast(out_buf[j], "float32") * inv)
    return sf


@tilelang.jit(pass_configs=PEER_SYNC_PASS_CONFIGS)
def get_weighted_reduce_put_kernel(
    num_cols: int, topk: int, y_dtype: str, out_dtype: str, group: int, packed: bool, world: int,
    max_threads: int = PUT_THREADS, fp8_group: int = 0, staged: bool | None = False,
):
    """``(y_PD, sf_PG, pos_TK, weights_TK, dest_TW, delta_W, dst_CV, sf_F, skip_rank)`` kernel: row
    t's reduction stored to row ``dest_TW[t, w]`` of rank w's copy of a peer region (``dst_CV``: rank
    0's copy as vectors of the reduction's ``vec`` elements; rank w's lies ``delta_W[w]`` bytes from
    it, as in ``kernels.comm.put_rows``) instead of to an output of its own; -1, rows outside the
    region and rank ``skip_rank`` get nothing, and a row that goes nowhere is not reduced. With
    ``fp8_group``, the row (reduced in ``out_dtype``) is cast to e4m3, one float32 scale per
    ``fp8_group`` columns: ``dst_CV`` holds the e4m3 vectors and ``sf_F`` rank 0's copy of the
    scales region, flat (unread otherwise). ``staged``: the rows' vectors staged in shared memory
    (:func:`_row_reducer`). The defaults are the build for rows in y's dtype; :func:`reduce_put`
    picks the FP8 one (``FP8_PUT_THREADS``, staged)."""
    num_tokens, num_rows, num_dst = T.dynamic("num_tokens"), T.dynamic("num_rows"), T.dynamic("num_dst")
    num_sf = T.dynamic("num_sf")
    vec, threads, tiles, reduce_row = _row_reducer(num_cols, topk, y_dtype, out_dtype, group, packed,
                                                   max_threads=max_threads, staged=staged)
    sf_dtype = "uint8" if packed else "float32"
    dst_dtype = "float8_e4m3fn" if fp8_group else out_dtype
    vector_bytes = vec * T.dtype(dst_dtype).bytes
    nv = num_cols // vec
    lanes = fp8_group // vec
    groups = -(-num_cols // fp8_group) if fp8_group else 0

    @T.prim_func
    def weighted_reduce_put(
        y_PD: T.Tensor[(num_rows, num_cols), y_dtype],
        sf_PG: T.Tensor[(num_rows, T.ceildiv(num_cols, group)), sf_dtype],
        pos_TK: T.Tensor[(num_tokens, topk), "int32"],
        weights_TK: T.Tensor[(num_tokens, topk), "float32"],
        dest_TW: T.Tensor[(num_tokens, world), "int32"],
        delta_W: T.Tensor[(world,), "int64"],
        dst_CV: T.Tensor[(num_dst * nv, vec), dst_dtype],
        sf_F: T.Tensor[(num_sf,), "float32"],
        skip_rank: T.int32,
    ):
        with T.Kernel(num_tokens * tiles, threads=threads) as pid:
            chained()
            t, pn = row_major(pid, tiles)
            c = pn * threads + T.get_thread_binding()  # this thread's vector of the row
            out_buf = T.alloc_local((vec,), out_dtype)
            q_buf = T.alloc_local((vec,), dst_dtype)
            stored = q_buf if fp8_group else out_buf  # what goes to the peers
            rows_W = T.alloc_local((world,), "int64")
            deltas_W = T.alloc_local((world,), "int64")
            live = T.alloc_var(T.int32)
            live = 0
            # loaded before any store: the kernel is chained (kernels.pdl), so its pointers are not
            # __restrict__ and a load after a store would wait for its own round trip
            for w in T.unroll(world):
                rows_W[w] = T.Cast("int64", dest_TW[t, w])
                if T.Or(T.Or(rows_W[w] >= num_dst, w == skip_rank), rows_W[w] < 0):
                    rows_W[w] = -1
                else:
                    live = 1
                deltas_W[w] = delta_W[w]
            if live == 1:  # the same for every thread of the CTA (one token's row): shuffles are safe
                for j in T.unroll(vec):
                    out_buf[j] = T.cast(0, out_dtype)
                if c < nv:
                    reduce_row(y_PD, sf_PG, pos_TK, weights_TK, num_rows, t, c, out_buf)
                if fp8_group:
                    sf = cast_vector(out_buf, q_buf, lanes)
                for w in T.unroll(world):
                    if T.And(rows_W[w] >= 0, c < nv):
                        for j in T.vectorized(vec):
                            dst_CV[deltas_W[w] // vector_bytes + rows_W[w] * nv + c, j] = stored[j]
                        if fp8_group and c % lanes == 0:
                            sf_F[deltas_W[w] // 4 + rows_W[w] * groups + c // lanes] = sf

    return weighted_reduce_put


@tilelang.jit(pass_configs=PEER_SYNC_PASS_CONFIGS)  # its loads are guarded in the code: TileLang's checks are redundant
def get_reduce_sum_home_kernel(num_cols: int, topk: int, y_dtype: str, out_dtype: str, world: int,
                               rows_dtype: str | None = None, group: int = 128, signalled: bool = False,
                               staged: bool | None = None):
    """``(y_PD, sf_PG, pos_TK, weights_TK, rows_SD, sf_SG, home_TW, out_TD, rank, flags_W, own_W, delta_W,
    epoch_1, tickets_1)`` kernel of
    :func:`kernels.reduce.reference.reduce_sum_home` (``sf_PG`` is never read): a thread reduces its
    vector of token t's own row (the weighted reduce's macro, rounded to the output dtype as
    ``reduce_put`` stores it), then adds it and the returned rows' vectors in rank order, every load
    issued before the one store. Returned rows of ``rows_dtype`` e4m3 are dequantized with their
    ``sf_SG`` scale (one per ``group`` columns; ``sf_SG`` unread for rows in ``out_dtype``). When
    ``signalled``, the kernel is the barrier before the returned rows (a
    :class:`kernels.comm.Signal`'s, :func:`kernels.comm.signal_kernel.in_kernel_barrier`): its
    first CTA signals the peers as it starts, and every CTA waits for their signals after its own
    row's reduce, before it loads a returned row (the flags and counters unread otherwise).
    ``staged``: the own rows' vectors staged in shared memory (:func:`_row_reducer`; by default where
    a thread's vector is 16 bytes: 56 registers instead of 82, so an SM holds 5 CTAs of 224 threads
    instead of 3; 126.8 against 168.6 us at 4096 tokens per rank on two H100s, FP8 rows home 122.4
    against 142.4)."""
    num_tokens, num_rows, num_src = T.dynamic("num_tokens"), T.dynamic("num_rows"), T.dynamic("num_src")
    num_sf = T.dynamic("num_sf")
    rows_dtype = rows_dtype or out_dtype
    dequantize = rows_dtype == "float8_e4m3fn"
    vec, threads, tiles, reduce_row = _row_reducer(num_cols, topk, y_dtype, out_dtype, 128, False, staged=staged)
    signal_peers, wait_peers, count_epoch = in_kernel_barrier(world)

    @T.macro
    def load_returned(rows_SD, sf_SG, rows_W, home_buf, scales_W, rank, c):
        for w in T.unroll(world):
            if T.And(w != rank, rows_W[w] >= 0):
                for j in T.vectorized(vec):
                    home_buf[w * vec + j] = rows_SD[rows_W[w], c * vec + j]
                if dequantize:  # a vector lies in one scale group (the wrapper checks)
                    scales_W[w] = sf_SG[rows_W[w], c * vec // group]

    @T.prim_func
    def reduce_sum_home(
        y_PD: T.Tensor[(num_rows, num_cols), y_dtype],
        sf_PG: T.Tensor[(num_rows, T.ceildiv(num_cols, 128)), "float32"],
        pos_TK: T.Tensor[(num_tokens, topk), "int32"],
        weights_TK: T.Tensor[(num_tokens, topk), "float32"],
        rows_SD: T.Tensor[(num_src, num_cols), rows_dtype],
        sf_SG: T.Tensor[(num_sf, T.ceildiv(num_cols, group)), "float32"],
        home_TW: T.Tensor[(num_tokens, world), "int32"],
        out_TD: T.Tensor[(num_tokens, num_cols), out_dtype],
        rank: T.int32,
        flags_W: T.Tensor[(world,), "int32"],
        own_W: T.Tensor[(world,), "int32"],
        delta_W: T.Tensor[(world,), "int64"],
        epoch_1: T.Tensor[(1,), "int32"],
        tickets_1: T.Tensor[(1,), "int32"],
    ):
        with T.Kernel(num_tokens * tiles, threads=threads) as pid:
            chained()
            t, pn = row_major(pid, tiles)
            c = pn * threads + T.get_thread_binding()  # this thread's vector of the row
            epoch = T.alloc_local((1,), "int32")  # this call's (a barrier of a signalled kernel)
            if signalled:
                epoch[0] = epoch_1[0] + 1
                signal_peers(flags_W, delta_W, epoch[0], rank, pid == 0)
            rows_W = T.alloc_local((world,), "int64")
            home_buf = T.alloc_local((world * vec,), rows_dtype)
            scales_W = T.alloc_local((world,), "float32")
            own_buf = T.alloc_local((vec,), out_dtype)
            acc = T.alloc_local((vec,), "float32")
            if c < num_cols // vec:
                for w in T.unroll(world):
                    rows_W[w] = T.Cast("int64", home_TW[t, w])
                    if T.And(w != rank, rows_W[w] >= num_src):  # not checked on the host: out of range is -1
                        rows_W[w] = -1
                if not signalled:
                    load_returned(rows_SD, sf_SG, rows_W, home_buf, scales_W, rank, c)
                # not gated on home_TW[t, rank] (the sum is): the routes' loads go out beside
                # home_TW's, not after them, and in a combine a token not sent here has none
                reduce_row(y_PD, sf_PG, pos_TK, weights_TK, num_rows, t, c, own_buf)
            if signalled:  # the own row's reduce hid the peers' signals in flight
                wait_peers(own_W, epoch[0], rank)
                if c < num_cols // vec:
                    load_returned(rows_SD, sf_SG, rows_W, home_buf, scales_W, rank, c)
            if c < num_cols // vec:
                for j in T.unroll(vec):
                    acc[j] = T.float32(0)
                for w in T.unroll(world):  # rank order, a missing row adding nothing (as sum_home)
                    if rows_W[w] >= 0:
                        if w == rank:
                            for j in T.unroll(vec):
                                acc[j] = T.ieee_add(acc[j], T.cast(own_buf[j], "float32"))
                        else:
                            for j in T.unroll(vec):
                                if dequantize:
                                    acc[j] = T.ieee_add(acc[j], T.ieee_mul(T.cast(home_buf[w * vec + j], "float32"),
                                                                           scales_W[w]))
                                else:
                                    acc[j] = T.ieee_add(acc[j], T.cast(home_buf[w * vec + j], "float32"))
                for j in T.vectorized(vec):
                    out_TD[t, c * vec + j] = T.cast(acc[j], out_dtype)
            if signalled:
                count_epoch(epoch_1, tickets_1, epoch[0], num_tokens * tiles)

    return reduce_sum_home


def reduce_vector_bytes(num_tokens: int, num_cols: int, y_bytes: int, device: torch.device) -> int:
    """Bytes of ``y`` a thread: 16, or 8 for e4m3 rows whose 16-byte grid would hold under
    ``SMALL_GRID_SHARE`` of the GPU's thread slots. There twice the threads, each with half the
    bytes, are faster (measured; a thread's instruction count is not why: ``docs/design/reduce.md``).
    bf16 rows keep 16 bytes (8: 7.15 against 7.01 us at 128 tokens). With the 16-byte vectors
    staged in shared memory, 8 bytes win only while the 16-byte grid holds under a third of the
    GPU's thread slots (in registers, they won up to a full GPU's)."""
    if y_bytes != 1:
        return VECTOR_BYTES
    _, threads, tiles = reduce_tile(num_cols, y_bytes)
    small = num_tokens * tiles * threads < SMALL_GRID_SHARE * sm_count(device) * MAX_THREADS_PER_SM
    return 8 if small else VECTOR_BYTES


def weighted_reduce(
    y_PD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    *,
    sf_PG: torch.Tensor | None = None,
    group: int = 128,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.reduce.reference.weighted_reduce` (same arguments, same
    bits); tensors must be on a CUDA device and are copied first if not contiguous. Weights of 1
    (``weights_TK`` None) are compiled in: no tensor of ones is made (a fill launch)."""
    out_dtype = check_weighted_reduce_args(y_PD, pos_TK, weights_TK, sf_PG, group, out_dtype, values=False)
    check_cuda("y_PD", y_PD)
    p, d = y_PD.shape
    if sf_PG is None:
        sf_PG = y_PD.new_empty((p, -(-d // group)), dtype=torch.float32)  # never read

    t, k = pos_TK.shape
    if t == 0 or d == 0 or k == 0 or p == 0:  # no token, or no row any route could read
        return torch.zeros((t, d), dtype=out_dtype, device=y_PD.device)
    out_TD = torch.empty((t, d), dtype=out_dtype, device=y_PD.device)
    unit = weights_TK is None
    if unit:
        weights_TK = torch.empty((t, k), dtype=torch.float32, device=y_PD.device)  # never read
    kernel = get_weighted_reduce_kernel(
        d, k, tl_dtype(y_PD.dtype), tl_dtype(pos_TK.dtype), tl_dtype(out_dtype), group, sf_PG.dtype == torch.uint8,
        unit, reduce_vector_bytes(t, d, y_PD.element_size(), y_PD.device),
    )
    kernel(aligned(y_PD), sf_PG.contiguous(), pos_TK.contiguous(), weights_TK.contiguous(), out_TD)
    return out_TD




def reduce_put(y_PD: torch.Tensor, pos_RK: torch.Tensor, weights_RK: torch.Tensor, dest_RW: torch.Tensor,
               region, *, skip_rank: int = -1, group: int = 128, max_threads: int | None = None,
               staged: bool | None = None) -> None:
    """The TileLang twin of :func:`kernels.comm.reference.reduce_put` (same bits): each row's
    weighted reduce stored straight into the peers' copies of ``region`` (a symmetric heap's
    ``kernels.comm.PeerRegion``, with ``delta_W``; or ``TokenRegions`` of one heap, the rows cast
    to e4m3 on the way, for groups :func:`fp8_lanes` takes), never to memory of its own. CTAs of
    ``max_threads`` at most, rows ``staged`` or not (:func:`get_weighted_reduce_put_kernel`); by
    default ``PUT_THREADS`` in registers for rows in y's dtype, ``FP8_PUT_THREADS`` staged where a
    thread's vector is 16 bytes for e4m3 rows."""
    # here, not at the top: kernels.comm's reference imports kernels.reduce
    from kernels.comm.put_rows_kernel import peer_copy
    from kernels.comm.reference import TokenRegions, check_skip_rank

    fp8 = isinstance(region, TokenRegions)
    rows = region.q if fp8 else region
    out_dtype = y_PD.dtype if fp8 else rows.views[0].dtype
    check_weighted_reduce_args(y_PD, pos_RK, weights_RK, None, 128, out_dtype, values=False)
    check_cuda("y_PD", y_PD)
    if max_threads is None:
        max_threads = FP8_PUT_THREADS if fp8 else PUT_THREADS
    if staged is None and not fp8:
        staged = False
    if not (32 <= max_threads <= 1024 and max_threads % 32 == 0):
        raise ValueError(f"max_threads: expected a multiple of 32 from 32 to 1024, got {max_threads}")
    check_tensor("dest_RW", dest_RW, dtype=(torch.int32, torch.int64), shape=(pos_RK.shape[0], rows.world),
                 device=y_PD.device)
    check_skip_rank(skip_rank, rows.world)
    r, k = pos_RK.shape
    p, d = y_PD.shape
    if fp8:
        if not fp8_lanes(d, y_PD.element_size(), group):
            raise ValueError(f"group: expected whole vectors of {d} {y_PD.dtype} columns, at most a warp's, per scale "
                             f"group, got {group} (kernels.comm.reduce_put takes the reference then)")
        first = peer_copy(rows, "region.q", dtype=torch.uint8, width=d).view(torch.float8_e4m3fn)
        sf_F = peer_copy(region.sf, "region.sf", dtype=torch.float32, width=-(-d // group)).view(-1)
    else:
        first = peer_copy(rows, width=d)
        sf_F = torch.empty(1, dtype=torch.float32, device=y_PD.device)  # never read
    if r == 0 or d == 0:
        return
    vec = reduce_tile(d, y_PD.element_size(), max_threads)[0]
    sf_PG = y_PD.new_empty((p, -(-d // 128)), dtype=torch.float32)  # never read
    kernel = get_weighted_reduce_put_kernel(d, k, tl_dtype(y_PD.dtype), tl_dtype(out_dtype), 128, False, rows.world,
                                            max_threads, group if fp8 else 0, staged)
    kernel(aligned(y_PD), sf_PG, pos_RK.to(torch.int32).contiguous(), weights_RK.contiguous(),
           dest_RW.to(torch.int32).contiguous(), rows.delta_W, first.view(-1, vec), sf_F, skip_rank)


def reduce_sum_home(y_PD: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor, rows_SD: torch.Tensor,
                    home_TW: torch.Tensor, *, rank: int, sf_SG: torch.Tensor | None = None,
                    group: int = 128, signal: Signal | None = None, staged: bool | None = None) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.reduce.reference.reduce_sum_home` (same arguments, same
    bits); tensors must be on a CUDA device. A row of ``home_TW`` outside ``rows_SD`` reads as -1
    (values are not checked: a host sync). With a ``kernels.comm.Signal``, the returned rows are
    read only after the heap's barrier it stands for, which the kernel passes itself (the own rows
    reduced while the peers' signals fly; a CTA narrower than the ranks, a small hidden size, takes
    the barrier as a kernel of its own first). ``staged``: see :func:`get_reduce_sum_home_kernel`."""
    out_dtype = check_reduce_sum_home_args(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank, sf_SG, group)
    check_cuda("y_PD", y_PD)
    (t, k), (p, d) = pos_TK.shape, y_PD.shape
    world = home_TW.shape[1]
    if signal is not None:
        check_signal(signal, y_PD.device, world)
    # nothing to sum (a rank without tokens in a CUDA graph: no host sync), no routes or no expert
    # rows (never in a combine), or scale groups that split a thread's vector
    alone = (t == 0 or d == 0 or k == 0 or p == 0
             or (sf_SG is not None and group % reduce_tile(d, y_PD.element_size())[0]))
    # the barrier as a kernel of its own where no kernel of ours follows, or where its CTA has fewer
    # threads than ranks (a thread a peer signals and waits)
    if signal is not None and (alone or reduce_tile(d, y_PD.element_size())[1] < world):
        barrier_alone(signal)
        signal = None
    if t == 0 or d == 0:
        return torch.empty((t, d), dtype=out_dtype, device=y_PD.device)
    if alone:
        return reference_reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank=rank, sf_SG=sf_SG,
                                         group=group)
    out_TD = torch.empty((t, d), dtype=out_dtype, device=y_PD.device)
    sf_PG = y_PD.new_empty((p, -(-d // 128)), dtype=torch.float32)  # never read
    kernel = get_reduce_sum_home_kernel(d, k, tl_dtype(y_PD.dtype), tl_dtype(out_dtype), world,
                                        tl_dtype(rows_SD.dtype), group, signal is not None, staged)
    kernel(aligned(y_PD), sf_PG, pos_TK.to(torch.int32).contiguous(), weights_TK.contiguous(), aligned(rows_SD),
           sf_PG if sf_SG is None else sf_SG.contiguous(), home_TW.to(torch.int32).contiguous(), out_TD, rank,
           *signal_args(signal, world, y_PD.device))
    return out_TD
