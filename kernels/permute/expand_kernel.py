"""TileLang kernels of :func:`kernels.permute.reference.expand` and
:func:`kernels.permute.reference.unexpand`: row copies between tokens and the expert-major layout.

Rows are moved as raw bits, so every dtype (float8 included) shares one kernel per row width in
bytes: a row is viewed as ``W`` words of 4 bytes (2 or 1 when the row width is not a multiple of
4), moved in vectors of up to 16 bytes (``ld.global.v4`` / ``st.global.v4``). A CTA of ``THREADS``
threads covers ``tile_m`` rows of ``tile_v`` vectors (about ``VECTORS_PER_THREAD`` vectors per
thread, all loads issued before the first store); rows longer than ``THREADS *
VECTORS_PER_THREAD`` vectors are split over a second grid dimension.

expand is a scatter from the tokens, not a gather into the layout: a CTA loads each of its tokens
once and stores it to the token's K rows (``pos_TK``), so every input byte is read once (a gather
by ``src_P`` would read each token K times from memory: rows of one expert are spread over all
tokens, and the token matrix does not fit in L2). Padding rows (``src_P == -1``) inside the
segments are zeroed by the grid's first CTAs, ``PAD_TILES`` row tiles each; rows past the last
segment (``offsets_E[-1]``: the unused part of a static capacity, which no grouped GEMM reads) are
left unwritten, so a worst-case capacity costs no stores. This relies on ``pos_TK`` and ``src_P`` being each
other's inverse, as in every :class:`ExpertLayout` from ``expert_layout``; a row no route points to
and whose ``src_P`` is not -1 is left unwritten.

unexpand is a gather: output row ``r = t * K + k`` reads layout row ``pos_TK[t, k]`` (zeros for -1).

Values are not checked on the host (no host sync): rows outside ``[0, P)`` are treated as -1.

Shape suffixes:
    T  tokens
    K  routes per token
    R  flattened routes, T * K
    P  layout rows
    D  hidden (elements)
    W  words per row (4-, 2- or 1-byte units)
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.tiles import as_int32, row_major, tl_dtype
from kernels.validate import check_tensor

from .reference import ExpertLayout

THREADS = 128
VECTOR_BYTES = 16
VECTORS_PER_CTA = 1024  # vector slots of a CTA tile: 8 per thread, all loaded before the first store
PAD_TILES = 16  # row tiles a padding CTA checks
WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def row_words(row_bytes: int) -> tuple[int, int, int]:
    """``(word_bytes, vec, nv)`` for a row of ``row_bytes``: the widest word (4, 2 or 1 bytes)
    dividing it, words per vector (at most 16 bytes; every row starts on a vector boundary) and
    vectors per row."""
    word_bytes = next(w for w in (4, 2, 1) if row_bytes % w == 0)
    vec = math.gcd(VECTOR_BYTES // word_bytes, row_bytes // word_bytes)
    return word_bytes, vec, row_bytes // (word_bytes * vec)


def tile_vectors(nv: int) -> int:
    """Vectors per row of a CTA tile for rows of ``nv`` vectors: a power of two in [32, 1024]
    (a static divisor, so the tile needs no run-time division; few values, so few compiles)."""
    return min(VECTORS_PER_CTA, max(32, 1 << max(0, nv - 1).bit_length()))


def _tile(tile_v: int) -> tuple[int, int]:
    """``(tile_m, per_thread)``: rows per CTA tile and vector slots per thread."""
    return VECTORS_PER_CTA // tile_v, VECTORS_PER_CTA // THREADS


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_expand_kernel(word: str, vec: int, tile_v: int):
    """``(x_TNV, pos_TK, src_P, offsets_E, y_PNV)`` kernel: rows of N vectors of ``vec`` words of
    type ``word``, CTA tiles of ``tile_v`` vectors per row (token, route, row, expert and vector
    counts are dynamic)."""
    num_tokens, topk, num_rows = T.dynamic("num_tokens"), T.dynamic("topk"), T.dynamic("num_rows")
    nv, num_experts = T.dynamic("nv"), T.dynamic("num_experts")
    tile_m, per_thread = _tile(tile_v)
    pad_m = tile_m * PAD_TILES

    @T.prim_func
    def expand_kernel(
        x_TNV: T.Tensor[(num_tokens, nv, vec), word],
        pos_TK: T.Tensor[(num_tokens, topk), T.int32],
        src_P: T.Tensor[(num_rows,), T.int32],
        offsets_E: T.Tensor[(num_experts,), T.int32],
        y_PNV: T.Tensor[(num_rows, nv, vec), word],
    ):
        pad_blocks = T.ceildiv(num_rows, pad_m)
        tiles_v = T.ceildiv(nv, tile_v)
        with T.Kernel((pad_blocks + T.ceildiv(num_tokens, tile_m)) * tiles_v, threads=THREADS) as pid:
            bm, bn = row_major(pid, tiles_v)
            tid = T.get_thread_binding()
            buf = T.alloc_local((per_thread * vec,), word)
            pad_M = T.alloc_shared((pad_m,), T.int32)  # M: rows of the padding tile, 1 = padding
            row = T.alloc_var(T.int32)
            if bm < pad_blocks:
                # Padding rows: zeros. The tile's src_P entries go to shared memory first, so the
                # stores of all its rows issue without waiting on one load per row.
                for s in T.serial(T.ceildiv(pad_m, THREADS)):
                    if s * THREADS + tid < pad_m:
                        row = bm * pad_m + s * THREADS + tid
                        pad_M[s * THREADS + tid] = 0
                        if row < num_rows and row < offsets_E[num_experts - 1]:
                            pad_M[s * THREADS + tid] = T.Cast(T.int32, src_P[row] < 0)
                T.sync_threads()
                for g in T.unroll(PAD_TILES):
                    for v in T.unroll(per_thread):
                        c = bn * tile_v + (v * THREADS + tid) % tile_v
                        i = g * tile_m + (v * THREADS + tid) // tile_v
                        if c < nv and pad_M[i] == 1:
                            for j in T.vectorized(vec):
                                y_PNV[T.Cast(T.int64, bm * pad_m + i), c, j] = T.cast(0, word)
            else:
                # Tokens: load each once, store it to its K rows.
                for v in T.unroll(per_thread):
                    c = bn * tile_v + (v * THREADS + tid) % tile_v
                    token = (bm - pad_blocks) * tile_m + (v * THREADS + tid) // tile_v
                    if c < nv and token < num_tokens:
                        for j in T.vectorized(vec):
                            buf[v * vec + j] = x_TNV[T.Cast(T.int64, token), c, j]
                for k in T.serial(topk):
                    for v in T.unroll(per_thread):
                        c = bn * tile_v + (v * THREADS + tid) % tile_v
                        token = (bm - pad_blocks) * tile_m + (v * THREADS + tid) // tile_v
                        if c < nv and token < num_tokens:
                            row = pos_TK[token, k]
                            if row >= 0 and row < num_rows:
                                for j in T.vectorized(vec):
                                    y_PNV[T.Cast(T.int64, row), c, j] = buf[v * vec + j]

    return expand_kernel


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_unexpand_kernel(word: str, vec: int, tile_v: int):
    """``(y_PNV, pos_R, out_RNV)`` kernel: rows of N vectors of ``vec`` words of type ``word``, CTA
    tiles of ``tile_v`` vectors per row (route, row and vector counts are dynamic)."""
    num_routes, num_rows, nv = T.dynamic("num_routes"), T.dynamic("num_rows"), T.dynamic("nv")
    tile_m, per_thread = _tile(tile_v)

    @T.prim_func
    def unexpand_kernel(
        y_PNV: T.Tensor[(num_rows, nv, vec), word],
        pos_R: T.Tensor[(num_routes,), T.int32],
        out_RNV: T.Tensor[(num_routes, nv, vec), word],
    ):
        tiles_v = T.ceildiv(nv, tile_v)
        with T.Kernel(T.ceildiv(num_routes, tile_m) * tiles_v, threads=THREADS) as pid:
            bm, bn = row_major(pid, tiles_v)
            tid = T.get_thread_binding()
            buf = T.alloc_local((per_thread * vec,), word)
            row = T.alloc_var(T.int32)
            for v in T.unroll(per_thread):
                c = bn * tile_v + (v * THREADS + tid) % tile_v
                route = bm * tile_m + (v * THREADS + tid) // tile_v
                for j in T.vectorized(vec):
                    buf[v * vec + j] = T.cast(0, word)
                if c < nv and route < num_routes:
                    row = pos_R[route]
                    if row >= 0 and row < num_rows:
                        for j in T.vectorized(vec):
                            buf[v * vec + j] = y_PNV[T.Cast(T.int64, row), c, j]
            for v in T.unroll(per_thread):
                c = bn * tile_v + (v * THREADS + tid) % tile_v
                route = bm * tile_m + (v * THREADS + tid) // tile_v
                if c < nv and route < num_routes:
                    for j in T.vectorized(vec):
                        out_RNV[T.Cast(T.int64, route), c, j] = buf[v * vec + j]

    return unexpand_kernel


def _as_vectors(t: torch.Tensor, *, output: bool = False) -> torch.Tensor:
    """A 2-D tensor's rows as ``[rows, nv, vec]`` words (see :func:`row_words`): a view. An input
    is copied first if it is not contiguous or does not start on a 16-byte boundary (vector
    accesses need both); an output (new memory from the caching allocator) never is."""
    if not t.is_contiguous() or t.data_ptr() % VECTOR_BYTES:
        if output:
            raise AssertionError("expand/unexpand outputs are new, contiguous, 16-byte aligned tensors")
        t = t.clone(memory_format=torch.contiguous_format)
    word_bytes, vec, nv = row_words(t.shape[1] * t.element_size())
    return t.view(torch.uint8).view(WORD_DTYPES[word_bytes]).view(t.shape[0], nv, vec)


def get_kernel_args(row_bytes: int) -> tuple[str, int, int]:
    """``(word, vec, tile_v)``: the specialization of both factories for rows of ``row_bytes``."""
    word_bytes, vec, nv = row_words(row_bytes)
    return tl_dtype(WORD_DTYPES[word_bytes]), vec, tile_vectors(nv)


def _zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Zeros of ``like``'s dtype and device, made as bytes (not every dtype has a fill kernel)."""
    *lead, last = shape
    return torch.zeros((*lead, last * like.element_size()), dtype=torch.uint8, device=like.device).view(like.dtype)


def _check(name: str, t: object, layout: object, rows: int | None) -> None:
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout: expected an ExpertLayout, got {type(layout).__name__}")
    check_tensor(name, t, shape=(rows, None), device=layout.pos_TK.device)
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a tensor on a CUDA device, got one on {t.device}")


def expand(x_TD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.permute.reference.expand` (same bits).

    Args:
        x_TD: [T, D] any dtype, on the layout's CUDA device.
        layout: an :class:`ExpertLayout` from ``expert_layout`` (``pos_TK`` and ``src_P`` inverse).

    Returns:
        x_PD: [P, D] same dtype; row p is ``x_TD[src_P[p] // K]``, zeros where ``src_P[p]`` is -1,
        unwritten past ``offsets_E[-1]``.
    """
    num_tokens = layout.pos_TK.shape[0] if isinstance(layout, ExpertLayout) else None
    _check("x_TD", x_TD, layout, num_tokens)
    p, d = layout.num_rows, x_TD.shape[1]
    if num_tokens == 0 or p * d == 0:  # every row (if any) is padding
        return _zeros((p, d), x_TD)
    x_PD = torch.empty((p, d), dtype=x_TD.dtype, device=x_TD.device)
    x_TNV = _as_vectors(x_TD)
    kernel = get_expand_kernel(*get_kernel_args(d * x_TD.element_size()))
    kernel(x_TNV, as_int32(layout.pos_TK), as_int32(layout.src_P), as_int32(layout.offsets_E), _as_vectors(x_PD, output=True))
    return x_PD


def unexpand(y_PD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.permute.reference.unexpand` (same bits).

    Args:
        y_PD: [P, D] any dtype, on the layout's CUDA device.
        layout: the :class:`ExpertLayout` that ``y_PD`` follows.

    Returns:
        y_TKD: [T, K, D] same dtype; ``y_TKD[t, k] = y_PD[pos_TK[t, k]]``, zeros where it is -1.
    """
    rows = layout.num_rows if isinstance(layout, ExpertLayout) else None
    _check("y_PD", y_PD, layout, rows)
    num_tokens, topk = layout.pos_TK.shape
    d = y_PD.shape[1]
    if rows == 0 or num_tokens * topk * d == 0:  # every route (if any) is masked
        return _zeros((num_tokens, topk, d), y_PD)
    y_TKD = torch.empty((num_tokens, topk, d), dtype=y_PD.dtype, device=y_PD.device)
    kernel = get_unexpand_kernel(*get_kernel_args(d * y_PD.element_size()))
    kernel(_as_vectors(y_PD), as_int32(layout.pos_TK).view(-1), _as_vectors(y_TKD.view(num_tokens * topk, d), output=True))
    return y_TKD
