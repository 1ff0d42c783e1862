"""TileLang kernels of :func:`kernels.permute.reference.expert_layout`, without a host sync.

The layout needs a static row count: ``num_rows`` must be given and at least
:func:`kernels.permute.reference.max_rows` (the reference's ``num_rows=None`` reads
``offsets_E[-1]`` on the host; :mod:`kernels.permute` does that read after these kernels when asked).

Three launches, deterministic (no order-dependent atomics):

1. rank (``NUM_BLOCKS`` CTAs of ``WARPS`` warps): each warp walks its contiguous run of routes 32 at
   a time; ``match_any_sync`` finds the lanes with the same expert, so a route's rank among its
   expert's routes in the run is a running per-warp count in shared memory plus the number of
   matching lower lanes. A scan over the warps then turns ranks into ranks within the CTA's chunk,
   ascending in ``r = t * K + k``, and the CTA writes its per-expert totals.
2. scan (one CTA, a thread per expert): totals over the CTAs give ``counts_E``; padded to the
   alignment and scanned over experts they give ``offsets_E``; each CTA's first row per expert
   follows.
3. scatter (a thread per route): row = CTA's first row for the expert + rank; writes ``pos_TK``
   and ``src_P`` (pre-filled with -1, so padding rows read -1).

A small batch (up to ``ONE_CTA_ROUTES`` routes, up to ``ONE_CTA_EXPERTS`` experts: a dispatch's
received rows at 128 tokens a rank) runs the same three passes in one CTA, barriers in place of
launches, and fills ``src_P`` itself: one launch instead of four, the launches being what such a
layout's time is made of (rank + scan + scatter 6.2 us for 256 tokens of top-8 on an H100). The
passes are macros shared by both forms.

Values are not checked on the host (no host sync): entries outside ``[0, E)`` are treated as
masked routes.

Shape suffixes:
    T  tokens
    K  routes per token
    E  experts
    R  flattened routes, T * K
    P  layout rows
    B  CTAs of the rank pass (NUM_BLOCKS)
"""

import functools

import tilelang
import torch
from tilelang import language as T

from kernels.pdl import chained
from kernels.tiles import check_cuda
from kernels.scan import HAND_SYNC_CONFIGS, WARP, block_scan
from kernels.validate import check_positive, check_tensor

from .reference import INDEX_DTYPES, ExpertLayout, max_rows

WARPS = 16
NUM_BLOCKS = 32
SCATTER_THREADS = 256
MAX_EXPERTS = 1024
# A small batch's layout in one CTA (one launch): up to 4 routes a thread (the rank pass walks them
# 32 at a time a warp, one L2 round trip each) and a warp's counts for up to 512 experts (64 KiB).
ONE_CTA_THREADS = 1024
ONE_CTA_ROUTES = 4 * ONE_CTA_THREADS
ONE_CTA_EXPERTS = 512
INDEX_DTYPE_NAMES = {torch.int32: "int32", torch.int64: "int64"}


@T.macro
def _rank_routes(topk_idx_R, rank_R, block_counts_BE, counts_WE, num_routes, block, chunk, thread,
                 warps: int, num_experts: int):
    """Pass 1 for CTA ``block`` of ``warps`` warps over its ``chunk`` routes (see the module doc):
    ``rank_R`` within the chunk, the chunk's totals into ``block_counts_BE[block]``."""
    lane = thread % WARP
    warp = thread // WARP
    expert = T.alloc_var(T.int32)
    before = T.alloc_var(T.int32)
    running = T.alloc_var(T.int32)
    for s in T.serial(T.ceildiv(warps * num_experts, warps * WARP)):
        if s * warps * WARP + thread < warps * num_experts:
            counts_WE[s * warps * WARP + thread] = 0
    T.sync_threads()

    first_route = block * chunk + warp * (chunk // warps)
    lanes_below = (T.uint32(1) << T.Cast(T.uint32, lane)) - T.uint32(1)
    for j in T.serial(chunk // warps // WARP):
        route = first_route + j * WARP + lane
        expert = -1
        if route < num_routes:
            expert = T.Cast(T.int32, topk_idx_R[route])
            if expert >= num_experts:
                expert = -1
        peers = T.match_any_sync(expert)
        below = T.Cast(T.int32, T.popcount(peers & lanes_below))
        before = 0
        if expert >= 0:
            before = counts_WE[warp * num_experts + expert]
        T.sync_warp()
        if expert >= 0:
            if below == 0:
                counts_WE[warp * num_experts + expert] = before + T.Cast(T.int32, T.popcount(peers))
            rank_R[route] = before + below
        T.sync_warp()
    T.sync_threads()

    # Per expert: exclusive scan over the warps, and the CTA's total.
    for s in T.serial(T.ceildiv(num_experts, warps * WARP)):
        e = s * warps * WARP + thread
        if e < num_experts:
            running = 0
            for w in T.unroll(warps):
                before = counts_WE[w * num_experts + e]
                counts_WE[w * num_experts + e] = running
                running = running + before
            block_counts_BE[block, e] = running
    T.sync_threads()

    for j in T.serial(chunk // warps // WARP):
        route = first_route + j * WARP + lane
        expert = -1
        if route < num_routes:
            expert = T.Cast(T.int32, topk_idx_R[route])
            if expert >= num_experts:
                expert = -1
        if expert >= 0:
            rank_R[route] = rank_R[route] + counts_WE[warp * num_experts + expert]


@T.macro
def _scan_experts(block_counts_BE, counts_E, offsets_E, block_start_BE, end_1, totals_1Y, e, column_B, scan,
                  blocks: int, num_experts: int, alignment: int):
    """Pass 2 with a thread ``e`` per expert (the CTA's other threads only keep the barriers of
    ``scan``, a :func:`kernels.scan.block_scan` of one value over the CTA, ``totals_1Y`` its
    scratch): ``counts_E``, aligned end offsets, and each of ``blocks`` CTAs' first row per expert."""
    total = T.alloc_var(T.int32)
    row = T.alloc_var(T.int32)
    total = 0
    if e < num_experts:
        for b in T.unroll(blocks):
            column_B[b] = block_counts_BE[b, e]
            total = total + column_B[b]
        counts_E[e] = total
    end_1[0] = (total + alignment - 1) // alignment * alignment
    scan(end_1, totals_1Y, e)
    if e < num_experts:
        offsets_E[e] = end_1[0]
        row = end_1[0] - (total + alignment - 1) // alignment * alignment
        for b in T.unroll(blocks):
            block_start_BE[b, e] = row
            row = row + column_B[b]


@T.macro
def _scatter_route(topk_idx_R, rank_R, block_start_BE, pos_R, src_P, num_routes, num_rows, route, chunk,
                   blocks: int, num_experts: int):
    """Pass 3 for one route: its row (the first row of its chunk's CTA for its expert + its rank)
    into ``pos_R``, and the route into ``src_P`` at that row."""
    expert = T.alloc_var(T.int32)
    row = T.alloc_var(T.int32)
    if route < num_routes:
        expert = T.Cast(T.int32, topk_idx_R[route])
        row = -1
        if expert >= 0 and expert < num_experts:
            row = block_start_BE[0 if blocks == 1 else route // chunk, expert] + rank_R[route]
            if row < num_rows:
                src_P[row] = route
        pos_R[route] = row


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_expert_layout_rank_kernel(num_experts: int, index_dtype: str):
    """Pass 1: ranks within each CTA's chunk and per-CTA totals (the route count is dynamic)."""
    num_routes = T.dynamic("num_routes")

    @T.prim_func
    def expert_layout_rank_kernel(
        topk_idx_R: T.Tensor[(num_routes,), index_dtype],
        rank_R: T.Tensor[(num_routes,), T.int32],
        block_counts_BE: T.Tensor[(NUM_BLOCKS, num_experts), T.int32],
        chunk: T.int32,
    ):
        with T.Kernel(NUM_BLOCKS, threads=WARPS * WARP) as block:
            chained()
            counts_WE = T.alloc_shared((WARPS * num_experts,), T.int32)
            _rank_routes(topk_idx_R, rank_R, block_counts_BE, counts_WE, num_routes, block, chunk,
                         T.get_thread_binding(), WARPS, num_experts)

    return expert_layout_rank_kernel


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_expert_layout_scan_kernel(num_experts: int, alignment: int):
    """Pass 2: counts, aligned end offsets, and each CTA's first row per expert."""
    threads = max(WARP, 1 << (num_experts - 1).bit_length())
    scan = block_scan(1, threads // WARP)

    @T.prim_func
    def expert_layout_scan_kernel(
        block_counts_BE: T.Tensor[(NUM_BLOCKS, num_experts), T.int32],
        counts_E: T.Tensor[(num_experts,), T.int32],
        offsets_E: T.Tensor[(num_experts,), T.int32],
        block_start_BE: T.Tensor[(NUM_BLOCKS, num_experts), T.int32],
    ):
        with T.Kernel(1, threads=threads):
            chained()
            column_B = T.alloc_local((NUM_BLOCKS,), T.int32)
            end_1 = T.alloc_local((1,), T.int32)
            totals_1Y = T.alloc_shared((1, threads // WARP), T.int32)
            _scan_experts(block_counts_BE, counts_E, offsets_E, block_start_BE, end_1, totals_1Y,
                          T.get_thread_binding(), column_B, scan, NUM_BLOCKS, num_experts, alignment)

    return expert_layout_scan_kernel


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_expert_layout_scatter_kernel(num_experts: int, index_dtype: str):
    """Pass 3: ``pos_R`` and ``src_P`` (the route and row counts are dynamic)."""
    num_routes = T.dynamic("num_routes")
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def expert_layout_scatter_kernel(
        topk_idx_R: T.Tensor[(num_routes,), index_dtype],
        rank_R: T.Tensor[(num_routes,), T.int32],
        block_start_BE: T.Tensor[(NUM_BLOCKS, num_experts), T.int32],
        pos_R: T.Tensor[(num_routes,), T.int32],
        src_P: T.Tensor[(num_rows,), T.int32],
        chunk: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_routes, SCATTER_THREADS), threads=SCATTER_THREADS) as block:
            chained()
            _scatter_route(topk_idx_R, rank_R, block_start_BE, pos_R, src_P, num_routes, num_rows,
                           block * SCATTER_THREADS + T.get_thread_binding(), chunk, NUM_BLOCKS, num_experts)

    return expert_layout_scatter_kernel


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_expert_layout_one_cta_kernel(num_experts: int, alignment: int, index_dtype: str):
    """The three passes in one CTA of ``ONE_CTA_THREADS`` threads, for at most ``ONE_CTA_ROUTES``
    routes (a small batch: one launch instead of four with ``src_P``'s fill). Barriers stand for
    the launches between the passes (``__syncthreads`` also orders the CTA's global stores)."""
    num_routes = T.dynamic("num_routes")
    num_rows = T.dynamic("num_rows")
    warps = ONE_CTA_THREADS // WARP
    scan = block_scan(1, warps)

    @T.prim_func
    def expert_layout_one_cta_kernel(
        topk_idx_R: T.Tensor[(num_routes,), index_dtype],
        rank_R: T.Tensor[(num_routes,), T.int32],
        block_counts_BE: T.Tensor[(1, num_experts), T.int32],
        counts_E: T.Tensor[(num_experts,), T.int32],
        offsets_E: T.Tensor[(num_experts,), T.int32],
        block_start_BE: T.Tensor[(1, num_experts), T.int32],
        pos_R: T.Tensor[(num_routes,), T.int32],
        src_P: T.Tensor[(num_rows,), T.int32],
        chunk: T.int32,
    ):
        with T.Kernel(1, threads=ONE_CTA_THREADS):
            chained()
            thread = T.get_thread_binding()
            counts_WE = T.alloc_shared((warps * num_experts,), T.int32)
            column_B = T.alloc_local((1,), T.int32)
            end_1 = T.alloc_local((1,), T.int32)
            totals_1Y = T.alloc_shared((1, warps), T.int32)
            _rank_routes(topk_idx_R, rank_R, block_counts_BE, counts_WE, num_routes, 0, chunk, thread, warps,
                         num_experts)
            _scan_experts(block_counts_BE, counts_E, offsets_E, block_start_BE, end_1, totals_1Y, thread, column_B,
                          scan, 1, num_experts, alignment)
            for s in T.serial(T.ceildiv(num_rows, ONE_CTA_THREADS)):
                if s * ONE_CTA_THREADS + thread < num_rows:
                    src_P[s * ONE_CTA_THREADS + thread] = -1
            T.sync_threads()
            for s in T.serial(T.ceildiv(num_routes, ONE_CTA_THREADS)):
                _scatter_route(topk_idx_R, rank_R, block_start_BE, pos_R, src_P, num_routes, num_rows,
                               s * ONE_CTA_THREADS + thread, chunk, 1, num_experts)

    return expert_layout_one_cta_kernel


def expert_layout(
    topk_idx_TK: torch.Tensor, num_experts: int, *, alignment: int = 128, num_rows: int, routes_per_token: int | None = None
) -> ExpertLayout:
    """:func:`kernels.permute.reference.expert_layout` on the GPU, with a static row count.

    Args:
        topk_idx_TK: [T, K] int32 or int64 on a CUDA device (a strided view is copied first);
            experts in [0, E) or -1.
        num_experts: E, at most 1024.
        alignment: segment lengths are multiples of it.
        num_rows: P, at least ``max_rows(T, routes_per_token, E, alignment)`` so that no batch can
            overflow it.
        routes_per_token: the most unmasked routes a token has (default K); trusted, not checked
            (that would cost a host sync): rows a token has beyond it may fall past ``num_rows``.

    Returns:
        The :class:`ExpertLayout` (int32 tensors; ``src_P`` has ``num_rows`` rows).
    """
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=INDEX_DTYPES, ndim=2)
    check_cuda("topk_idx_TK", topk_idx_TK)
    _check_sizes(num_experts, alignment)
    num_tokens, topk = topk_idx_TK.shape
    capacity = max_rows(num_tokens, routes_per_token or topk, num_experts, alignment)
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < capacity:
        raise ValueError(f"num_rows: expected an int >= {capacity} (max_rows for this batch), got {num_rows!r}")
    device = topk_idx_TK.device
    num_routes = num_tokens * topk
    fill = torch.empty if num_routes else torch.zeros  # the scan pass writes every entry
    counts_E = fill(num_experts, dtype=torch.int32, device=device)
    offsets_E = fill(num_experts, dtype=torch.int32, device=device)
    pos_TK = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    one_cta = num_routes <= ONE_CTA_ROUTES and num_experts <= ONE_CTA_EXPERTS
    if one_cta and num_routes:  # the kernel fills it
        src_P = torch.empty(num_rows, dtype=torch.int32, device=device)
    else:
        src_P = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    layout = ExpertLayout(counts_E=counts_E, offsets_E=offsets_E, pos_TK=pos_TK, src_P=src_P, alignment=alignment)
    if not num_routes:
        return layout

    blocks = 1 if one_cta else NUM_BLOCKS
    per_pass = ONE_CTA_THREADS if one_cta else WARPS * WARP
    chunk = -(-num_routes // (blocks * per_pass)) * per_pass  # routes per CTA, a multiple of per_pass
    topk_idx_R = topk_idx_TK.contiguous().view(-1)  # a view of a wider tensor is copied
    rank_R = torch.empty(num_routes, dtype=torch.int32, device=device)
    block_counts_BE = torch.empty(blocks, num_experts, dtype=torch.int32, device=device)
    block_start_BE = torch.empty_like(block_counts_BE)
    if one_cta:
        _one_cta_kernel(num_experts, alignment, topk_idx_TK.dtype)(
            topk_idx_R, rank_R, block_counts_BE, counts_E, offsets_E, block_start_BE, pos_TK.view(-1), src_P, chunk)
        return layout
    rank_kernel, scan_kernel, scatter_kernel = _layout_kernels(num_experts, alignment, topk_idx_TK.dtype)
    rank_kernel(topk_idx_R, rank_R, block_counts_BE, chunk)
    scan_kernel(block_counts_BE, counts_E, offsets_E, block_start_BE)
    scatter_kernel(topk_idx_R, rank_R, block_start_BE, pos_TK.view(-1), src_P, chunk)
    return layout


def _check_sizes(num_experts: int, alignment: int) -> None:
    check_positive("num_experts", num_experts)
    check_positive("alignment", alignment)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: expected at most {MAX_EXPERTS}, got {num_experts}")


@functools.cache
def _layout_kernels(num_experts: int, alignment: int, index_dtype: torch.dtype):
    """The three compiled passes (cached: known arguments cost a dictionary look-up)."""
    dtype = INDEX_DTYPE_NAMES[index_dtype]
    return (
        get_expert_layout_rank_kernel(num_experts, dtype),
        get_expert_layout_scan_kernel(num_experts, alignment),
        get_expert_layout_scatter_kernel(num_experts, dtype),
    )


@functools.cache
def _one_cta_kernel(num_experts: int, alignment: int, index_dtype: torch.dtype):
    return get_expert_layout_one_cta_kernel(num_experts, alignment, INDEX_DTYPE_NAMES[index_dtype])
