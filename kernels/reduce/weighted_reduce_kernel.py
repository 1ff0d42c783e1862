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
treated as -1. ``reduce_sum_home`` (the home rank's side of a combine: its own rows reduced, then
the rows its peers returned added in rank order) dequantizes e4m3 returned rows in its sum and
stages its own rows; the peers' side, which stores each reduced row into its home rank's heap, is
:mod:`kernels.comm.reduce_put_kernel`, built on :func:`row_reducer`. The columns are split into the
fewest tiles of at most ``MAX_THREADS`` vectors, evenly (hidden 7168: 4 CTAs of 224 threads per
token for bf16 ``y``, 2 for e4m3 ``y``), so no CTA runs half empty.

Shape suffixes: T tokens, K routes per token, P layout rows, D hidden, G scale groups, S rows
returned home, W ranks, C and V vectors of a peer region.
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.signal import Signal
from kernels.signal_kernel import barrier_alone, check_signal, in_kernel_barrier, signal_args
from kernels.launch import launcher, stand_in
from kernels.pdl import chained
from kernels.reduce.reference import check_reduce_sum_home_args, check_weighted_reduce_args
from kernels.reduce.reference import reduce_sum_home as reference_reduce_sum_home
from kernels.rows import vector_cp_async
from kernels.tiles import (
    HAND_SYNC_PASS_CONFIGS,
    PEER_PASS_CONFIGS,
    VECTOR_BYTES,
    aligned,
    as_int32,
    check_cuda,
    row_major,
    sm_count,
    tl_dtype,
    unpack_scale,
)
from kernels.validate import per_signature

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


def row_reducer(num_cols: int, topk: int, y_dtype: str, out_dtype: str, group: int, packed: bool,
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
    fit them), for tuning sweeps, and ``staged`` rows (:func:`row_reducer`; by default where a
    thread's vector is 16 bytes)."""
    num_tokens, num_rows = T.dynamic("num_tokens"), T.dynamic("num_rows")
    vec, threads, tiles, reduce_row = row_reducer(num_cols, topk, y_dtype, out_dtype, group, packed, unit,
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


@tilelang.jit(pass_configs=PEER_SYNC_PASS_CONFIGS)  # its loads are guarded in the code: TileLang's checks are redundant
def get_reduce_sum_home_kernel(num_cols: int, topk: int, y_dtype: str, out_dtype: str, world: int,
                               rows_dtype: str | None = None, group: int = 128, signalled: bool = False,
                               staged: bool | None = None):
    """``(y_PD, sf_PG, pos_TK, weights_TK, rows_SD, sf_SG, home_TW, out_TD, rank, flags_W, own_W, delta_W,
    epoch_1, tickets_1, timeout_ns, report)`` kernel of
    :func:`kernels.reduce.reference.reduce_sum_home` (``sf_PG`` is never read): a thread reduces its
    vector of token t's own row (the weighted reduce's macro, rounded to the output dtype as
    ``reduce_put`` stores it), then adds it and the returned rows' vectors in rank order, every load
    issued before the one store. Returned rows of ``rows_dtype`` e4m3 are dequantized with their
    ``sf_SG`` scale (one per ``group`` columns; ``sf_SG`` unread for rows in ``out_dtype``). When
    ``signalled``, the kernel is the barrier before the returned rows (a
    :class:`kernels.comm.Signal`'s, :func:`kernels.signal_kernel.in_kernel_barrier`): its
    first CTA signals the peers as it starts, and every CTA waits for their signals after its own
    row's reduce, before it loads a returned row (the flags and counters unread otherwise).
    ``staged``: the own rows' vectors staged in shared memory (:func:`row_reducer`; by default where
    a thread's vector is 16 bytes: 56 registers instead of 82, so an SM holds 5 CTAs of 224 threads
    instead of 3; 126.8 against 168.6 us at 4096 tokens per rank on two H100s, FP8 rows home 122.4
    against 142.4)."""
    num_tokens, num_rows, num_src = T.dynamic("num_tokens"), T.dynamic("num_rows"), T.dynamic("num_src")
    num_sf = T.dynamic("num_sf")
    rows_dtype = rows_dtype or out_dtype
    dequantize = rows_dtype == "float8_e4m3fn"
    vec, threads, tiles, reduce_row = row_reducer(num_cols, topk, y_dtype, out_dtype, 128, False, staged=staged)
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
        timeout_ns: T.int64,
        report: T.int64,
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
                wait_peers(own_W, epoch[0], rank, timeout_ns, report)
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
    out_dtype, launch = _reduce_plan(y_PD, pos_TK, weights_TK, sf_PG, group, out_dtype)
    (p, d), (t, k) = y_PD.shape, pos_TK.shape
    if launch is None:  # no token, or no row any route could read
        return torch.zeros((t, d), dtype=out_dtype, device=y_PD.device)
    if sf_PG is None:
        sf_PG = stand_in((p, -(-d // group)), torch.float32, y_PD.device)  # never read
    if weights_TK is None:
        weights_TK = stand_in((t, k), torch.float32, y_PD.device)  # never read
    out_TD = torch.empty((t, d), dtype=out_dtype, device=y_PD.device)
    launch(aligned(y_PD), sf_PG.contiguous(), pos_TK.contiguous(), weights_TK.contiguous(), out_TD)
    return out_TD


@per_signature
def _reduce_plan(y_PD, pos_TK, weights_TK, sf_PG, group, out_dtype):
    """:func:`weighted_reduce`'s checks, its output dtype and launch (None: nothing to reduce), once
    per signature of its arguments (``kernels.validate.per_signature``)."""
    out_dtype = check_weighted_reduce_args(y_PD, pos_TK, weights_TK, sf_PG, group, out_dtype, values=False)
    check_cuda("y_PD", y_PD)
    (p, d), (t, k) = y_PD.shape, pos_TK.shape
    if t == 0 or d == 0 or k == 0 or p == 0:
        return out_dtype, None
    kernel = get_weighted_reduce_kernel(
        d, k, tl_dtype(y_PD.dtype), tl_dtype(pos_TK.dtype), tl_dtype(out_dtype), group,
        sf_PG is not None and sf_PG.dtype == torch.uint8, weights_TK is None,
        reduce_vector_bytes(t, d, y_PD.element_size(), y_PD.device),
    )
    return out_dtype, launcher(kernel)




def reduce_sum_home(y_PD: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor, rows_SD: torch.Tensor,
                    home_TW: torch.Tensor, *, rank: int, sf_SG: torch.Tensor | None = None,
                    group: int = 128, signal: Signal | None = None, staged: bool | None = None) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.reduce.reference.reduce_sum_home` (same arguments, same
    bits); tensors must be on a CUDA device. A row of ``home_TW`` outside ``rows_SD`` reads as -1
    (values are not checked: a host sync). With a ``kernels.comm.Signal``, the returned rows are
    read only after the heap's barrier it stands for, which the kernel passes itself (the own rows
    reduced while the peers' signals fly; a CTA narrower than the ranks, a small hidden size, takes
    the barrier as a kernel of its own first). ``staged``: see :func:`get_reduce_sum_home_kernel`."""
    barrier, out_dtype, launch, sf_PG, signal_tail = _sum_home_plan(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank,
                                                                   sf_SG, group, signal, staged)
    if barrier is not None:
        barrier_alone(barrier)
    t, d = pos_TK.shape[0], y_PD.shape[1]
    if t == 0 or d == 0:
        return torch.empty((t, d), dtype=out_dtype, device=y_PD.device)
    if launch is None:
        return reference_reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank=rank, sf_SG=sf_SG,
                                         group=group)
    out_TD = torch.empty((t, d), dtype=out_dtype, device=y_PD.device)
    launch(aligned(y_PD), sf_PG, as_int32(pos_TK), weights_TK.contiguous(), aligned(rows_SD),
           sf_PG if sf_SG is None else sf_SG.contiguous(), as_int32(home_TW), out_TD, rank, *signal_tail)
    return out_TD


@per_signature
def _sum_home_plan(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank, sf_SG, group, signal, staged):
    """:func:`reduce_sum_home`'s checks and choices, once per signature of its arguments
    (``kernels.validate.per_signature``): ``(the signal to pass as a kernel of its own first, or
    None; out_dtype; the kernel's launch, None where the reference sums; its never-read scales;
    its signal arguments)``."""
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
        barrier, signal = signal, None
    else:
        barrier = None
    if alone:
        return barrier, out_dtype, None, None, None
    kernel = get_reduce_sum_home_kernel(d, k, tl_dtype(y_PD.dtype), tl_dtype(out_dtype), world,
                                        tl_dtype(rows_SD.dtype), group, signal is not None, staged)
    return (barrier, out_dtype, launcher(kernel), stand_in((p, -(-d // 128)), torch.float32, y_PD.device),
            signal_args(signal, world, y_PD.device))
