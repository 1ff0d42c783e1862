"""The FP8 blockwise cast kernel behind ``per_token_cast``, ``per_block_cast`` and
``per_channel_cast`` (one factory, specialised on the block shape; see
:mod:`kernels.quant.reference` for the function it computes).

A CTA loads a ``[tile_m, tile_n]`` tile of whole scale blocks into registers with 16-byte vectors
(:func:`kernels.tiles.vector_layout`), reduces each block's amax (across threads by warp
shuffles, or one ``redux.sync`` a warp for a per-block tile; across warps through shared memory),
writes the scales, and stores the e4m3 bytes
straight from the registers (a per-channel tile of 2-byte values waits out the reduction in shared
memory instead: :func:`staged_channel_ctas`). Every input byte is read once and every output byte
written once.

Shape suffixes: M rows (tokens), N columns (hidden), G scale groups (``ceil(N / block_n)``),
B scale row blocks (``ceil(M / block_m)``).
"""


import tilelang
import torch
from tilelang import language as T

from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.tiles import (
    PASS_CONFIGS,
    abs_of,
    check_cuda,
    blockwise_tile,
    row_major,
    scale_and_inverse,
    sm_count,
    supports_block,
    tl_dtype,
    to_e4m3,
    vector_layout,
    vector_width,
    warp_amax,
)
from kernels.validate import check_tensor


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_blockwise_cast_kernel(num_cols: int, block_m: int, block_n: int, in_dtype: str, round_sf: bool, pack_sf: bool,
                              tile: tuple[int, int, int] | None = None, vec: int | None = None, staged_ctas: int = 0):
    """``(x_MN, q_MN, sf_BG)`` kernel for ``num_cols`` columns and scales over ``block_m x block_n``
    (``(1, g)`` per-token, ``(b, b)`` per-block, ``(b, 1)`` per-channel; powers of two).
    ``tile`` overrides :func:`kernels.tiles.blockwise_tile`'s ``(tile_m, tile_n, threads)``
    and ``vec`` the consecutive elements a thread holds (for tuning sweeps; whole scale blocks).
    ``staged_ctas``: the values wait out the reduction in shared memory, not in registers, and
    registers are held to what ``staged_ctas`` CTAs an SM need (see :func:`staged_channel_ctas`)."""
    num_rows = T.dynamic("num_rows")
    vec = vec or vector_width(num_cols, T.dtype(in_dtype).bytes)
    tile_m, tile_n, threads = tile or blockwise_tile(num_cols, (block_m, block_n), vec)
    sf_dtype = "uint8" if pack_sf else "float32"
    cast_tile = tile_caster((block_m, block_n), (tile_m, tile_n, threads), vec, in_dtype, round_sf, pack_sf)

    @T.prim_func
    def blockwise_cast(
        x_MN: T.Tensor[(num_rows, num_cols), in_dtype],
        q_MN: T.Tensor[(num_rows, num_cols), T.float8_e4m3fn],
        sf_BG: T.Tensor[(T.ceildiv(num_rows, block_m), T.ceildiv(num_cols, block_n)), sf_dtype],
    ):
        tiles_n = T.ceildiv(num_cols, tile_n)
        with T.Kernel(T.ceildiv(num_rows, tile_m) * tiles_n, threads=threads) as pid:
            if staged_ctas:
                T.annotate_min_blocks_per_sm(staged_ctas)
            pm, pn = row_major(pid, tiles_n)
            x_frag = T.alloc_fragment((tile_m, tile_n), in_dtype)
            T.annotate_layout({x_frag: vector_layout(tile_m, tile_n, threads, vec)})
            T.copy(x_MN[pm * tile_m, pn * tile_n], x_frag, disable_tma=True)
            abs_frag = T.alloc_fragment((tile_m, tile_n), in_dtype)
            abs_of(x_frag, abs_frag)
            if staged_ctas:
                x_S = T.alloc_shared((tile_m, tile_n), in_dtype)
                T.copy(x_frag, x_S)
                cast_tile(x_frag, abs_frag, q_MN, sf_BG, pm, pn, x_S=x_S)
            else:
                cast_tile(x_frag, abs_frag, q_MN, sf_BG, pm, pn)

    return blockwise_cast


def tile_caster(block: tuple[int, int], tile: tuple[int, int, int], vec: int, amax_dtype: str, round_sf: bool,
                pack_sf: bool, in_span: tuple[int, int] | None = None):
    """The second half of a blockwise cast, as a macro ``cast_tile(x_frag, abs_frag, q_MN, sf_BG, pm,
    pn, sf_in_S=None)``: from a ``[tile_m, tile_n]`` tile in registers (``x_frag``, in
    :func:`kernels.tiles.vector_layout` with ``vec``) and the magnitudes its scales follow
    (``abs_frag``, ``amax_dtype``: ``|x|`` for a cast), reduces each ``block`` to its amax, writes
    the scales and the e4m3 bytes of tile ``(pm, pn)``.
    ``in_span``: the tile's values are ``float32(x_frag) * sf_in_S[i // in_span[0], j // in_span[1]]``
    (e4m3 bytes and their scales, dequantized as they are cast: the float32 tile would hold 64
    registers a thread across the reduction)."""
    block_m, block_n = block
    tile_m, tile_n, threads = tile
    tile_gm, tile_gn = tile_m // block_m, tile_n // block_n
    # Row bands of a tile: one band is ``threads * vec`` elements, i.e. ``rows_pp`` whole rows.
    rows_pp = max(1, threads * vec // tile_n)
    passes = tile_m // rows_pp if threads * vec % tile_n == 0 and tile_m % rows_pp == 0 else 1

    @T.macro
    def cast_tile(x_frag, abs_frag, q_MN, sf_BG, pm, pn, sf_in_S=None, x_S=None):
        inv_frag = T.alloc_fragment((tile_gm, tile_gn), "float32")

        if block_m == 1:
            # per-token: along the row inside each group (warp shuffles).
            row_amax = T.alloc_fragment((tile_m, tile_gn), amax_dtype)
            T.reduce_max(T.reshape(abs_frag, [tile_m, tile_gn, block_n]), row_amax, dim=2)
            for i, g in T.Parallel(tile_gm, tile_gn):
                sf, inv = scale_and_inverse(T.cast(row_amax[i, g], "float32"), round_sf, pack_sf)
                sf_BG[pm * tile_gm + i, pn * tile_gn + g] = sf
                inv_frag[i, g] = inv
        elif passes > 1 and block_n > 1 and tile_gn == 1:
            # per-block, the tile one block: each thread's amax over its bands and vectors, a
            # warp's by one redux.sync, then the warps' through shared memory
            lanes_per_row = tile_n // vec
            partial = T.alloc_fragment((rows_pp, tile_n), amax_dtype)
            T.reduce_max(T.reshape(abs_frag, [passes, rows_pp, tile_n]), partial, dim=0)
            thread_amax = T.alloc_fragment((rows_pp, lanes_per_row), amax_dtype)
            T.reduce_max(T.reshape(partial, [rows_pp, lanes_per_row, vec]), thread_amax, dim=2)
            warps_S = T.alloc_shared((threads // 32,), "float32")
            for r, c in T.Parallel(rows_pp, lanes_per_row):
                amax = warp_amax(T.cast(thread_amax[r, c], "float32"))
                if (r * lanes_per_row + c) % 32 == 0:
                    warps_S[(r * lanes_per_row + c) // 32] = amax
            top = T.alloc_local((1,), "float32")
            top[0] = warps_S[0]
            for w in T.unroll(1, threads // 32):
                top[0] = T.max(top[0], warps_S[w])
            sf, inv = scale_and_inverse(top[0], round_sf, pack_sf)
            if T.get_thread_binding() == 0:
                sf_BG[pm, pn] = sf
            inv_frag[0, 0] = inv
        elif passes > 1 and block_n > 1:
            # A thread holds the same columns in each of the tile's ``passes`` row bands, so the
            # amax over the bands is thread-local; only ``rows_pp`` rows remain to reduce.
            partial = T.alloc_fragment((rows_pp, tile_n), amax_dtype)
            T.reduce_max(T.reshape(abs_frag, [passes, rows_pp, tile_n]), partial, dim=0)
            block_amax = T.alloc_fragment((tile_gn,), amax_dtype)
            band_amax = T.alloc_fragment((rows_pp, tile_gn), amax_dtype)
            T.reduce_max(T.reshape(partial, [rows_pp, tile_gn, block_n]), band_amax, dim=2)
            T.reduce_max(band_amax, block_amax, dim=0)
            for g in T.Parallel(tile_gn):
                sf, inv = scale_and_inverse(T.cast(block_amax[g], "float32"), round_sf, pack_sf)
                sf_BG[pm, pn * tile_gn + g] = sf
                inv_frag[0, g] = inv
        elif passes > 1 and tile_n // vec <= 32:
            # per-channel, the amax over the bands thread-local as above; then the rows of a warp
            # meet by shuffles (lanes ``lanes_per_row`` apart hold the same columns) and the
            # warps' in shared memory, one column a thread. Not one cross-warp reduction per
            # column a thread holds (TileLang's reduce), nor every band row through shared
            # memory (a 31-step chain at 128 x 32 tiles).
            lanes_per_row = tile_n // vec
            warp_rows = 32 // lanes_per_row
            warps = rows_pp // warp_rows
            partial = T.alloc_fragment((rows_pp, tile_n), amax_dtype)
            T.reduce_max(T.reshape(abs_frag, [passes, rows_pp, tile_n]), partial, dim=0)
            col_max = T.alloc_fragment((rows_pp, tile_n), "float32")
            # rows 0..warps-1: each warp's column maxima; row ``warps``: the columns' inverses
            # (one buffer, so no barrier guards a reuse of the maxima's memory)
            stage_S = T.alloc_shared((warps + 1, tile_n), "float32")
            for r, j in T.Parallel(rows_pp, tile_n):
                col_max[r, j] = T.cast(partial[r, j], "float32")
                for o in T.unroll(warp_rows.bit_length() - 1):
                    col_max[r, j] = T.max(col_max[r, j], T.shfl_xor(col_max[r, j], lanes_per_row << o))
                if r % warp_rows == 0:
                    stage_S[r // warp_rows, j] = col_max[r, j]
            block_amax = T.alloc_fragment((tile_gn,), "float32")
            for g in T.Parallel(tile_gn):
                block_amax[g] = stage_S[0, g]
                for w in T.unroll(1, warps):
                    block_amax[g] = T.max(block_amax[g], stage_S[w, g])
                sf, inv = scale_and_inverse(block_amax[g], round_sf, pack_sf)
                sf_BG[pm, pn * tile_gn + g] = sf
                stage_S[warps, g] = inv
            for i, g in T.Parallel(tile_gm, tile_gn):
                inv_frag[i, g] = stage_S[warps, g]
        else:
            block_amax = T.alloc_fragment((tile_gn,), amax_dtype)
            if block_n > 1:
                row_amax = T.alloc_fragment((tile_m, tile_gn), amax_dtype)
                T.reduce_max(T.reshape(abs_frag, [tile_m, tile_gn, block_n]), row_amax, dim=2)
                T.reduce_max(row_amax, block_amax, dim=0)
            else:
                T.reduce_max(abs_frag, block_amax, dim=0)
            for g in T.Parallel(tile_gn):
                sf, inv = scale_and_inverse(T.cast(block_amax[g], "float32"), round_sf, pack_sf)
                sf_BG[pm, pn * tile_gn + g] = sf
                inv_frag[0, g] = inv

        if x_S is not None:
            T.copy(x_S, x_frag)
        for i, j in T.Parallel(tile_m, tile_n):
            x = T.cast(x_frag[i, j], "float32")
            if in_span is not None:
                x = x * sf_in_S[i // in_span[0], j // in_span[1]]
            q_MN[pm * tile_m + i, pn * tile_n + j] = to_e4m3(x * inv_frag[i // block_m, j // block_n])

    return cast_tile


NARROW_CHANNEL_COLUMNS = 64  # per-channel tiles of few rows (see narrow_channel_tile)


def narrow_channel_tile(m: int, n: int, block: tuple[int, int], vec: int, device: torch.device):
    """``(tile_m, tile_n, threads)`` of 64 columns for per-channel scales when the default tile's grid
    leaves SMs idle, else None. At 128 x 7168 bf16 the default 128-column tiles make 56 CTAs for an
    H100's 132 SMs; 64-column tiles of 128 threads make 112: 2.50 us of GPU time against 32-column
    tiles' 2.69 and tile-kernels' 2.59 (paired rounds)."""
    if block[1] != 1:
        return None
    tile_m, tile_n, _ = blockwise_tile(n, block, vec)
    if tile_n <= NARROW_CHANNEL_COLUMNS or -(-m // tile_m) * -(-n // tile_n) >= sm_count(device):
        return None
    return tile_m, NARROW_CHANNEL_COLUMNS, max(32, min(128, tile_m * NARROW_CHANNEL_COLUMNS // vec))


STAGED_CHANNEL_CTAS = 4  # CTAs of the staged per-channel tile an SM holds (register cap: 64 a thread)


def staged_channel_ctas(n: int, block: tuple[int, int], vec: int, itemsize: int) -> int:
    """``staged_ctas`` for the default per-channel tile of 2-byte values on tile_caster's shuffle
    path (bands of whole rows, a row's vectors within one warp), else 0.

    Held in registers across the reduction, a 128 x 128 bfloat16 tile took 96 registers a thread
    (ptxas unpacks the bfloat16 pairs for the cast ahead of the barrier): two CTAs of 256 threads
    an SM, 64 KiB of loads in flight. Staged in shared memory (each thread reads back what it
    wrote, behind the reduction's barriers), 68 registers, or 63 held to four CTAs. At 16384 x 7168
    on an H200 (one process, the L2 flushed): 85.6 us in registers; staged 83.3 (3 CTAs), 83.4 (4),
    83.8 (5 CTAs, 48 registers), 98.8 (6: spills); tile-kernels 82.8. Under the cap of four CTAs
    blocks of 4 or 8 rows (TileLang's reduce) spill; blocks of 64 rows and more do not."""
    if block[1] != 1 or itemsize != 2:
        return 0
    tile_m, tile_n, threads = blockwise_tile(n, block, vec)
    band = threads * vec
    shuffles = band % tile_n == 0 and tile_m * tile_n > band and tile_n // vec <= 32
    return STAGED_CHANNEL_CTAS if shuffles else 0


def per_token_tile(m: int, n: int, block: tuple[int, int], vec: int, device: torch.device):
    """``(tile_m, tile_n, threads)`` of the default per-token tile dealt two vectors a thread, where
    the grid is more CTAs than the SMs hold at once (so each thread's bytes in flight, not the
    threads, set the rate), else None. At 16384 x 7168 bf16 on an H200 (1 x 1024 tiles): 64
    threads, two 16-byte vectors each, 83.7 us (99.3% of copy) against 128 threads' 87.4 and
    tile-kernels' 84.1 (4 x 1024 tiles of 128 threads, four vectors each); 4 x 1024 with 128 threads
    took 84.3 us, 1 x 2048 with 128 86.4, 2 x 1024 with 256 124.3. At 128 tokens (896 CTAs) the
    default stays."""
    if block[0] != 1:
        return None
    tile_m, tile_n, threads = blockwise_tile(n, block, vec)
    resident = sm_count(device) * (2048 // threads)  # CTAs of the default tile an H100 / H200 holds at once
    if tile_m * tile_n // vec < 2 * 32 or -(-m // tile_m) * -(-n // tile_n) <= resident:
        return None
    return tile_m, tile_n, tile_m * tile_n // (2 * vec)


def blockwise_cast(
    x_MN: torch.Tensor, block: tuple[int, int], *, round_sf: bool, pack_sf: bool, name: str = "x_MN"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of the reference's blockwise cast (same arguments, same results).

    Args:
        x_MN: ``[M, N]`` float32, bfloat16 or float16 on a CUDA device (copied first if not
            contiguous).
        block: ``(block_m, block_n)``, powers of two (see :func:`kernels.tiles.supports_block`).
        round_sf, pack_sf: as in :func:`kernels.quant.reference.per_token_cast`.
        name: the argument name used in error messages.

    Returns:
        ``q_MN`` ``[M, N]`` float8_e4m3fn and ``sf_BG`` ``[ceil(M / block_m), ceil(N / block_n)]``
        float32 (uint8 exponents when ``pack_sf``).
    """
    check_tensor(name, x_MN, dtype=FLOAT_DTYPES, ndim=2)
    check_cuda(name, x_MN)
    if not supports_block(block):
        raise ValueError(f"block: expected two powers of two up to 1024, not both 1, got {block!r}")
    if pack_sf and not round_sf:
        raise ValueError("pack_sf: expected round_sf=True (only power-of-two scales pack), got round_sf=False")
    block_m, block_n = block
    m, n = x_MN.shape
    q_MN = torch.empty((m, n), dtype=E4M3, device=x_MN.device)
    sf_BG = torch.empty(
        (-(-m // block_m), -(-n // block_n)), dtype=torch.uint8 if pack_sf else torch.float32, device=x_MN.device
    )
    if m == 0 or n == 0:
        return q_MN, sf_BG
    vec = vector_width(n, x_MN.element_size())
    tile = narrow_channel_tile(m, n, block, vec, x_MN.device) or per_token_tile(m, n, block, vec, x_MN.device)
    staged = staged_channel_ctas(n, block, vec, x_MN.element_size()) if tile is None else 0
    kernel = get_blockwise_cast_kernel(n, block_m, block_n, tl_dtype(x_MN.dtype), round_sf, pack_sf, tile, None, staged)
    kernel(x_MN.contiguous(), q_MN, sf_BG)
    return q_MN, sf_BG
