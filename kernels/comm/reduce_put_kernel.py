"""TileLang kernels of :func:`kernels.comm.reference.reduce_put` (same bits): each received row
reduced over this rank's experts (:mod:`kernels.reduce.weighted_reduce_kernel`'s row reducer) and
stored straight into its home rank's region of a symmetric heap, as e4m3 with its scales where the
rows travel as FP8.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.launch import launcher, stand_in
from kernels.pdl import chained
from kernels.reduce.reference import check_weighted_reduce_args
from kernels.reduce.weighted_reduce_kernel import PEER_SYNC_PASS_CONFIGS, reduce_tile, row_reducer
from kernels.tiles import aligned, as_int32, check_cuda, row_major, scale_and_inverse, tl_dtype, to_e4m3
from kernels.validate import check_tensor, per_signature

from .put_rows_kernel import peer_copy

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
    (:func:`row_reducer`). The defaults are the build for rows in y's dtype; :func:`reduce_put`
    picks the FP8 one (``FP8_PUT_THREADS``, staged)."""
    num_tokens, num_rows, num_dst = T.dynamic("num_tokens"), T.dynamic("num_rows"), T.dynamic("num_dst")
    num_sf = T.dynamic("num_sf")
    vec, threads, tiles, reduce_row = row_reducer(num_cols, topk, y_dtype, out_dtype, group, packed,
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
    plan = _plan(y_PD, pos_RK, weights_RK, dest_RW, region, skip_rank, group, max_threads, staged)
    if plan is not None:
        launch, rows_CE, sf_F, sf_PG, delta_W = plan
        launch(aligned(y_PD), sf_PG, as_int32(pos_RK), weights_RK.contiguous(), as_int32(dest_RW), delta_W, rows_CE,
               sf_F, skip_rank)


@per_signature
def _plan(y_PD, pos_RK, weights_RK, dest_RW, region, skip_rank, group, max_threads, staged):
    """:func:`reduce_put`'s checks, and what its launch takes besides the call's tensors (None: no
    launch), once per signature of its arguments (``kernels.validate.per_signature``)."""
    # here, not at the top: kernels.comm's reference imports kernels.reduce
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
        peer_copy(rows, "region.q", dtype=torch.uint8, width=d)
        sf_F = peer_copy(region.sf, "region.sf", dtype=torch.float32, width=-(-d // group), layout=(torch.float32, -1))
    else:
        peer_copy(rows, width=d)
        sf_F = stand_in((1,), torch.float32, y_PD.device)  # never read
    if r == 0 or d == 0:
        return None
    vec = reduce_tile(d, y_PD.element_size(), max_threads)[0]
    rows_CE = peer_copy(rows, width=d, layout=(torch.float8_e4m3fn if fp8 else out_dtype, -1, vec))
    sf_PG = stand_in((p, -(-d // 128)), torch.float32, y_PD.device)  # never read
    kernel = get_weighted_reduce_put_kernel(d, k, tl_dtype(y_PD.dtype), tl_dtype(out_dtype), 128, False, rows.world,
                                            max_threads, group if fp8 else 0, staged)
    return launcher(kernel), rows_CE, sf_F, sf_PG, rows.delta_W
