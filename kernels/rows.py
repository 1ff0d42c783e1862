"""TileLang pieces for kernels that give one CTA to one row (a token, or a token's stream): how
many threads a row gets, the CTA-wide sum of per-thread partials, and a thread's vector staged in
shared memory by ``cp.async``.

Used by the Engram gate kernels, the mHC kernels and the weighted reduce (with the combine's
kernels built on it).
"""

from typing import NamedTuple

from tilelang import language as T

from kernels.tiles import vector_width

WARP = 32


def row_threads(nv: int, max_threads: int = 128) -> int:
    """Threads of a one-row CTA for rows of ``nv`` vectors: one per vector, a power of two from one
    warp to ``max_threads``."""
    return min(max_threads, max(WARP, 1 << max(0, nv - 1).bit_length()))


class RowGeometry(NamedTuple):
    """How a row of ``D`` elements spreads over its CTA: ``vec`` elements a vector (16 bytes, or
    fewer when D is not a multiple), ``nv`` vectors, ``threads``, ``per_thread`` vectors each,
    ``warps``."""

    vec: int
    nv: int
    threads: int
    per_thread: int
    warps: int


def row_geometry(d: int, dtype: str, max_threads: int = 128) -> RowGeometry:
    vec = vector_width(d, T.dtype(dtype).bytes)
    nv = d // vec
    threads = row_threads(nv, max_threads)
    return RowGeometry(vec, nv, threads, -(-nv // threads), threads // WARP)


def row_reduction(count: int, warps: int):
    """A macro ``(sums, partial, stats, tid)``: every thread gets in ``stats[s]`` (``s < count``)
    the CTA's total of ``sums[s]``: warp shuffles, one value per warp through ``partial``
    (``[count, warps]`` shared), summed in warp order."""

    @T.macro
    def reduce(sums, partial, stats, tid):
        for s in T.unroll(count):
            sums[s] = T.warp_reduce_sum(sums[s])
        if tid % WARP == 0:
            for s in T.unroll(count):
                partial[s, tid // WARP] = sums[s]
        T.sync_threads()
        for s in T.unroll(count):
            stats[s] = partial[s, 0]
            for w in T.unroll(1, warps):
                stats[s] = T.ieee_add(stats[s], partial[s, w])

    return reduce


def shifted(load, offset):
    """``load`` (a buffer element) ``offset`` elements further along its last axis."""
    return T.BufferLoad(load.buffer, [*load.indices[:-1], load.indices[-1] + offset])


def vector_cp_async(vec: int, elem_bytes: int):
    """``copy(dst, src)`` emitting the ``cp.async`` of one vector of ``vec`` elements whose first
    elements ``dst`` (shared) and ``src`` (global) are, 16 bytes or fewer a copy (no commit)."""
    chunk = min(vec, 16 // elem_bytes)

    def copy(dst, src):
        for q in range(vec // chunk):
            T.evaluate(T.ptx_cp_async(T.access_ptr(shifted(dst, q * chunk), "w", chunk),
                                      T.access_ptr(shifted(src, q * chunk), "r", chunk), chunk))

    return copy
