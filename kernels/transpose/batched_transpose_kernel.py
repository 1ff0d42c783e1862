"""Batched transpose kernel for any dtype (see :mod:`kernels.transpose.reference`).

Elements are moved as raw bits (an unsigned integer of the element's width, so float8 and every
other dtype share one kernel per width). Matrices whose output rows are at most 32 bytes (a small
batch's ``[B, 16, 7168]`` bf16) are transposed in registers: each thread loads a block of ``bm``
rows of ``bn`` elements (16 bytes each way where the sizes allow) as ``bm`` vectors and stores it as
``bn`` output vectors of ``bm``, with no shared memory and no barrier, every load in flight at once
(the shared-memory kernel spent 3.1 us on the GPU at ``[8, 16, 7168]`` where torch.compile's
Triton kernel spent 2.2). The loads carry the
Triton kernel's cache policy (``L1::evict_last`` and an L2 policy of ``evict_last``,
:mod:`kernels.cache_hints`): with it the kernel took 2.05 us of GPU time there against
torch.compile's 2.18, and 2.21-2.24 with plain loads (``docs/design/quant.md``).
Otherwise a CTA (up to 256 threads) stages a ``[tile_m, tile_n]`` tile
in shared memory (128 x 128 for 1- and 2-byte elements, 64 x 64 otherwise; fewer rows when the matrix
has fewer, down to 8), read from ``x`` with row-contiguous
vectors; each thread then gathers a column run of up to 16 bytes from shared memory into registers and
stores it as one vector along the output row. A warp's reads take 8 row groups (of such runs) x 4
adjacent columns, so that 8 lanes store one contiguous 128-byte run of an output row, and the tile's
16-byte chunks are swizzled (chunk XOR row group), so that the 8 row groups' reads fall in 8
different chunks of the banks: no conflicts either way, and no padding to break the 16-byte stores.
At [8, 2048, 7168] bf16 on an H200 this took 115.0 us (96% of copy; torch.compile 115.7); tiles
padded by 4 bytes with a warp on 16 row groups of one column (4-way conflicts on the reads, the
stores split in four) took 135.0, and a warp on 32 adjacent columns of one row group (each store
half a 32-byte sector) 275.5.

Shape suffixes: B batch, M rows, N columns.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.cache_hints import hinted_load
from kernels.tiles import PASS_CONFIGS, VECTOR_BYTES, check_cuda, tl_dtype, vector_width
from kernels.validate import check_tensor

BITS_DTYPES = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
MAX_THREADS = 256
SWIZZLE = 8  # row groups whose chunks a tile row's XOR swizzle keeps apart (the reads' lanes_m)
REGISTER_ROW_BYTES = 32  # output rows up to this long: transposed in registers (two vectors a row)
# the register kernel's CTA: 128 threads 2.02 us, 64 / 256 threads 2.11 / 2.21 at [8, 16, 7168] bf16 on an
# H100 (with plain 4-byte loads 128 threads 2.18-2.21 against 64's 2.24)
REGISTER_THREADS = 128
REGISTER_LOAD_HINT = ".L1::evict_last"  # with an L2 policy of evict_last (kernels.cache_hints)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_batched_transpose_kernel(rows: int, cols: int, bits_dtype: str, register_threads: int = REGISTER_THREADS,
                                 register_block: tuple[int, int] | None = None, keep_in_l2: bool = True):
    """``(x_BMN, out_BNM)`` kernel for ``[*, rows, cols]`` elements of ``bits_dtype`` (uint8..uint64);
    ``register_threads`` the register kernel's CTA, ``register_block`` its ``(bm, bn)`` and
    ``keep_in_l2`` its loads' cache policy (for tuning sweeps; ``bm`` and ``bn`` must divide
    ``rows`` and ``cols``; default a vector of up to 16 bytes each way; False: plain loads)."""
    if rows * T.dtype(bits_dtype).bytes <= REGISTER_ROW_BYTES:
        return _register_blocks(rows, cols, bits_dtype, register_threads, register_block, keep_in_l2)
    return _shared_tiles(rows, cols, bits_dtype)


def _register_blocks(rows: int, cols: int, bits_dtype: str, threads: int, block: tuple[int, int] | None,
                     keep_in_l2: bool):
    """Each thread a ``[bm, bn]`` block: ``bm`` input vectors in, ``bn`` output vectors out. The
    blocks of one column band go to adjacent threads, so a store instruction writes whole output
    rows and a load instruction runs along the input rows."""
    batch = T.dynamic("batch")
    elem_bytes = T.dtype(bits_dtype).bytes
    # powers of two dividing rows and cols. 16-byte loads: 2.05 us against 4-byte ones' 2.11-2.13 with the cache policy (the other way round
    # with plain loads, 2.27 against 2.21; [8, 16, 7168] bf16, H100)
    bm, bn = block or (vector_width(rows, elem_bytes), vector_width(cols, elem_bytes))
    blocks_m, blocks = rows // bm, rows // bm * (cols // bn)
    load_name, load_source = hinted_load(bn * elem_bytes, REGISTER_LOAD_HINT, keep_in_l2=True)

    @T.prim_func
    def batched_transpose(
        x_BMN: T.Tensor[(batch, rows, cols), bits_dtype],
        out_BNM: T.Tensor[(batch, cols, rows), bits_dtype],
    ):
        with T.Kernel(T.ceildiv(blocks, threads), batch, threads=threads) as (pb, b):
            if keep_in_l2:
                T.import_source(load_source)
            block_MN = T.alloc_local((bm, bn), bits_dtype)
            column = T.alloc_local((bm,), bits_dtype)
            blk = pb * threads + T.get_thread_binding()
            m0, n0 = blk % blocks_m * bm, blk // blocks_m * bn
            if blk < blocks:
                for i in T.unroll(bm):
                    if keep_in_l2:
                        T.call_extern("handle", load_name, T.address_of(block_MN[i, 0]), T.address_of(x_BMN[b, m0 + i, n0]))
                    else:
                        for k in T.vectorized(bn):
                            block_MN[i, k] = x_BMN[b, m0 + i, n0 + k]
                for j in T.unroll(bn):
                    for i in T.unroll(bm):
                        column[i] = block_MN[i, j]
                    for k in T.vectorized(bm):
                        out_BNM[b, n0 + j, m0 + k] = column[k]

    return batched_transpose


def _shared_tiles(rows: int, cols: int, bits_dtype: str):
    """``[tile_m, tile_n]`` tiles staged in shared memory (see the module doc)."""
    batch = T.dynamic("batch")
    elem_bytes = T.dtype(bits_dtype).bytes
    tile_m, tile_n = transpose_tile(rows, elem_bytes)
    chunk = VECTOR_BYTES // elem_bytes  # elements of a 16-byte chunk: what the swizzle moves
    in_vec, out_vec = vector_width(cols, elem_bytes), vector_width(min(rows, tile_m), elem_bytes)
    threads = min(MAX_THREADS, tile_m * tile_n // max(in_vec, out_vec))  # at least one vector each way
    # A warp's output vectors: lanes_m row groups (of out_vec rows) x lanes_n adjacent columns.
    lanes_m = min(SWIZZLE, tile_m // out_vec)
    lanes_n, tasks_m = 32 // lanes_m, tile_m // out_vec // lanes_m
    vectors_n = tile_n // in_vec

    @T.macro
    def swizzled(i, j):
        """Tile column of element ``(i, j)`` in shared memory: its chunk XOR its row group."""
        return (j // chunk ^ i // out_vec % SWIZZLE) * chunk + j % chunk

    @T.prim_func
    def batched_transpose(
        x_BMN: T.Tensor[(batch, rows, cols), bits_dtype],
        out_BNM: T.Tensor[(batch, cols, rows), bits_dtype],
    ):
        with T.Kernel(T.ceildiv(cols, tile_n), T.ceildiv(rows, tile_m), batch, threads=threads) as (pn, pm, b):
            tile_MN = T.alloc_shared((tile_m, tile_n), bits_dtype)
            column = T.alloc_local((out_vec,), bits_dtype)
            tid = T.get_thread_binding()
            for v in T.unroll(tile_m * vectors_n // threads):
                i, j = (v * threads + tid) // vectors_n, (v * threads + tid) % vectors_n * in_vec
                if pm * tile_m + i < rows and pn * tile_n + j < cols:
                    for k in T.vectorized(in_vec):
                        tile_MN[i, swizzled(i, j) + k] = x_BMN[b, pm * tile_m + i, pn * tile_n + j + k]
            T.sync_threads()
            # Thread-owned output vectors: out_vec consecutive rows of one tile column, gathered from
            # shared memory, then stored as one vector along the output row.
            for v in T.unroll(tile_m * tile_n // (out_vec * threads)):
                task, lane = (v * threads + tid) // 32, (v * threads + tid) % 32
                m_in_tile = (task % tasks_m * lanes_m + lane % lanes_m) * out_vec
                n_in_tile = task // tasks_m * lanes_n + lane // lanes_m
                for k in T.unroll(out_vec):
                    column[k] = tile_MN[m_in_tile + k, swizzled(m_in_tile + k, n_in_tile)]
                if pn * tile_n + n_in_tile < cols and pm * tile_m + m_in_tile < rows:
                    for k in T.vectorized(out_vec):
                        out_BNM[b, pn * tile_n + n_in_tile, pm * tile_m + m_in_tile + k] = column[k]

    return batched_transpose


def transpose_tile(rows: int, elem_bytes: int) -> tuple[int, int]:
    """``(tile_m, tile_n)``: a square tile (128, or 64 for elements wider than 2 bytes), or for
    matrices of fewer rows only the rows rounded up to a power of two (at least 8), with fewer
    threads. Why: a 16-row matrix in 128-row tiles left 7/8 of every CTA idle; widening the tile
    instead (16 x 1024) left 56 CTAs for 132 SMs at [8, 16, 7168] (6.4 us, torch.compile 4.9)."""
    tile = 128 if elem_bytes <= 2 else 64
    return min(tile, max(8, 1 << max(0, rows - 1).bit_length())), tile


def batched_transpose(x_BMN: torch.Tensor) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.transpose.reference.batched_transpose`: ``[B, N, M]``
    (``[N, M]`` for 2-D input) in new row-major memory, any dtype, bit for bit. ``x_BMN`` must be
    on a CUDA device (copied first if not contiguous)."""
    check_tensor("x_BMN", x_BMN)
    if x_BMN.dim() not in (2, 3):
        raise ValueError(f"x_BMN: expected a 2-D or 3-D tensor, got shape {tuple(x_BMN.shape)}")
    check_cuda("x_BMN", x_BMN)
    if x_BMN.element_size() not in BITS_DTYPES:
        raise TypeError(f"x_BMN: expected elements of 1, 2, 4 or 8 bytes, got {x_BMN.dtype}")
    x_3d = x_BMN if x_BMN.dim() == 3 else x_BMN[None]
    b, m, n = x_3d.shape
    out = torch.empty((b, n, m), dtype=x_BMN.dtype, device=x_BMN.device)
    if out.numel():
        bits = BITS_DTYPES[x_BMN.element_size()]
        kernel = get_batched_transpose_kernel(m, n, tl_dtype(bits))
        kernel(x_3d.contiguous().view(bits), out.view(bits))
    return out if x_BMN.dim() == 3 else out[0]
