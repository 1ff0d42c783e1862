"""Expand fused with the FP8 cast back: e4m3 rows with per-token scales (as a dispatch receives
them) dequantized straight into their rows of the expert-major layout (see
:func:`kernels.permute.reference.expand_cast_back` for the function).

A scatter from the rows, like :mod:`kernels.permute.expand_quant_kernel`: a CTA stages its rows'
layout positions (``pos_TK``) in shared memory; if none of its rows has a route it stops there (a
receive buffer's unused rows cost no reads), else it loads ``[tile_m, tile_n]`` of ``q_TD``
(:func:`row_tile`; 8-byte e4m3 loads for 16-byte bf16 stores, as in
:mod:`kernels.quant.cast_back_kernel`), multiplies by each vector's scale in float32 once, and
stores the result to each of its rows' K layout rows. Against ``cast_back`` then ``expand``, this
never writes or re-reads the [T, D] rows in ``out_dtype``, and reads only the rows in use.

Padding rows (``src_P == -1``) inside the segments are zeroed by the grid's first CTAs,
``PAD_ROWS`` whole rows each (whole rows, not a tile's columns of more rows: 67.5 us for
expand's whole rows against 73.0 for 64 rows of a tile's 1024 columns, 128 tokens at alignment
128 on an H100, where padding is nearly all of the layout); rows past the last segment (``offsets_E[-1]``) are left unwritten, as in
``expand``. This relies on ``pos_TK`` and ``src_P`` being each other's inverse, as in every
:class:`ExpertLayout` from ``expert_layout``; values are not checked on the host (no host sync):
rows outside ``[0, P)`` are treated as -1.

Shape suffixes: T rows in (tokens), K routes per row, P layout rows, D hidden, G scale groups,
E experts, M tile rows, N tile columns.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.pdl import chained
from kernels.permute import expand_quant_kernel
from kernels.permute.reference import ExpertLayout
from kernels.quant.reference import E4M3, FLOAT_DTYPES, SCALE_DTYPES
from kernels.tiles import (
    PASS_CONFIGS,
    as_int32,
    blockwise_tile,
    row_major,
    tl_dtype,
    unpack_scale,
    vector_layout,
    vector_width,
)
from kernels.validate import check_dtype, check_tensor

PAD_ROWS = 16  # layout rows a padding CTA checks (and zeroes where src_P is -1), whole rows each


def row_tile(hidden: int, group: int, vec: int) -> tuple[int, int, int]:
    """``(tile_m, tile_n, threads)``: one whole row a CTA when rows are wider than 1024 elements
    (each thread's loads all in flight before its K stores, as in ``expand_kernel``: 813.6 us for
    tiles of 1024 columns at 16384 x 7168 on an H100, against expand's 835.0 with whole rows and
    twice the bytes read), else the cast's tile of whole scale groups."""
    if hidden <= 1024:
        return blockwise_tile(hidden, (1, group), vec)
    threads = 128
    return 1, -(-hidden // (threads * vec)) * threads * vec, threads


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_expand_cast_back_kernel(hidden: int, topk: int, group: int, packed: bool, out_dtype: str):
    """``(q_TD, sf_TG, pos_TK, src_P, offsets_E, x_PD)`` kernel: row t's e4m3 values times its
    scale per ``group`` columns (uint8 exponents when ``packed``), in ``out_dtype``, stored to rows
    ``pos_TK[t, :]``; zeros where ``src_P`` is -1 before ``offsets_E[-1]``."""
    num_tokens, num_rows, num_experts = T.dynamic("num_tokens"), T.dynamic("num_rows"), T.dynamic("num_experts")
    vec = vector_width(hidden, T.dtype(out_dtype).bytes)  # sized by the output, as in cast_back
    tile_m, tile_n, threads = row_tile(hidden, group, vec)
    sf_dtype = "uint8" if packed else "float32"

    @T.prim_func
    def expand_cast_back(
        q_TD: T.Tensor[(num_tokens, hidden), "float8_e4m3fn"],
        sf_TG: T.Tensor[(num_tokens, T.ceildiv(hidden, group)), sf_dtype],
        pos_TK: T.Tensor[(num_tokens, topk), "int32"],
        src_P: T.Tensor[(num_rows,), "int32"],
        offsets_E: T.Tensor[(num_experts,), "int32"],
        x_PD: T.Tensor[(num_rows, hidden), out_dtype],
    ):
        pad_blocks = T.ceildiv(num_rows, PAD_ROWS)
        tiles_n = T.ceildiv(hidden, tile_n)
        with T.Kernel(pad_blocks + T.ceildiv(num_tokens, tile_m) * tiles_n, threads=threads) as pid:
            chained()
            tm, pn = row_major(pid - pad_blocks, tiles_n)
            q_frag = T.alloc_fragment((tile_m, tile_n), "float8_e4m3fn")
            x_frag = T.alloc_fragment((tile_m, tile_n), out_dtype)
            pos_MK = T.alloc_shared((tile_m, topk), "int32")
            routed = T.alloc_shared((1,), "int32")  # 1 once any of the tile's rows has a route
            pad_M = T.alloc_shared((PAD_ROWS,), "int32")  # 1 = a padding row of this CTA
            layout = vector_layout(tile_m, tile_n, threads, vec)
            T.annotate_layout({q_frag: layout, x_frag: layout})
            if pid < pad_blocks:
                used = offsets_E[num_experts - 1]
                for r in T.Parallel(PAD_ROWS):
                    row = pid * PAD_ROWS + r
                    pad_M[r] = T.if_then_else(row < used, T.if_then_else(src_P[row] < 0, 1, 0), 0)
                for r, j in T.Parallel(PAD_ROWS, hidden):  # whole rows: consecutive bytes
                    if pad_M[r] == 1:
                        x_PD[pid * PAD_ROWS + r, j] = T.cast(0, out_dtype)
            else:
                routed[0] = 0
                for i, k in T.Parallel(tile_m, topk):
                    token = tm * tile_m + i
                    row = T.if_then_else(token < num_tokens, pos_TK[token, k], -1)
                    pos_MK[i, k] = T.if_then_else(row < num_rows, row, -1)
                for i, k in T.Parallel(tile_m, topk):
                    if pos_MK[i, k] >= 0:
                        routed[0] = 1  # every writer stores the same value
                if routed[0] == 1:
                    T.copy(q_TD[tm * tile_m, pn * tile_n], q_frag, disable_tma=True)
                    for i, j in T.Parallel(tile_m, tile_n):
                        sf = unpack_scale(sf_TG[tm * tile_m + i, (pn * tile_n + j) // group], packed)
                        x_frag[i, j] = T.cast(T.cast(q_frag[i, j], "float32") * sf, out_dtype)
                    for k in T.unroll(topk):
                        for i, j in T.Parallel(tile_m, tile_n):
                            if pos_MK[i, k] >= 0:
                                x_PD[pos_MK[i, k], pn * tile_n + j] = x_frag[i, j]

    return expand_cast_back


def expand_cast_back(
    q_TD: torch.Tensor, sf_TG: torch.Tensor, layout: ExpertLayout, *, group: int = 128,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.permute.reference.expand_cast_back` (same arguments, same
    bits in every row up to ``offsets_E[-1]``).

    Args:
        q_TD: ``[T, D]`` float8_e4m3fn on the layout's CUDA device (copied first if not contiguous).
        sf_TG: ``[T, ceil(D / group)]`` float32, or uint8 exponents.
        layout: the :class:`ExpertLayout` of the rows' routes.
        group: columns per scale, a power of two from 2 to 1024.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``x_PD`` ``[P, D]`` in ``out_dtype``, unwritten past ``offsets_E[-1]``.
    """
    topk = expand_quant_kernel.check_token_rows("q_TD", q_TD, layout, dtype=E4M3, group=group)
    num_tokens, d = q_TD.shape
    check_tensor("sf_TG", sf_TG, dtype=SCALE_DTYPES, shape=(num_tokens, -(-d // group)), device=q_TD.device)
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    p = layout.num_rows
    x_PD = torch.empty((p, d), dtype=out_dtype, device=q_TD.device)
    if p == 0 or d == 0:
        return x_PD
    if num_tokens == 0:  # every row is padding
        return x_PD.zero_()
    kernel = get_expand_cast_back_kernel(d, topk, group, sf_TG.dtype == torch.uint8, tl_dtype(out_dtype))
    kernel(q_TD.contiguous(), sf_TG.contiguous(), as_int32(layout.pos_TK),
           as_int32(layout.src_P), as_int32(layout.offsets_E), x_PD)
    return x_PD
