"""The FP8 requantization kernel behind ``requant`` and ``per_block_cast_lossless`` (see
:mod:`kernels.quant.reference` for the functions).

A CTA covers the tile the blockwise cast takes for the out-scales (whole out-blocks,
:func:`kernels.tiles.blockwise_tile`), loads the e4m3 bytes as 16-byte vectors, stages the
in-scales the tile spans in shared memory, and casts to the out-blocks with the blockwise cast's own
reduction and rounding (:func:`kernels.quant.blockwise_cast_kernel.tile_caster`), which dequantizes
each value as it casts it (one float32 product an element, as ``cast_back`` to float32). Only the
bytes stay in registers across the reduction. Each block's amax comes from the bytes too: the
largest float16 magnitude of each run of a thread's values that share an in-scale, times that scale
(exact: rounding a product by a positive scale is monotone, so that is the largest product). The
lossless cast's amax needs the in-scales alone. The float32 tensor of the reference never exists
in memory: 1 byte an element in, 1 out, plus the scales.

Shape suffixes: M rows, N columns; B/G scale row blocks/columns (``_in`` / ``_out`` for the sides).
"""

import tilelang
import torch
from tilelang import language as T

from kernels.quant.blockwise_cast_kernel import tile_caster
from kernels.quant.reference import E4M3, E4M3_MAX, SCALE_DTYPES
from kernels.tiles import (
    PASS_CONFIGS,
    blockwise_tile,
    check_cuda,
    row_major,
    supports_block,
    unpack_scale,
    vector_layout,
    vector_width,
)
from kernels.validate import check_tensor


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_requant_kernel(num_cols: int, in_block: tuple[int, int], out_block: tuple[int, int], in_packed: bool,
                       round_sf: bool, pack_sf: bool, lossless: bool = False):
    """``(q_in_MN, sf_in_BG, q_MN, sf_BG)`` kernel: e4m3 data with scales over ``in_block``
    (uint8 exponents when ``in_packed``) re-cast with scales over ``out_block`` (powers of two).
    ``lossless``: the scales follow ``448 * in-scale`` instead of the values' magnitudes
    (:func:`kernels.quant.reference.per_block_cast_lossless`; pass ``round_sf``)."""
    num_rows = T.dynamic("num_rows")
    in_m, in_n = in_block
    out_m, out_n = out_block
    vec = vector_width(num_cols, 1)
    tile_m, tile_n, threads = blockwise_tile(num_cols, out_block, vec)
    # The in-scales a tile spans: one an in-block, or one for a tile inside an in-block (sides
    # are powers of two, so either divides the other).
    span_m, span_n = min(in_m, tile_m), min(in_n, tile_n)
    cast_tile = tile_caster(out_block, (tile_m, tile_n, threads), vec, "float32", round_sf, pack_sf, (span_m, span_n))
    layout = vector_layout(tile_m, tile_n, threads, vec)
    group = min(vec, span_n, out_n)  # a run of a thread's values under one in-scale and one out-scale

    @T.prim_func
    def requant(
        q_in_MN: T.Tensor[(num_rows, num_cols), T.float8_e4m3fn],
        sf_in_BG: T.Tensor[(T.ceildiv(num_rows, in_m), T.ceildiv(num_cols, in_n)), T.uint8 if in_packed else T.float32],
        q_MN: T.Tensor[(num_rows, num_cols), T.float8_e4m3fn],
        sf_BG: T.Tensor[(T.ceildiv(num_rows, out_m), T.ceildiv(num_cols, out_n)), T.uint8 if pack_sf else T.float32],
    ):
        tiles_n = T.ceildiv(num_cols, tile_n)
        with T.Kernel(T.ceildiv(num_rows, tile_m) * tiles_n, threads=threads) as pid:
            pm, pn = row_major(pid, tiles_n)
            # An in-scale past the array is zero. One inside covers the first element of its span
            # in the tile, which lies in the array: past a ragged edge an element (its byte loads as
            # zero) shares its in-scale with an element of the same out-block inside the array, so
            # the lossless amax (448 times the in-scales) of every block stays the reference's.
            sf_S = T.alloc_shared((tile_m // span_m, tile_n // span_n), T.float32)
            q_frag = T.alloc_fragment((tile_m, tile_n), T.float8_e4m3fn)
            abs_frag = T.alloc_fragment((tile_m, tile_n), T.float32)
            T.annotate_layout({q_frag: layout, abs_frag: layout})
            # The bytes' loads first (past a ragged edge they load as zero): they go out before the
            # barrier that publishes the in-scales, not a load latency after it.
            T.copy(q_in_MN[pm * tile_m, pn * tile_n], q_frag, disable_tma=True)
            for a, b in T.Parallel(tile_m // span_m, tile_n // span_n):
                row, col = (pm * tile_m + a * span_m) // in_m, (pn * tile_n + b * span_n) // in_n
                sf_S[a, b] = T.if_then_else(
                    T.And(row < T.ceildiv(num_rows, in_m), col < T.ceildiv(num_cols, in_n)),
                    unpack_scale(sf_in_BG[row, col], in_packed),
                    T.float32(0),
                )
            # The magnitudes the out-scales follow, each that of an element in the array (or zero),
            # so each block's amax is the reference's: a run's largest |q| (exact in float16, one
            # 3-way max per two pairs) times its in-scale, or 448 times the in-scale (lossless).
            if not lossless:
                mag_frag = T.alloc_fragment((tile_m, tile_n), T.float16)
                T.annotate_layout({mag_frag: layout})
                for i, j in T.Parallel(tile_m, tile_n):
                    mag_frag[i, j] = T.abs(T.cast(q_frag[i, j], T.float16))
                group_amax = T.alloc_fragment((tile_m, tile_n // group), T.float16)
                T.reduce_max(T.reshape(mag_frag, [tile_m, tile_n // group, group]), group_amax, dim=2)
            for i, j in T.Parallel(tile_m, tile_n):
                sf = sf_S[i // span_m, j // span_n]
                if lossless:
                    abs_frag[i, j] = T.abs(sf) * T.float32(E4M3_MAX)
                else:
                    abs_frag[i, j] = T.cast(group_amax[i, j // group], T.float32) * T.abs(sf)
            cast_tile(q_frag, abs_frag, q_MN, sf_BG, pm, pn, sf_S)

    return requant


def requant(
    q: torch.Tensor,
    sf: torch.Tensor,
    *,
    in_block: tuple[int, int],
    out_block: tuple[int, int],
    round_sf: bool,
    pack_sf: bool,
    lossless: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of :func:`kernels.quant.reference.requant` (and, with ``lossless``, of
    :func:`kernels.quant.reference.per_block_cast_lossless`, ``round_sf`` then True).

    Args:
        q: ``[M, N]`` float8_e4m3fn on a CUDA device (inputs are copied first if not contiguous).
        sf: ``[ceil(M / in_block[0]), ceil(N / in_block[1])]`` float32, or uint8 exponents.
        in_block, out_block: ``(rows, cols)`` per scale, powers of two (not both 1).
        round_sf, pack_sf: as in :func:`kernels.quant.reference.per_token_cast`.
        lossless: out-scales from the in-scales (see above).

    Returns:
        ``q_MN`` ``[M, N]`` float8_e4m3fn and ``sf_BG`` ``[ceil(M / out_block[0]), ceil(N /
        out_block[1])]`` float32 (uint8 exponents when ``pack_sf``).
    """
    check_tensor("q", q, dtype=E4M3, ndim=2)
    check_cuda("q", q)
    for name, block in (("in_block", in_block), ("out_block", out_block)):
        if not (isinstance(block, tuple) and len(block) == 2 and all(type(b) is int for b in block)
                and supports_block(block)):
            raise ValueError(f"{name}: expected two powers of two up to 1024, not both 1, got {block!r}")
    if pack_sf and not round_sf:
        raise ValueError("pack_sf: expected round_sf=True (only power-of-two scales pack), got round_sf=False")
    m, n = q.shape
    check_tensor("sf", sf, dtype=SCALE_DTYPES, shape=(-(-m // in_block[0]), -(-n // in_block[1])), device=q.device)
    q_MN = torch.empty((m, n), dtype=E4M3, device=q.device)
    sf_BG = torch.empty(
        (-(-m // out_block[0]), -(-n // out_block[1])), dtype=torch.uint8 if pack_sf else torch.float32, device=q.device
    )
    if m == 0 or n == 0:
        return q_MN, sf_BG
    kernel = get_requant_kernel(n, in_block, out_block, sf.dtype == torch.uint8, round_sf, pack_sf, lossless)
    kernel(q.contiguous(), sf.contiguous(), q_MN, sf_BG)
    return q_MN, sf_BG
