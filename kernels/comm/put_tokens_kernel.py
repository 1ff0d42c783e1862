"""TileLang kernel of :func:`kernels.comm.reference.put_tokens`: dispatch's sending side in one
launch. Each CTA loads a ``[tile_m, tile_n]`` tile of tokens (whole scale groups, the tiles of
:mod:`kernels.quant.blockwise_cast_kernel`), reduces each group's amax, casts to e4m3 in registers
and stores the bytes, the scales and (the first column tile) the metadata rows straight into every
destination rank's regions; the first CTA also stores the per-rank counts. Against
``per_token_cast`` then four ``put_rows``, the e4m3 rows are never written to or read back from
this rank's memory, and three launches go.

Peers are reached as in :mod:`kernels.comm.put_rows_kernel`: each region is given as rank 0's
copy, and rank w's lies ``delta_W[w]`` bytes from it (every region of one symmetric heap shares the
offsets). The e4m3 rows are stored as ``vec``-byte vectors (rank 0's copy viewed ``[C, vec]``, so
the peer offset falls on a vector boundary); scales, metadata and counts as 4-byte words. Those
stores lie outside the buffers the kernel is given, so TileLang's out-of-bounds guards are off and
every access is guarded by hand. Values are not checked (no host sync): a destination row outside
``[0, M)`` is skipped, as -1 is.

Shape suffixes: T tokens, D hidden, W ranks, X metadata words, M destination rows, G scale groups,
C vectors of a region, V vectors of a tile row, E elements of a vector.
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

from .put_rows_kernel import peer_copy
from .reference import TokenRegions


@tilelang.jit(pass_configs=PEER_PASS_CONFIGS)
def get_put_tokens_kernel(hidden: int, dtype: str, group: int, world: int, meta_width: int):
    """``(x_TD, dest_TW, delta_W, meta_TX, count_W, q_CE, sf_F, meta_F, counts_F, rank)`` kernel
    for tokens of ``hidden`` values of ``dtype``, one float32 scale per ``group`` columns, W =
    ``world`` ranks and metadata rows of ``meta_width`` words (token and row counts dynamic)."""
    num_tokens, num_dst = T.dynamic("num_tokens"), T.dynamic("num_dst")
    vec = vector_width(hidden, T.dtype(dtype).bytes)
    tile_m, tile_n, threads = blockwise_tile(hidden, (1, group), vec)
    tile_g, tile_v = tile_n // group, tile_n // vec
    nv, groups = hidden // vec, -(-hidden // group)
    layout = vector_layout(tile_m, tile_n, threads, vec)

    @T.prim_func
    def put_tokens(
        x_TD: T.Tensor[(num_tokens, hidden), dtype],
        dest_TW: T.Tensor[(num_tokens, world), "int32"],
        delta_W: T.Tensor[(world,), "int64"],
        meta_TX: T.Tensor[(num_tokens, meta_width), "int32"],
        count_W: T.Tensor[(world,), "int32"],
        q_CE: T.Tensor[(num_dst * nv, vec), "float8_e4m3fn"],
        sf_F: T.Tensor[(num_dst * groups,), "float32"],
        meta_F: T.Tensor[(num_dst * meta_width,), "int32"],
        counts_F: T.Tensor[(world,), "int32"],
        rank: T.int32,
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
            dest_MW = T.alloc_shared((tile_m, world), "int32")
            meta_MX = T.alloc_shared((tile_m, meta_width), "int32")
            T.annotate_layout({x_frag: layout, q_frag: layout})
            # Every load before the first store: the kernel waits for the one before it (kernels.pdl),
            # so its pointers are not __restrict__ and no load is hoisted above a store.
            for i, w in T.Parallel(tile_m, world):
                token = pm * tile_m + i
                row = T.if_then_else(token < num_tokens, dest_TW[token, w], -1)
                dest_MW[i, w] = T.if_then_else(row < num_dst, row, -1)
            deltas = T.alloc_local((world,), "int64")
            for w in T.unroll(world):
                deltas[w] = delta_W[w]
            if pn == 0:
                for i, x in T.Parallel(tile_m, meta_width):
                    if pm * tile_m + i < num_tokens:
                        meta_MX[i, x] = meta_TX[pm * tile_m + i, x]
            for i, j in T.Parallel(tile_m, tile_n):
                if pm * tile_m + i < num_tokens and pn * tile_n + j < hidden:
                    x_frag[i, j] = x_TD[pm * tile_m + i, pn * tile_n + j]
                else:
                    x_frag[i, j] = T.cast(0, dtype)
            cast_per_token(x_frag, amax, sf_frag, inv_frag, q_frag, group, False, False)
            q_MVE = T.reshape(q_frag, [tile_m, tile_v, vec])
            for w in T.unroll(world):
                for i, v, e in T.Parallel(tile_m, tile_v, vec):
                    if dest_MW[i, w] >= 0 and pn * tile_v + v < nv:
                        q_CE[deltas[w] // vec + T.Cast("int64", dest_MW[i, w]) * nv + pn * tile_v + v, e] = q_MVE[i, v, e]
                for i, g in T.Parallel(tile_m, tile_g):
                    if dest_MW[i, w] >= 0 and pn * tile_g + g < groups:
                        sf_F[deltas[w] // 4 + T.Cast("int64", dest_MW[i, w]) * groups + pn * tile_g + g] = sf_frag[i, g]
                if pn == 0:
                    for i, x in T.Parallel(tile_m, meta_width):
                        if dest_MW[i, w] >= 0:
                            meta_F[deltas[w] // 4 + T.Cast("int64", dest_MW[i, w]) * meta_width + x] = meta_MX[i, x]
            if pid == 0:
                for w in T.Parallel(world):
                    counts_F[delta_W[w] // 4 + rank] = count_W[w]

    return put_tokens


def put_tokens(x_TD: torch.Tensor, dest_TW: torch.Tensor, meta_TX: torch.Tensor, count_W: torch.Tensor,
               regions: TokenRegions, *, rank: int, group: int = 128) -> None:
    """The TileLang twin of :func:`kernels.comm.reference.put_tokens` (same bytes in every region).
    The regions must lie in one symmetric heap (one ``delta_W``)."""
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, ndim=2)
    check_cuda("x_TD", x_TD)
    if not supports_block((1, group)):
        raise ValueError(f"group: expected a power of two from 2 to 1024, got {group}")
    t, d = x_TD.shape
    world = regions.counts.world
    check_tensor("dest_TW", dest_TW, dtype=torch.int32, shape=(t, world), device=x_TD.device)
    check_tensor("meta_TX", meta_TX, dtype=torch.int32, ndim=2, device=x_TD.device)
    check_tensor("count_W", count_W, dtype=torch.int32, shape=(world,), device=x_TD.device)
    if meta_TX.shape[0] != t:
        raise ValueError(f"meta_TX: expected {t} rows, got shape {tuple(meta_TX.shape)}")
    q = peer_copy(regions.q, "regions.q", dtype=torch.uint8, width=d)
    sf = peer_copy(regions.sf, "regions.sf", dtype=torch.float32, width=-(-d // group))
    meta = peer_copy(regions.meta, "regions.meta", dtype=torch.int32, width=meta_TX.shape[1])
    counts = peer_copy(regions.counts, "regions.counts", dtype=torch.int32, width=1)
    kernel = get_put_tokens_kernel(d, tl_dtype(x_TD.dtype), group, world, meta_TX.shape[1])
    vec = vector_width(d, x_TD.element_size())
    kernel(x_TD.contiguous(), dest_TW.contiguous(), regions.q.delta_W, meta_TX.contiguous(), count_W,
           q.view(E4M3).view(-1, vec), sf.view(-1), meta.view(-1), counts.view(-1), rank)
