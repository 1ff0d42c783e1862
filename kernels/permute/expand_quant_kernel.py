"""Expand fused with the per-token FP8 cast: gathers each token into its rows of the expert-major
layout and casts them to e4m3 in one pass (see
:func:`kernels.quant.reference.expand_per_token_cast` for the function).

A CTA covers ``[tile_m, tile_n]`` of the layout (whole scale groups, tiles as in
:mod:`kernels.quant.blockwise_cast_kernel`): each row looks up its route in ``src_P``, loads its
token's columns with 16-byte vectors (padding rows load nothing and become zeros with the floor
scale), reduces each group's amax and stores the e4m3 bytes and the scales per layout row, as the
receiver's grouped GEMM reads them. Each token is read once per route and never written back in
bf16, which is what the fusion saves over ``expand`` then ``per_token_cast``.

Shape suffixes: T tokens, K routes per token, P layout rows, D hidden, G scale groups.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.permute.reference import ExpertLayout
from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.quant.tiles import (
    PASS_CONFIGS,
    blockwise_tile,
    check_cuda,
    scale_and_inverse,
    supports_block,
    tl_dtype,
    to_e4m3,
    vector_layout,
    vector_width,
)
from kernels.validate import check_positive, check_tensor


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_expand_per_token_cast_kernel(hidden: int, topk: int, dtype: str, group: int, round_sf: bool, pack_sf: bool):
    """``(x_TD, src_P, q_PD, sf_PG)`` kernel: row p of the outputs is token ``src_P[p] // topk``
    cast to e4m3 with one scale per ``group`` columns (zeros and the floor scale where -1)."""
    num_tokens, num_rows = T.dynamic("num_tokens"), T.dynamic("num_rows")
    vec = vector_width(hidden, T.dtype(dtype).bytes)
    tile_m, tile_n, threads = blockwise_tile(hidden, (1, group), vec)
    tile_g = tile_n // group
    sf_dtype = "uint8" if pack_sf else "float32"

    @T.prim_func
    def expand_per_token_cast(
        x_TD: T.Tensor[(num_tokens, hidden), dtype],
        src_P: T.Tensor[(num_rows,), "int32"],
        q_PD: T.Tensor[(num_rows, hidden), "float8_e4m3fn"],
        sf_PG: T.Tensor[(num_rows, T.ceildiv(hidden, group)), sf_dtype],
    ):
        with T.Kernel(T.ceildiv(num_rows, tile_m), T.ceildiv(hidden, tile_n), threads=threads) as (pm, pn):
            x_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            amax = T.alloc_fragment((tile_m, tile_g), dtype)
            inv_frag = T.alloc_fragment((tile_m, tile_g), "float32")
            T.annotate_layout({x_frag: vector_layout(tile_m, tile_n, threads, vec)})
            for i, j in T.Parallel(tile_m, tile_n):
                src = src_P[pm * tile_m + i]
                x_frag[i, j] = T.if_then_else(src >= 0, x_TD[src // topk, pn * tile_n + j], T.cast(0, dtype))
            T.reduce_absmax(T.reshape(x_frag, [tile_m, tile_g, group]), amax, dim=2)
            for i, g in T.Parallel(tile_m, tile_g):
                sf, inv = scale_and_inverse(T.cast(amax[i, g], "float32"), round_sf, pack_sf)
                sf_PG[pm * tile_m + i, pn * tile_g + g] = sf
                inv_frag[i, g] = inv
            for i, j in T.Parallel(tile_m, tile_n):
                q_PD[pm * tile_m + i, pn * tile_n + j] = to_e4m3(
                    T.cast(x_frag[i, j], "float32") * inv_frag[i, j // group]
                )

    return expand_per_token_cast


def expand_per_token_cast(
    x_TD: torch.Tensor, layout: ExpertLayout, *, group: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of :func:`kernels.quant.reference.expand_per_token_cast` (same arguments,
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
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout: expected an ExpertLayout, got {type(layout).__name__}")
    num_tokens, topk = layout.pos_TK.shape
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, shape=(num_tokens, None), device=layout.src_P.device)
    check_cuda("x_TD", x_TD)
    check_positive("group", group)
    if not supports_block((1, group)):
        raise ValueError(f"group: expected a power of two from 2 to 1024, got {group}")
    if pack_sf and not round_sf:
        raise ValueError("pack_sf: expected round_sf=True (only power-of-two scales pack), got round_sf=False")
    p, d = layout.num_rows, x_TD.shape[1]
    q_PD = torch.empty((p, d), dtype=E4M3, device=x_TD.device)
    sf_PG = torch.empty((p, -(-d // group)), dtype=torch.uint8 if pack_sf else torch.float32, device=x_TD.device)
    if p == 0 or d == 0:
        return q_PD, sf_PG
    kernel = get_expand_per_token_cast_kernel(d, topk, tl_dtype(x_TD.dtype), group, round_sf, pack_sf)
    kernel(x_TD.contiguous(), layout.src_P.contiguous(), q_PD, sf_PG)
    return q_PD, sf_PG
