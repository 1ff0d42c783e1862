"""TileLang kernel of :func:`kernels.comm.reference.put_tokens`: dispatch's FP8 rows in one
launch. Each CTA loads a ``[tile_m, tile_n]`` tile of tokens (whole scale groups, the tiles of
:mod:`kernels.quant.blockwise_cast_kernel`) and its tokens' expert ids, reduces each group's amax,
casts to e4m3 in registers and stores the bytes and the scales straight into the regions of every
rank a token goes to, at the token's fixed row (``rank * T_max + t``: no scan over the batch, so
no planning launch before it). Against ``per_token_cast`` then two ``put_rows``, the e4m3 rows are
never written to or read back from this rank's memory. The routes travel ahead of the rows
(``kernels.comm.put_routes``), or, for a small batch, in the same launch (``routes``).

Peers are reached as in :mod:`kernels.comm.put_rows_kernel`: each region is given as rank 0's
copy, and rank w's lies ``delta_W[w]`` bytes from it (every region of one symmetric heap shares the
offsets). The e4m3 rows are stored as ``vec``-byte vectors, 16 where the row and the scale group
allow, a thread's own (rank 0's copy viewed ``[C, vec]``, so the peer offset falls on a vector boundary; 16-byte
stores took 95.2 us against 8-byte ones' 96.4 with the barrier at 4096 tokens per rank on two
H100s); scales as 4-byte words. Those stores lie outside the
buffers the kernel is given, so TileLang's out-of-bounds guards are off and every access is
guarded by hand. Values are not checked on the host (no host sync): with ``routes`` the kernel
checks each token's routes on the device, as ``put_routes`` does (otherwise ``put_routes``, which
runs beside it, has).

Shape suffixes: T tokens, D hidden, K routes, W ranks, G scale groups, C vectors of a region, V
vectors of a tile row, E elements of a vector.
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.launch import launcher, stand_in
from kernels.pdl import chained
from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.tiles import (
    PEER_PASS_CONFIGS,
    blockwise_tile,
    cast_per_token,
    check_cuda,
    row_major,
    supports_block,
    tl_dtype,
    vector_layout,
    vector_width,
)
from kernels.validate import check_tensor, per_signature

from .plan_kernel import assert_routes, goes_to, put_routes
from .put_rows_kernel import peer_copy
from .reference import RouteRegions, TokenRegions


@tilelang.jit(pass_configs=PEER_PASS_CONFIGS)
def get_put_tokens_kernel(hidden: int, dtype: str, group: int, world: int, topk: int, index_dtype: str = "int32",
                          tile: tuple[int, int, int] | None = None, vec: int | None = None, routes: bool = False):
    """``(x_TD, idx_TK, delta_W, q_CE, sf_F, e_local, rank, t_max, weight_bits_TK, meta_F, counts_F,
    dest_TW, home_TW)`` kernel for tokens of ``hidden`` values of ``dtype``, one float32 scale per
    ``group`` columns, W = ``world`` ranks and ``topk`` routes a token (ids int32 or int64; token and row counts dynamic). ``tile`` overrides
    :func:`kernels.tiles.blockwise_tile`'s ``(tile_m, tile_n, threads)`` and ``vec`` the
    consecutive elements a thread holds, casts and stores as one vector (for tuning sweeps, which
    pass the regions' e4m3 rows viewed as vectors of ``vec``). With ``routes``, the kernel also does
    what ``put_routes`` does (a small batch's send in one launch): the first column tile of each
    token stores its metadata row (ids, weight bits) into every rank's ``meta_F`` (rank 0's copy,
    flat) and writes the way there and back, and the first CTA's first thread the count into every
    rank's ``counts_F`` (all unread otherwise)."""
    num_tokens, num_dst = T.dynamic("num_tokens"), T.dynamic("num_dst")
    num_meta, num_counts = T.dynamic("num_meta"), T.dynamic("num_counts")
    num_routed = T.dynamic("num_routed")  # num_tokens with ``routes``; 1 for the stand-ins without
    vec = vec or math.gcd(vector_width(hidden, 1), group)  # a thread's 16-byte e4m3 vector, in one group
    tile_m, tile_n, threads = tile or blockwise_tile(hidden, (1, group), vec)
    tile_g, tile_v = tile_n // group, tile_n // vec
    nv, groups = hidden // vec, -(-hidden // group)
    layout = vector_layout(tile_m, tile_n, threads, vec)

    @T.prim_func
    def put_tokens(
        x_TD: T.Tensor[(num_tokens, hidden), dtype],
        idx_TK: T.Tensor[(num_tokens, topk), index_dtype],
        delta_W: T.Tensor[(world,), "int64"],
        q_CE: T.Tensor[(num_dst * nv, vec), "float8_e4m3fn"],
        sf_F: T.Tensor[(num_dst * groups,), "float32"],
        e_local: T.int32,
        rank: T.int32,
        t_max: T.int32,
        weight_bits_TK: T.Tensor[(num_routed, topk), "int32"],
        meta_F: T.Tensor[(num_meta,), "int32"],
        counts_F: T.Tensor[(num_counts,), "int32"],
        dest_TW: T.Tensor[(num_routed, world), "int32"],
        home_TW: T.Tensor[(num_routed, world), "int32"],
    ):
        tiles_n = T.ceildiv(hidden, tile_n)
        with T.Kernel(T.ceildiv(num_tokens, tile_m) * tiles_n, threads=threads) as pid:
            chained()
            pm, pn = row_major(pid, tiles_n)
            x_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            q_frag = T.alloc_fragment((tile_m, tile_n), "float8_e4m3fn")
            amax = T.alloc_fragment((tile_m, tile_g), dtype)
            inv_frag = T.alloc_fragment((tile_m, tile_g), "float32")
            sf_frag = T.alloc_fragment((tile_m, tile_g), "float32")
            ids_MK = T.alloc_shared((tile_m, topk), "int32")  # -1 past the batch
            bits_MK = T.alloc_shared((tile_m, topk), "int32")  # the weights' bits (with ``routes``)
            dest_MW = T.alloc_shared((tile_m, world), "int32")
            T.annotate_layout({x_frag: layout, q_frag: layout})
            # Every load before the first global store: the kernel waits for the one before it
            # (kernels.pdl), so its pointers are not __restrict__ and no load is hoisted above a store.
            for i, k in T.Parallel(tile_m, topk):
                token = pm * tile_m + i
                ids_MK[i, k] = T.if_then_else(token < num_tokens, T.Cast("int32", idx_TK[token, k]), -1)
            if routes:
                for i, k in T.Parallel(tile_m, topk):
                    token = pm * tile_m + i
                    bits_MK[i, k] = T.if_then_else(token < num_tokens, weight_bits_TK[token, k], 0)
                if pn == 0:  # put_routes' check, a thread a token
                    for r in T.unroll(-(-tile_m // threads)):
                        i = r * threads + T.get_thread_binding()
                        if T.And(i < tile_m, pm * tile_m + i < num_tokens):
                            assert_routes([idx_TK[pm * tile_m + i, k] for k in range(topk)], world * e_local)
            deltas = T.alloc_local((world,), "int64")
            for w in T.unroll(world):
                deltas[w] = delta_W[w]
            for i, j in T.Parallel(tile_m, tile_n):
                if pm * tile_m + i < num_tokens and pn * tile_n + j < hidden:
                    x_frag[i, j] = x_TD[pm * tile_m + i, pn * tile_n + j]
                else:
                    x_frag[i, j] = T.cast(0, dtype)
            for i, w in T.Parallel(tile_m, world):  # the token's fixed row at rank w, if it goes there
                goes = goes_to([ids_MK[i, k] for k in range(topk)], w, e_local)
                dest_MW[i, w] = T.if_then_else(goes, rank * t_max + pm * tile_m + i, -1)
            cast_per_token(x_frag, amax, sf_frag, inv_frag, q_frag, group, False, False)
            q_MVE = T.reshape(q_frag, [tile_m, tile_v, vec])
            for w in T.unroll(world):
                for i, v, e in T.Parallel(tile_m, tile_v, vec):
                    if dest_MW[i, w] >= 0 and pn * tile_v + v < nv:
                        q_CE[deltas[w] // vec + T.Cast("int64", dest_MW[i, w]) * nv + pn * tile_v + v, e] = q_MVE[i, v, e]
                for i, g in T.Parallel(tile_m, tile_g):
                    if dest_MW[i, w] >= 0 and pn * tile_g + g < groups:
                        sf_F[deltas[w] // 4 + T.Cast("int64", dest_MW[i, w]) * groups + pn * tile_g + g] = sf_frag[i, g]
            if routes:  # put_routes' stores: every token's routes and the count go to every rank
                if pn == 0:
                    for w in T.unroll(world):
                        for i, m in T.Parallel(tile_m, 2 * topk):
                            token = pm * tile_m + i
                            if token < num_tokens:
                                meta_F[deltas[w] // 4 + T.Cast("int64", rank * t_max + token) * (2 * topk) + m] = \
                                    T.if_then_else(m < topk, ids_MK[i, m % topk], bits_MK[i, m % topk])
                    for i, w in T.Parallel(tile_m, world):
                        token = pm * tile_m + i
                        if token < num_tokens:
                            dest_TW[token, w] = dest_MW[i, w]
                            home_TW[token, w] = T.if_then_else(dest_MW[i, w] >= 0, w * t_max + token, -1)
                if T.And(pid == 0, T.get_thread_binding() == 0):  # one thread: any number of ranks
                    for w in T.unroll(world):
                        counts_F[deltas[w] // 4 + rank] = num_tokens

    return put_tokens


def put_tokens(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, regions: TokenRegions, *, num_local_experts: int,
               rank: int, group: int = 128) -> None:
    """The TileLang twin of :func:`kernels.comm.reference.put_tokens` (same bytes in every region).
    The regions must lie in one symmetric heap (one ``delta_W``)."""
    _put(x_TD, topk_idx_TK, None, regions, None, num_local_experts=num_local_experts, rank=rank, group=group)


def put_tokens_and_routes(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                          tokens: TokenRegions, routes: RouteRegions, *, num_local_experts: int, rank: int,
                          group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of :func:`kernels.comm.reference.put_tokens_and_routes` (same bytes in
    every region, the same way there and back), in one launch. All regions must lie in one
    symmetric heap (one ``delta_W``)."""
    return _put(x_TD, topk_idx_TK, topk_weights_TK, tokens, routes, num_local_experts=num_local_experts, rank=rank,
                group=group)


def _put(x_TD, topk_idx_TK, topk_weights_TK, regions, routes, *, num_local_experts, rank, group):
    """``put_tokens``, and with ``routes`` (``RouteRegions`` of the tokens' heap) ``put_routes``'
    stores too, returning ``(dest_TW, home_TW)``."""
    launch, args, tail = _plan(x_TD, topk_idx_TK, topk_weights_TK, regions, routes, num_local_experts, rank, group)
    t = x_TD.shape[0]
    if routes is not None and t == 0:  # no rows; put_routes still tells every rank the count
        return put_routes(topk_idx_TK, topk_weights_TK, routes, num_local_experts=num_local_experts, rank=rank)
    if t == 0:
        return None
    if routes is None:
        launch(x_TD.contiguous(), topk_idx_TK.contiguous(), *args, *tail)
        return None
    world = regions.q.world
    dest_TW = torch.empty((t, world), dtype=torch.int32, device=x_TD.device)
    home_TW = torch.empty((t, world), dtype=torch.int32, device=x_TD.device)
    launch(x_TD.contiguous(), topk_idx_TK.contiguous(), *args, topk_weights_TK.contiguous().view(torch.int32), *tail,
           dest_TW, home_TW)
    return dest_TW, home_TW


@per_signature
def _plan(x_TD, topk_idx_TK, topk_weights_TK, regions, routes, num_local_experts, rank, group):
    """:func:`_put`'s checks, once per signature of its arguments (``kernels.validate.per_signature``),
    and ``(launch, args, tail)``: the launch, its arguments between the routes and the weights' bits,
    and those after the bits (with ``routes``: the route regions' flat copies, before the way there
    and back; without: stand-ins of every unread argument from the bits on); Nones for no tokens."""
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, ndim=2)
    check_cuda("x_TD", x_TD)
    if not supports_block((1, group)):
        raise ValueError(f"group: expected a power of two from 2 to 1024, got {group}")
    t, d = x_TD.shape
    world = regions.q.world
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int32, torch.int64), shape=(t, None), device=x_TD.device)
    q = peer_copy(regions.q, "regions.q", dtype=torch.uint8, width=d)
    sf = peer_copy(regions.sf, "regions.sf", dtype=torch.float32, width=-(-d // group))
    if q.shape[0] % world or sf.shape[0] != q.shape[0]:
        raise ValueError(f"regions: expected W * T_max rows of q and sf for W = {world}, got {tuple(q.shape)} and "
                         f"{tuple(sf.shape)}")
    max_tokens = q.shape[0] // world
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world} (the regions' ranks), got {rank}")
    if t > max_tokens:
        raise ValueError(f"x_TD: expected at most T_max = {max_tokens} tokens (the regions' rows / W), got {t}")
    if t == 0:
        return None, None, None
    k = topk_idx_TK.shape[1]
    if routes is None:
        bits_TK = stand_in((1, k), torch.int32, x_TD.device)  # never read
        dest_TW = home_TW = stand_in((1, world), torch.int32, x_TD.device)
        meta_F = counts_F = stand_in((1,), torch.int32, x_TD.device)
        tail = (bits_TK, meta_F, counts_F, dest_TW, home_TW)
    else:
        check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=(t, k), device=x_TD.device)
        if routes.meta.delta_W is not regions.q.delta_W or routes.counts.delta_W is not regions.q.delta_W:
            raise ValueError("routes: expected regions of the tokens' symmetric heap (the same delta_W)")
        meta = peer_copy(routes.meta, "routes.meta", dtype=torch.int32)
        counts = peer_copy(routes.counts, "routes.counts", dtype=torch.int32, width=1)
        if meta.shape != (q.shape[0], 2 * k) or counts.shape[0] != world:
            raise ValueError(f"routes: expected {q.shape[0]} meta rows (the tokens' regions') of 2K = {2 * k} words "
                             f"and W = {world} counts, got {tuple(meta.shape)} and {tuple(counts.shape)}")
        tail = (peer_copy(routes.meta, dtype=torch.int32, layout=(torch.int32, -1)),
                peer_copy(routes.counts, dtype=torch.int32, width=1, layout=(torch.int32, -1)))
    index_dtype = str(topk_idx_TK.dtype).removeprefix("torch.")
    kernel = get_put_tokens_kernel(d, tl_dtype(x_TD.dtype), group, world, k, index_dtype, routes=routes is not None)
    vec = math.gcd(vector_width(d, 1), group)
    q_CE = peer_copy(regions.q, dtype=torch.uint8, width=d, layout=(E4M3, -1, vec))
    sf_F = peer_copy(regions.sf, dtype=torch.float32, width=-(-d // group), layout=(torch.float32, -1))
    return launcher(kernel), (regions.q.delta_W, q_CE, sf_F, num_local_experts, rank, max_tokens), tail
