"""TileLang kernel of :func:`kernels.comm.reference.receive_layout`: a small batch's receiving side
in one launch, :func:`kernels.comm.reference.plan_receive` and the local experts' layout
(:func:`kernels.permute.reference.expert_layout`) of what arrived.

The two ran as five launches (``plan_receive``, then the layout's fill, rank, scan and scatter
passes): 12.5 us of kernel time for 256 received rows of top-8 on an H100 (a
profile), made of launches and round trips to global memory between passes, not of work. Here one
CTA of ``THREADS`` threads holds the routes (at most ``ROUTES_PER_THREAD`` each, each warp a run of
consecutive routes, as long for every warp; at most ``MAX_ROUTES``):

1. each route's expert, read from the received metadata and checked against its sender's count
   (every load issued before the first store), stays in a register; its weight bits are stored as
   ``plan_receive`` stores them, and a row with a route here is marked in shared memory, so that
   its first route's thread stores the row's way back (rows without one have none);
2. per warp, 32 routes at a time, ``match_any_sync`` ranks the routes of each expert in route order
   (a warp's running counts per expert in shared memory), as the layout's rank pass does;
3. a thread per expert turns the warps' counts into exclusive prefixes and a total, and a scan over
   the experts' aligned totals (``kernels.scan``) gives the offsets;
4. each route's row is its expert's first row + its warp's prefix + its rank: ``pos``, and ``src_P``
   at that row (``src_P`` was filled with -1 first: padding rows read -1).

The results are the references' bits (positions ascending in route order within each expert).
Values are not checked on the host: ids outside this rank's experts, and rows past their sender's
count, are not this rank's routes (the references agree).

Shape suffixes: R = W * T_max received rows, K routes, M = 2K metadata words, W ranks, E local
experts, P layout rows.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.launch import launcher
from kernels.pdl import chained
from kernels.permute.reference import ExpertLayout
from kernels.scan import HAND_SYNC_CONFIGS, WARP, block_scan
from kernels.validate import check_tensor

from .reference import ReceivePlan

THREADS = 1024
ROUTES_PER_THREAD = 4
MAX_ROUTES = THREADS * ROUTES_PER_THREAD  # 512 received rows of top-8
MAX_EXPERTS = 512  # a warp's counts for every expert in shared memory: 64 KiB


def fits(num_routes: int, num_local_experts: int) -> bool:
    """Whether one CTA takes this batch (more routes or experts take the five launches)."""
    return num_routes <= MAX_ROUTES and num_local_experts <= MAX_EXPERTS


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_receive_layout_kernel(world: int, topk: int, num_experts: int, alignment: int):
    """``(meta_RM, count_W, local_idx_RK, weight_bits_RK, back_RW, counts_E, offsets_E, pos_R,
    src_P, rank, t_max)`` for ``num_experts`` local experts (R and P dynamic)."""
    num_rows, num_layout_rows = T.dynamic("num_rows"), T.dynamic("num_layout_rows")
    warps, max_rows = THREADS // WARP, MAX_ROUTES // topk
    scan = block_scan(1, warps)

    @T.prim_func
    def receive_layout_kernel(
        meta_RM: T.Tensor[(num_rows, 2 * topk), T.int32],
        count_W: T.Tensor[(world,), T.int32],
        local_idx_RK: T.Tensor[(num_rows, topk), T.int32],
        weight_bits_RK: T.Tensor[(num_rows, topk), T.int32],
        back_RW: T.Tensor[(num_rows, world), T.int32],
        counts_E: T.Tensor[(num_experts,), T.int32],
        offsets_E: T.Tensor[(num_experts,), T.int32],
        pos_R: T.Tensor[(num_rows * topk,), T.int32],
        src_P: T.Tensor[(num_layout_rows,), T.int32],
        rank: T.int32,
        t_max: T.int32,
    ):
        with T.Kernel(1, threads=THREADS):
            chained()
            tid = T.get_thread_binding()
            lane = tid % WARP
            warp = tid // WARP
            experts = T.alloc_local((ROUTES_PER_THREAD,), T.int32)
            ranks = T.alloc_local((ROUTES_PER_THREAD,), T.int32)
            bits = T.alloc_local((ROUTES_PER_THREAD,), T.int32)  # the routes' weights, as int32 bits
            counts_WE = T.alloc_shared((warps * num_experts,), T.int32)
            end_1 = T.alloc_local((1,), T.int32)
            totals_1Y = T.alloc_shared((1, warps), T.int32)
            first_E = T.alloc_shared((num_experts,), T.int32)
            mine_R = T.alloc_shared((max_rows,), T.int32)  # 1: the row has a route to this rank
            before = T.alloc_var(T.int32)
            total = T.alloc_var(T.int32)
            row_out = T.alloc_var(T.int32)
            row = T.alloc_var(T.int32)  # variables, not expressions: each computed once (one division)
            src = T.alloc_var(T.int32)
            num_routes = num_rows * topk
            rounds = T.ceildiv(num_routes, THREADS)  # routes a lane; a warp's run is rounds * 32 routes

            for s in T.serial(T.ceildiv(num_layout_rows, THREADS)):
                if s * THREADS + tid < num_layout_rows:
                    src_P[s * THREADS + tid] = -1
            for s in T.unroll(T.ceildiv(warps * num_experts, THREADS)):
                if s * THREADS + tid < warps * num_experts:
                    counts_WE[s * THREADS + tid] = 0
            for s in T.unroll(T.ceildiv(max_rows, THREADS)):
                if s * THREADS + tid < max_rows:
                    mine_R[s * THREADS + tid] = 0

            # 1. each route's expert, weight and its sender's count, all loaded before anything is
            # stored (the kernel waits for the one before it, so its pointers are not __restrict__:
            # a load after a store is not hoisted above it, and costs a round trip of its own)
            for j in T.unroll(ROUTES_PER_THREAD):
                route = (warp * rounds + j) * WARP + lane
                experts[j] = -1
                ranks[j] = 0
                bits[j] = 0
                if j < rounds and route < num_routes:
                    row = route // topk
                    src = row // t_max  # rows are >= 0: a truncating int32 division
                    experts[j] = meta_RM[row, route % topk] - rank * num_experts
                    bits[j] = meta_RM[row, topk + route % topk]
                    ranks[j] = count_W[src] - (row - src * t_max)  # > 0: among the rows src sent
            T.sync_threads()  # the zeroed counts and marks (issued loads do not wait for it)
            # then each route's local expert (-1: not this rank's), and plan_receive's stores
            for j in T.unroll(ROUTES_PER_THREAD):
                route = (warp * rounds + j) * WARP + lane
                if j < rounds and route < num_routes:
                    row = route // topk
                    if ranks[j] <= 0 or experts[j] < 0 or experts[j] >= num_experts:
                        experts[j] = -1
                    else:
                        mine_R[row] = 1
                    local_idx_RK[row, route % topk] = experts[j]
                    weight_bits_RK[row, route % topk] = T.if_then_else(experts[j] >= 0, bits[j], 0)
            T.sync_threads()  # the marks
            for j in T.unroll(ROUTES_PER_THREAD):
                route = (warp * rounds + j) * WARP + lane
                if j < rounds and route < num_routes and route % topk == 0:
                    row = route // topk
                    src = row // t_max
                    for w in T.unroll(world):
                        back_RW[row, w] = T.if_then_else(mine_R[row] == 1 and w == src, row + (rank - src) * t_max,
                                                         -1)

            # 2. ranks among the warp's routes of the same expert, in route order
            lanes_below = (T.uint32(1) << T.Cast(T.uint32, lane)) - T.uint32(1)
            for j in T.unroll(ROUTES_PER_THREAD):
                if j < rounds:  # the same for the whole CTA
                    peers = T.match_any_sync(experts[j])
                    below = T.Cast(T.int32, T.popcount(peers & lanes_below))
                    before = 0
                    if experts[j] >= 0:
                        before = counts_WE[warp * num_experts + experts[j]]
                    T.sync_warp()
                    if experts[j] >= 0 and below == 0:
                        counts_WE[warp * num_experts + experts[j]] = before + T.Cast(T.int32, T.popcount(peers))
                    ranks[j] = before + below
                    T.sync_warp()
            T.sync_threads()

            # 3. per expert: the warps' exclusive prefixes, the total, then the aligned offsets
            total = 0
            if tid < num_experts:
                for w in T.unroll(warps):
                    before = counts_WE[w * num_experts + tid]
                    counts_WE[w * num_experts + tid] = total
                    total = total + before
                counts_E[tid] = total
            end_1[0] = (total + alignment - 1) // alignment * alignment
            scan(end_1, totals_1Y, tid)  # over the experts (threads past E add nothing)
            if tid < num_experts:
                offsets_E[tid] = end_1[0]
                first_E[tid] = end_1[0] - (total + alignment - 1) // alignment * alignment
            T.sync_threads()

            # 4. each route's row
            for j in T.unroll(ROUTES_PER_THREAD):
                route = (warp * rounds + j) * WARP + lane
                if j < rounds and route < num_routes:
                    row_out = -1
                    if experts[j] >= 0:
                        row_out = first_E[experts[j]] + counts_WE[warp * num_experts + experts[j]] + ranks[j]
                        if row_out < num_layout_rows:
                            src_P[row_out] = route
                    pos_R[route] = row_out

    return receive_layout_kernel


def receive_layout(meta_RM: torch.Tensor, count_W: torch.Tensor, *, num_local_experts: int, rank: int,
                   max_tokens: int, alignment: int, num_rows: int) -> tuple[ReceivePlan, ExpertLayout]:
    """The TileLang twin of :func:`kernels.comm.reference.receive_layout` (same values), for a
    batch that :func:`fits`."""
    check_tensor("meta_RM", meta_RM, dtype=torch.int32, ndim=2)
    check_tensor("count_W", count_W, dtype=torch.int32, ndim=1, device=meta_RM.device)
    world, (rows, words) = count_W.shape[0], meta_RM.shape
    if rows != world * max_tokens or words % 2:
        raise ValueError(f"meta_RM: expected shape ({world * max_tokens}, 2 * K), got {tuple(meta_RM.shape)}")
    topk = words // 2
    if not fits(rows * topk, num_local_experts):
        raise ValueError(f"meta_RM: one CTA takes at most {MAX_ROUTES} routes and {MAX_EXPERTS} experts, got "
                         f"{rows * topk} routes ({rows} rows of {topk}) and {num_local_experts} experts")
    new = meta_RM.new_empty
    plan = ReceivePlan(local_idx_RK=new((rows, topk)), weights_RK=new((rows, topk)), back_RW=new((rows, world)))
    layout = ExpertLayout(counts_E=new(num_local_experts), offsets_E=new(num_local_experts), pos_TK=new((rows, topk)),
                          src_P=new(num_rows), alignment=alignment)
    launch = launcher(get_receive_layout_kernel(world, topk, num_local_experts, alignment))
    launch(meta_RM.contiguous(), count_W.contiguous(), plan.local_idx_RK, plan.weights_RK, plan.back_RW,
           layout.counts_E, layout.offsets_E, layout.pos_TK.view(-1), layout.src_P, rank, max_tokens)
    return ReceivePlan(local_idx_RK=plan.local_idx_RK, weights_RK=plan.weights_RK.view(torch.float32),
                       back_RW=plan.back_RW), layout
