"""TileLang kernel of :func:`kernels.comm.reference.put_rows`: rows stored straight into other
ranks' memory (NVLink peer mappings of a symmetric heap).

Rows move as raw bits in the vectors of ``kernels.permute.expand_kernel`` (same tiles: each CTA
loads its rows once, all loads before the first store, then stores them to every rank that
wants them). The kernel takes only rank 0's copy of the region and reaches rank w's copy at
``views[0] + delta_W[w]`` bytes: peers' copies sit at one offset in every heap, so one pointer
and W offsets address them all, for any W, without a kernel argument per rank. Those stores lie
outside the buffer the kernel was given, so TileLang's out-of-bounds guards are turned off
(``TL_DISABLE_SAFE_MEMORY_ACCESS``); the wrapper checks everything else on the host.

Values are not checked (no host sync): a destination row outside ``[0, M)`` is skipped, as -1 is.

Shape suffixes: N source rows, W ranks, M destination rows, V vectors of a row, C vectors of the
whole region.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.launch import launcher
from kernels.pdl import chained
from kernels.permute.expand_kernel import THREADS, WORD_DTYPES, _tile, row_words, tile_vectors
from kernels.tiles import PEER_PASS_CONFIGS, aligned, as_int32, tl_dtype
from kernels.validate import per_signature

from .reference import PeerRegion, check_put_rows_args


@tilelang.jit(pass_configs=PEER_PASS_CONFIGS)
def get_put_rows_kernel(word: str, vec: int, tile_v: int, world: int):
    """``(src_NVX, dest_NW, delta_W, dst_CX)`` kernel for W = ``world`` ranks: rows of V vectors of
    ``vec`` words of type ``word``; rank 0's region as C vectors (row, vector and region sizes are
    dynamic)."""
    num_src, nv, nc = T.dynamic("num_src"), T.dynamic("nv"), T.dynamic("nc")
    tile_m, per_thread = _tile(tile_v)
    vector_bytes = vec * T.dtype(word).bits // 8

    @T.prim_func
    def put_rows_kernel(
        src_NVX: T.Tensor[(num_src, nv, vec), word],
        dest_NW: T.Tensor[(num_src, world), T.int32],
        delta_W: T.Tensor[(world,), T.int64],
        dst_CX: T.Tensor[(nc, vec), word],
    ):
        with T.Kernel(T.ceildiv(num_src, tile_m), T.ceildiv(nv, tile_v), threads=THREADS) as (bm, bn):
            chained()
            tid = T.get_thread_binding()
            buf = T.alloc_local((per_thread * vec,), word)
            rows_VW = T.alloc_local((per_thread * world,), T.int32)
            deltas_W = T.alloc_local((world,), T.int64)
            # every load before the first store (chained, so the pointers are not __restrict__)
            for w in T.unroll(world):
                deltas_W[w] = delta_W[w]
            for v in T.unroll(per_thread):
                c = bn * tile_v + (v * THREADS + tid) % tile_v
                n = bm * tile_m + (v * THREADS + tid) // tile_v
                for w in T.unroll(world):
                    rows_VW[v * world + w] = -1
                if c < nv and n < num_src:
                    for j in T.vectorized(vec):
                        buf[v * vec + j] = src_NVX[T.Cast(T.int64, n), c, j]
                    for w in T.unroll(world):
                        rows_VW[v * world + w] = dest_NW[n, w]
            for w in T.unroll(world):
                for v in T.unroll(per_thread):
                    c = bn * tile_v + (v * THREADS + tid) % tile_v
                    row = rows_VW[v * world + w]
                    if row >= 0 and row < nc // nv:
                        for j in T.vectorized(vec):
                            dst_CX[deltas_W[w] // vector_bytes + T.Cast(T.int64, row) * nv + c, j] = buf[v * vec + j]

    return put_rows_kernel


def get_kernel_args(row_bytes: int, world: int) -> tuple[str, int, int, int]:
    """``(word, vec, tile_v, world)``: the kernel's specialization for rows of ``row_bytes``."""
    word_bytes, vec, nv = row_words(row_bytes)
    return tl_dtype(WORD_DTYPES[word_bytes]), vec, tile_vectors(nv), world


def peer_copy(region: PeerRegion, name: str = "region", *, dtype: torch.dtype | None = None,
              width: int | None = None, layout: tuple | None = None) -> torch.Tensor:
    """Rank 0's copy of ``region``, as every kernel that stores into peers takes it: checked to come
    with the peers' byte offsets (``delta_W``) and to be a contiguous CUDA tensor starting on a
    16-byte boundary (of ``dtype`` and ``width`` columns, when given); then, with ``layout =
    (view_dtype, *shape)``, viewed as that. Checked and viewed once per region and arguments
    (``PeerRegion.kept``: its tensors never change, and a transport call's host time is what an
    eager call waits for)."""
    return region.kept(("peer_copy", dtype, width, layout), lambda: _checked_copy(region, name, dtype, width, layout))


def _checked_copy(region: PeerRegion, name: str, dtype: torch.dtype | None, width: int | None,
                  layout: tuple | None) -> torch.Tensor:
    if region.delta_W is None:
        raise ValueError(f"{name}.delta_W: expected the peers' byte offsets from views[0] (a symmetric heap's region)")
    first = region.views[0]
    if (first.device.type != "cuda" or not first.is_contiguous() or first.data_ptr() % 16
            or dtype not in (None, first.dtype) or width not in (None, first.shape[1])):
        raise ValueError(f"{name}.views[0]: expected a contiguous CUDA tensor starting on a 16-byte boundary"
                         f"{f', {dtype}' if dtype else ''}{f', {width} columns' if width else ''}; got "
                         f"{first.dtype} of shape {tuple(first.shape)} on {first.device}")
    if layout is not None:
        view_dtype, *shape = layout
        first = first.view(view_dtype).view(*shape)
    return first


def put_rows(src_NX: torch.Tensor, dest_NW: torch.Tensor, region: PeerRegion) -> None:
    """The TileLang twin of :func:`kernels.comm.reference.put_rows` (same bits). ``region`` must
    carry ``delta_W``, and its views must start on 16-byte boundaries."""
    plan = _plan(src_NX, dest_NW, region)
    if plan is not None:
        launch, dst_CX, word, vectors = plan  # the rows as words, in two views (a view is host time)
        launch(aligned(src_NX).view(word).view(vectors), as_int32(dest_NW), region.delta_W, dst_CX)


@per_signature
def _plan(src_NX, dest_NW, region):
    """:func:`put_rows`' checks, its launch and the region's rows as vectors (None: nothing to put),
    once per signature of its arguments (``kernels.validate.per_signature``)."""
    check_put_rows_args(src_NX, dest_NW, region)
    peer_copy(region)
    if src_NX.shape[0] * src_NX.shape[1] == 0:
        return None
    word_bytes, vec, nv = row_words(src_NX.shape[1] * src_NX.element_size())
    word = WORD_DTYPES[word_bytes]
    dst_CX = peer_copy(region, layout=(word, -1, vec))  # the region's rows as vectors
    kernel = get_put_rows_kernel(*get_kernel_args(src_NX.shape[1] * src_NX.element_size(), region.world))
    return launcher(kernel), dst_CX, word, (src_NX.shape[0], nv, vec)
