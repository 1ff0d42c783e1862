"""FP8 dequantization kernel: ``cast_back`` of any blockwise cast (see
:mod:`kernels.quant.reference`).

A CTA covers the same ``[tile_m, tile_n]`` tile of whole scale blocks as the cast
(:func:`kernels.tiles.blockwise_tile`), takes each vector's scale (straight from global memory
for per-token scales, else from the tile's scales staged in shared memory), and turns each thread's
e4m3 bytes into ``q.float() * sf`` in ``out_dtype`` with 16-byte output vectors.

Shape suffixes: M rows, N columns, B/G scale row blocks/columns.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.cache_hints import hinted_load
from kernels.quant.reference import E4M3, FLOAT_DTYPES, SCALE_DTYPES
from kernels.tiles import (
    PASS_CONFIGS,
    check_cuda,
    blockwise_tile,
    row_major,
    supports_block,
    tl_dtype,
    unpack_scale,
    vector_layout,
    vector_width,
)
from kernels.validate import check_dtype, check_tensor


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_cast_back_kernel(num_cols: int, block_m: int, block_n: int, packed: bool, out_dtype: str,
                         tile: tuple[int, int, int] | None = None, staged: bool | None = None,
                         scales_in_l2: bool = True):
    """``(q_MN, sf_BG, out_MN)`` kernel: ``out = q.float() * sf`` per ``block_m x block_n`` block
    (``tile`` as in :func:`kernels.quant.blockwise_cast_kernel.get_blockwise_cast_kernel`). With
    one-row blocks at least a vector wide (per-token scales), each thread reads its vector's one
    scale from global memory; other blocks stage the tile's scales in shared memory first (``staged``
    overrides, for the sweep). Per-token at 16384 x 7168 on an H100: 119.7 us read directly, 121.7
    staged with 16-row tiles, the best staged tile.
    ``scales_in_l2``: directly read scales are loaded under an L2 policy of evict_last, as
    torch.compile's kernel loads them (:mod:`kernels.cache_hints`), where the tiles are whole rows
    and cover the columns exactly: 116.03 against 117.0 us plain, torch.compile 116.02, at 16384 x
    7168 on an H100 (paired by GPU time); False for plain loads (the sweep)."""
    num_rows = T.dynamic("num_rows")
    # Vectors sized by the output (8 values for bfloat16: 8-byte e4m3 loads, 16-byte stores), so a
    # warp's store covers one contiguous 512 bytes. 16 e4m3 values a thread would make each 16-byte
    # store cover every other 16 bytes of a 1 KiB run (lane stride 32 bytes): twice the sectors,
    # each half written, on the 2/3 of the traffic that is stores: 219 us vs 134 (docs/design/quant.md).
    vec = vector_width(num_cols, T.dtype(out_dtype).bytes)
    tile_m, tile_n, threads = tile or blockwise_tile(num_cols, (block_m, block_n), vec)
    tile_gm, tile_gn = tile_m // block_m, tile_n // block_n
    sf_dtype = "uint8" if packed else "float32"
    if staged is None:
        staged = block_m != 1 or block_n < vec
    # only where every tile is whole (no guard: the scale's index is in range by construction)
    scales_in_l2 = scales_in_l2 and not staged and tile_m == 1 and num_cols % tile_n == 0
    scale_load, scale_source = hinted_load(1 if packed else 4, keep_in_l2=True)
    num_groups = -(-num_cols // block_n)

    def scale_kept_in_l2(sf_BG, row, group):
        """``sf_BG[row, group]`` loaded under an L2 policy of evict_last, as float32."""
        index = T.Cast("int64", row) * num_groups + group
        bits = T.call_extern("uint8" if packed else "uint32", scale_load + "_at", sf_BG.data, index)
        return unpack_scale(bits, True) if packed else T.reinterpret(bits, "float32")

    @T.prim_func
    def cast_back(
        q_MN: T.Tensor[(num_rows, num_cols), "float8_e4m3fn"],
        sf_BG: T.Tensor[(T.ceildiv(num_rows, block_m), T.ceildiv(num_cols, block_n)), sf_dtype],
        out_MN: T.Tensor[(num_rows, num_cols), out_dtype],
    ):
        tiles_n = T.ceildiv(num_cols, tile_n)
        with T.Kernel(T.ceildiv(num_rows, tile_m) * tiles_n, threads=threads) as pid:
            if scales_in_l2:
                T.import_source(scale_source)
            pm, pn = row_major(pid, tiles_n)
            q_frag = T.alloc_fragment((tile_m, tile_n), "float8_e4m3fn")
            T.annotate_layout({q_frag: vector_layout(tile_m, tile_n, threads, vec)})
            if staged:
                sf_shared = T.alloc_shared((tile_gm, tile_gn), "float32")
                for i, g in T.Parallel(tile_gm, tile_gn):
                    sf_shared[i, g] = unpack_scale(sf_BG[pm * tile_gm + i, pn * tile_gn + g], packed)
            T.copy(q_MN[pm * tile_m, pn * tile_n], q_frag, disable_tma=True)
            for i, j in T.Parallel(tile_m, tile_n):
                if staged:
                    sf = sf_shared[i // block_m, j // block_n]
                elif scales_in_l2:
                    sf = scale_kept_in_l2(sf_BG, pm * tile_gm + i // block_m, pn * tile_gn + j // block_n)
                else:
                    sf = unpack_scale(sf_BG[pm * tile_gm + i // block_m, pn * tile_gn + j // block_n], packed)
                out_MN[pm * tile_m + i, pn * tile_n + j] = T.cast(T.cast(q_frag[i, j], "float32") * sf, out_dtype)

    return cast_back


def cast_back(
    q: torch.Tensor, sf: torch.Tensor, *, block: tuple[int, int], out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.quant.reference.cast_back` (same arguments and result).

    Args:
        q: ``[M, N]`` float8_e4m3fn on a CUDA device (inputs are copied first if not contiguous).
        sf: ``[ceil(M / block[0]), ceil(N / block[1])]`` float32 or uint8 exponents.
        block: ``(rows, cols)`` per scale, powers of two (not both 1).
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    check_tensor("q", q, dtype=E4M3, ndim=2)
    check_cuda("q", q)
    if not supports_block(block):
        raise ValueError(f"block: expected two powers of two up to 1024, not both 1, got {block!r}")
    block_m, block_n = block
    m, n = q.shape
    check_tensor("sf", sf, dtype=SCALE_DTYPES, shape=(-(-m // block_m), -(-n // block_n)), device=q.device)
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0 or n == 0:
        return out
    kernel = get_cast_back_kernel(n, block_m, block_n, sf.dtype == torch.uint8, tl_dtype(out_dtype))
    kernel(q.contiguous(), sf.contiguous(), out)
    return out
