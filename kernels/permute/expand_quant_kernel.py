"""Expand fused with the per-token FP8 cast: scatters each token, cast to e4m3 once, into its rows
of the expert-major layout (see :func:`kernels.permute.reference.expand_per_token_cast` for the
function).

A scatter from the tokens, like :mod:`kernels.permute.expand_kernel`, not a gather into the layout:
a token CTA loads ``[tile_m, tile_n]`` of ``x_TD`` (whole scale groups, tiles as in
:mod:`kernels.quant.blockwise_cast_kernel`) with 16-byte vectors, reduces each group's amax, casts
to e4m3 in registers once, and stores the bytes and the scales to each of its tokens' K rows
(``pos_TK``, staged in shared memory). Every input byte is read once; a gather by ``src_P`` reads
each token K times (the token matrix does not fit in L2). Padding rows (``src_P == -1``) are
written by the grid's first CTAs, ``PAD_ROWS`` rows each: zero bytes and the floor scale (the cast
of a zero row). This relies on ``pos_TK`` and ``src_P`` being each other's inverse, as in every
:class:`ExpertLayout` from ``expert_layout``; values are not checked on the host (no host sync):
rows outside ``[0, P)`` are treated as -1.

Shape suffixes: T tokens, K routes per token, P layout rows, D hidden, G scale groups,
M tile rows, N tile columns.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.permute.reference import ExpertLayout
from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.tiles import (
    PASS_CONFIGS,
    as_int32,
    blockwise_tile,
    cast_per_token,
    check_cuda,
    row_major,
    scale_and_inverse,
    supports_block,
    tl_dtype,
    vector_layout,
    vector_width,
)
from kernels.validate import check_positive, check_tensor

PAD_ROWS = 64  # layout rows a padding CTA checks (and zeroes where src_P is -1)


def check_token_rows(name: str, rows_TD: torch.Tensor, layout: ExpertLayout, *, dtype, group: int) -> int:
    """The checks of a fused expand's arguments: ``layout`` an :class:`ExpertLayout`, ``rows_TD``
    one CUDA row of ``dtype`` per token of it, ``group`` a power of two from 2 to 1024. Returns K."""
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout: expected an ExpertLayout, got {type(layout).__name__}")
    num_tokens, topk = layout.pos_TK.shape
    check_tensor(name, rows_TD, dtype=dtype, shape=(num_tokens, None), device=layout.src_P.device)
    check_cuda(name, rows_TD)
    check_positive("group", group)
    if not supports_block((1, group)):
        raise ValueError(f"group: expected a power of two from 2 to 1024, got {group}")
    return topk


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_expand_per_token_cast_kernel(hidden: int, topk: int, dtype: str, group: int, round_sf: bool, pack_sf: bool,
                                     tile: tuple[int, int, int] | None = None, vec: int | None = None):
    """``(x_TD, pos_TK, src_P, q_PD, sf_PG)`` kernel: token t cast to e4m3 with one scale per
    ``group`` columns, stored to rows ``pos_TK[t, :]`` (zeros and the floor scale where ``src_P``
    is -1). ``tile`` and ``vec`` override the tile and the elements a thread holds (sweeps)."""
    num_tokens, num_rows = T.dynamic("num_tokens"), T.dynamic("num_rows")
    vec = vec or vector_width(hidden, T.dtype(dtype).bytes)
    tile_m, tile_n, threads = tile or blockwise_tile(hidden, (1, group), vec)
    tile_g = tile_n // group
    layout = vector_layout(tile_m, tile_n, threads, vec)
    sf_dtype = "uint8" if pack_sf else "float32"

    @T.prim_func
    def expand_per_token_cast(
        x_TD: T.Tensor[(num_tokens, hidden), dtype],
        pos_TK: T.Tensor[(num_tokens, topk), "int32"],
        src_P: T.Tensor[(num_rows,), "int32"],
        q_PD: T.Tensor[(num_rows, hidden), "float8_e4m3fn"],
        sf_PG: T.Tensor[(num_rows, T.ceildiv(hidden, group)), sf_dtype],
    ):
        pad_blocks = T.ceildiv(num_rows, PAD_ROWS)
        tiles_n = T.ceildiv(hidden, tile_n)
        with T.Kernel((pad_blocks + T.ceildiv(num_tokens, tile_m)) * tiles_n, threads=threads) as pid:
            bm, pn = row_major(pid, tiles_n)
            x_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            q_frag = T.alloc_fragment((tile_m, tile_n), "float8_e4m3fn")
            amax = T.alloc_fragment((tile_m, tile_g), dtype)
            inv_frag = T.alloc_fragment((tile_m, tile_g), "float32")
            sf_frag = T.alloc_fragment((tile_m, tile_g), sf_dtype)
            pos_MK = T.alloc_shared((tile_m, topk), "int32")
            pad_M = T.alloc_shared((PAD_ROWS,), "int32")  # 1 = a padding row of this CTA
            T.annotate_layout({x_frag: layout, q_frag: layout})
            if bm < pad_blocks:
                for r in T.Parallel(PAD_ROWS):
                    row = bm * PAD_ROWS + r
                    pad_M[r] = T.if_then_else(row < num_rows, T.if_then_else(src_P[row] < 0, 1, 0), 0)
                for r, j in T.Parallel(PAD_ROWS, tile_n):
                    if pad_M[r] == 1:
                        q_PD[bm * PAD_ROWS + r, pn * tile_n + j] = T.cast(0, "float8_e4m3fn")
                for r, g in T.Parallel(PAD_ROWS, tile_g):
                    if pad_M[r] == 1:
                        sf, _ = scale_and_inverse(T.float32(0), round_sf, pack_sf)
                        sf_PG[bm * PAD_ROWS + r, pn * tile_g + g] = sf
            else:
                tm = bm - pad_blocks
                for i, k in T.Parallel(tile_m, topk):
                    token = tm * tile_m + i
                    row = T.if_then_else(token < num_tokens, pos_TK[token, k], -1)
                    pos_MK[i, k] = T.if_then_else(row < num_rows, row, -1)
                T.copy(x_TD[tm * tile_m, pn * tile_n], x_frag, disable_tma=True)
                cast_per_token(x_frag, amax, sf_frag, inv_frag, q_frag, group, round_sf, pack_sf)
                for k in T.unroll(topk):
                    for i, j in T.Parallel(tile_m, tile_n):
                        if pos_MK[i, k] >= 0:
                            q_PD[pos_MK[i, k], pn * tile_n + j] = q_frag[i, j]
                    for i, g in T.Parallel(tile_m, tile_g):
                        if pos_MK[i, k] >= 0:
                            sf_PG[pos_MK[i, k], pn * tile_g + g] = sf_frag[i, g]

    return expand_per_token_cast


def expand_per_token_cast(
    x_TD: torch.Tensor, layout: ExpertLayout, *, group: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of :func:`kernels.permute.reference.expand_per_token_cast` (same arguments,
    same bytes).

    Args:
        x_TD: ``[T, D]`` float32, bfloat16 or float16 on the layout's CUDA device (copied first if
            not contiguous).
        layout: the :class:`ExpertLayout` of this batch's routes.
        group: columns per scale, a power of two from 2 to 1024.
        round_sf, pack_sf: as in :func:`kernels.quant.reference.per_token_cast`.

    Returns:
        ``q_PD`` ``[P, D]`` float8_e4m3fn and ``sf_PG`` ``[P, ceil(D / group)]`` float32 (uint8
        exponents when ``pack_sf``).
    """
    topk = check_token_rows("x_TD", x_TD, layout, dtype=FLOAT_DTYPES, group=group)
    if pack_sf and not round_sf:
        raise ValueError("pack_sf: expected round_sf=True (only power-of-two scales pack), got round_sf=False")
    p, d = layout.num_rows, x_TD.shape[1]
    q_PD = torch.empty((p, d), dtype=E4M3, device=x_TD.device)
    sf_PG = torch.empty((p, -(-d // group)), dtype=torch.uint8 if pack_sf else torch.float32, device=x_TD.device)
    if p == 0 or d == 0:
        return q_PD, sf_PG
    kernel = get_expand_per_token_cast_kernel(d, topk, tl_dtype(x_TD.dtype), group, round_sf, pack_sf)
    kernel(x_TD.contiguous(), as_int32(layout.pos_TK), as_int32(layout.src_P), q_PD, sf_PG)
    return q_PD, sf_PG
