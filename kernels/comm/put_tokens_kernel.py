"""TileLang kernel of :func:`kernels.comm.reference.put_tokens`: dispatch's sending side in one
launch. Each CTA loads a ``[tile_m, tile_n]`` tile of tokens (whole scale groups, the tiles of
:mod:`kernels.quant.blockwise_cast_kernel`) and its tokens' routes, reduces each group's amax,
casts to e4m3 in registers and stores the bytes and the scales straight into the regions of every
rank a token goes to, at the token's fixed row (``rank * T_max + t``: no scan over the batch, so no
planning launch before it); the first column tile also stores the metadata rows into every rank's
region and the way there and back (``dest_TW``, ``home_TW``) here, and the first CTA the counts.
Against ``plan_send``, ``per_token_cast`` then four ``put_rows``, the e4m3 rows are never written
to or read back from this rank's memory, and five launches go.

Peers are reached as in :mod:`kernels.comm.put_rows_kernel`: each region is given as rank 0's
copy, and rank w's lies ``delta_W[w]`` bytes from it (every region of one symmetric heap shares the
offsets). The e4m3 rows are stored as ``vec``-byte vectors (rank 0's copy viewed ``[C, vec]``, so
the peer offset falls on a vector boundary); scales, metadata and counts as 4-byte words. Those
stores lie outside the buffers the kernel is given, so TileLang's out-of-bounds guards are off and
every access is guarded by hand. Values are not checked (no host sync): an expert id outside
``[0, W * E_local)`` goes nowhere, as -1 does.

Shape suffixes: T tokens, D hidden, K routes, W ranks, M = 2K metadata words, G scale groups, C
vectors of a region, V vectors of a tile row, E elements of a vector.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.pdl import chained
from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.quant.tiles import (
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
from kernels.validate import check_tensor

from .plan_kernel import goes_to
from .put_rows_kernel import peer_copy
from .reference import TokenRegions


@tilelang.jit(pass_configs=PEER_PASS_CONFIGS)
def get_put_tokens_kernel(hidden: int, dtype: str, group: int, world: int, topk: int, index_dtype: str = "int32"):
    """``(x_TD, idx_TK, weight_bits_TK, delta_W, dest_TW, home_TW, q_CE, sf_F, meta_F, counts_F,
    e_local, rank, t_max)`` kernel for tokens of ``hidden`` values of ``dtype``, one float32 scale
    per ``group`` columns, W = ``world`` ranks and ``topk`` routes a token (ids int32 or int64;
    token and row counts dynamic)."""
    num_tokens, num_dst = T.dynamic("num_tokens"), T.dynamic("num_dst")
    vec = vector_width(hidden, T.dtype(dtype).bytes)
    tile_m, tile_n, threads = blockwise_tile(hidden, (1, group), vec)
    tile_g, tile_v = tile_n // group, tile_n // vec
    nv, groups, meta_width = hidden // vec, -(-hidden // group), 2 * topk
    layout = vector_layout(tile_m, tile_n, threads, vec)

    @T.prim_func
    def put_tokens(
        x_TD: T.Tensor[(num_tokens, hidden), dtype],
        idx_TK: T.Tensor[(num_tokens, topk), index_dtype],
        weight_bits_TK: T.Tensor[(num_tokens, topk), "int32"],
        delta_W: T.Tensor[(world,), "int64"],
        dest_TW: T.Tensor[(num_tokens, world), "int32"],
        home_TW: T.Tensor[(num_tokens, world), "int32"],
        q_CE: T.Tensor[(num_dst * nv, vec), "float8_e4m3fn"],
        sf_F: T.Tensor[(num_dst * groups,), "float32"],
        meta_F: T.Tensor[(num_dst * meta_width,), "int32"],
        counts_F: T.Tensor[(world,), "int32"],
        e_local: T.int32,
        rank: T.int32,
        t_max: T.int32,
    ):
        tiles_n = T.ceildiv(hidden, tile_n)
        # At least one CTA: with no tokens the counts (zeros) still go out.
        with T.Kernel(T.max(T.ceildiv(num_tokens, tile_m) * tiles_n, 1), threads=threads) as pid:
            chained()
            pm, pn = row_major(pid, tiles_n)
            x_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            q_frag = T.alloc_fragment((tile_m, tile_n), "float8_e4m3fn")
            amax = T.alloc_fragment((tile_m, tile_g), dtype)
            inv_frag = T.alloc_fragment((tile_m, tile_g), "float32")
            sf_frag = T.alloc_fragment((tile_m, tile_g), "float32")
            meta_MM = T.alloc_shared((tile_m, meta_width), "int32")  # ids (-1 past the batch), weight bits
            dest_MW = T.alloc_shared((tile_m, world), "int32")
            T.annotate_layout({x_frag: layout, q_frag: layout})
            # Every load before the first global store: the kernel waits for the one before it
            # (kernels.pdl), so its pointers are not __restrict__ and no load is hoisted above a store.
            for i, k in T.Parallel(tile_m, topk):
                token = pm * tile_m + i
                meta_MM[i, k] = T.if_then_else(token < num_tokens, T.Cast("int32", idx_TK[token, k]), -1)
                meta_MM[i, topk + k] = T.if_then_else(token < num_tokens, weight_bits_TK[token, k], 0)
            deltas = T.alloc_local((world,), "int64")
            for w in T.unroll(world):
                deltas[w] = delta_W[w]
            for i, j in T.Parallel(tile_m, tile_n):
                if pm * tile_m + i < num_tokens and pn * tile_n + j < hidden:
                    x_frag[i, j] = x_TD[pm * tile_m + i, pn * tile_n + j]
                else:
                    x_frag[i, j] = T.cast(0, dtype)
            for i, w in T.Parallel(tile_m, world):  # the token's fixed row at rank w, if it goes there
                goes = goes_to([meta_MM[i, k] for k in range(topk)], w, e_local)
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
                if pn == 0:  # every rank gets the routes: how a receiver tells this call's rows apart
                    for i, m in T.Parallel(tile_m, meta_width):
                        row = T.Cast("int64", rank * t_max + pm * tile_m + i)
                        if pm * tile_m + i < num_tokens:
                            meta_F[deltas[w] // 4 + row * meta_width + m] = meta_MM[i, m]
            if pn == 0:
                for i, w in T.Parallel(tile_m, world):
                    if pm * tile_m + i < num_tokens:
                        dest_TW[pm * tile_m + i, w] = dest_MW[i, w]
                        home_TW[pm * tile_m + i, w] = T.if_then_else(dest_MW[i, w] >= 0,
                                                                     w * t_max + pm * tile_m + i, -1)
            if pid == 0 and T.get_thread_binding() == 0:
                for w in T.unroll(world):
                    counts_F[deltas[w] // 4 + rank] = num_tokens

    return put_tokens


def put_tokens(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, regions: TokenRegions,
               *, num_local_experts: int, rank: int, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of :func:`kernels.comm.reference.put_tokens` (same bytes in every region,
    same ``(dest_TW, home_TW)``). The regions must lie in one symmetric heap (one ``delta_W``)."""
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, ndim=2)
    check_cuda("x_TD", x_TD)
    if not supports_block((1, group)):
        raise ValueError(f"group: expected a power of two from 2 to 1024, got {group}")
    t, d = x_TD.shape
    world = regions.counts.world
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int32, torch.int64), shape=(t, None), device=x_TD.device)
    k = topk_idx_TK.shape[1]
    check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=(t, k), device=x_TD.device)
    meta = peer_copy(regions.meta, "regions.meta", dtype=torch.int32, width=2 * k)
    if meta.shape[0] % world:
        raise ValueError(f"regions.meta: expected W * T_max rows for W = {world}, got shape {tuple(meta.shape)}")
    max_tokens = meta.shape[0] // world
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world} (the regions' ranks), got {rank}")
    if t > max_tokens:
        raise ValueError(f"x_TD: expected at most T_max = {max_tokens} tokens (the regions' rows / W), got {t}")
    q = peer_copy(regions.q, "regions.q", dtype=torch.uint8, width=d)
    sf = peer_copy(regions.sf, "regions.sf", dtype=torch.float32, width=-(-d // group))
    counts = peer_copy(regions.counts, "regions.counts", dtype=torch.int32, width=1)
    if t == 0:  # an empty slice keeps its parent's strides, which the kernel's packed arguments reject
        x_TD, topk_idx_TK, topk_weights_TK = (a.new_empty(a.shape) for a in (x_TD, topk_idx_TK, topk_weights_TK))
    dest_TW = torch.empty((t, world), dtype=torch.int32, device=x_TD.device)
    home_TW = torch.empty_like(dest_TW)
    index_dtype = str(topk_idx_TK.dtype).removeprefix("torch.")
    kernel = get_put_tokens_kernel(d, tl_dtype(x_TD.dtype), group, world, k, index_dtype)
    vec = vector_width(d, x_TD.element_size())
    kernel(x_TD.contiguous(), topk_idx_TK.contiguous(), topk_weights_TK.contiguous().view(torch.int32),
           regions.q.delta_W, dest_TW, home_TW, q.view(E4M3).view(-1, vec), sf.view(-1), meta.view(-1), counts.view(-1),
           num_local_experts, rank, max_tokens)
    return dest_TW, home_TW
