"""TileLang kernel of :func:`kernels.comm.reference.receive_expand`: a small batch's receiving side
and its FP8 rows dequantized into the layout, in one launch.

The receiver's bookkeeping (``receive_layout``: one CTA, ~6 us for 256 received rows of top-8 on
an H100) ran after the routes' barrier and before ``expand_cast_back`` could store a row, both on
the dispatch's critical path. Here every CTA lays out the routes itself, as far as it needs them,
so the layout's latency is paid once in parallel instead of once in series:

1. every CTA loads all received routes (``THREADS`` threads, up to ``MAX_ROUTES`` routes, checked
   against their senders' counts), and a row CTA also its own row's routes, weights and FP8 row;
2. shared-memory atomics count each local expert's routes, and, for a row CTA, those in the rows
   before its own;
3. a scan over the experts' aligned totals (``kernels.scan``, each thread a run of experts) gives
   each segment's first row;
4. a row CTA's route k goes to its expert's first row + the routes before its row + the same
   expert's routes among the row's first k (``pos``, ``src_P`` there, ``plan_receive``'s stores),
   and its dequantized row is stored to each of them (as ``expand_cast_back`` does, one whole row a
   CTA); a padding CTA marks the padding rows among its ``PAD_ROWS`` layout rows from the experts'
   counts, zeroes them and stores -1 into ``src_P`` there and past the last segment.

Positions ascend in route order within each expert, as the references lay them out, so the results
are the references' bits for routes to distinct experts (a router's): the layout holds
``receive_rows`` rows, and routes past it (a row naming one local expert more than ``min(K, E)``
times in all) are dropped where the reference raises. Every CTA repeats the count (~8 KB of routes
from L2 at 256 rows of top-8): cheaper than a launch and a round trip through one CTA.

Shape suffixes: R = W * T_max received rows, K routes, M = 2K metadata words, W ranks, E local
experts, P layout rows, D hidden, G scale groups, S routes a thread counts, Y warps, Q a padding
CTA's layout rows.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.launch import launcher
from kernels.pdl import chained
from kernels.permute.reference import ExpertLayout
from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.tiles import tl_dtype, vector_layout, vector_width
from kernels.scan import HAND_SYNC_CONFIGS, WARP, block_scan
from kernels.validate import check_dtype, check_tensor, per_signature

from .reference import ReceivePlan, receive_rows

THREADS = 128
MAX_ROUTES = 4096  # every CTA counts every route: 32 a thread
MAX_EXPERTS = 512  # 4 a thread in the scan
PAD_ROWS = 16  # layout rows a padding CTA checks (and zeroes where they are padding), whole rows each
CONFIGS = {**HAND_SYNC_CONFIGS, tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}


def fits(world: int, max_tokens: int, topk: int, num_local_experts: int) -> bool:
    """Whether one launch takes the ``W * T_max`` received rows of ``topk`` routes."""
    return (world * max_tokens * topk <= MAX_ROUTES and num_local_experts <= MAX_EXPERTS and topk <= THREADS
            and world <= THREADS)


@tilelang.jit(pass_configs=CONFIGS)
def get_receive_expand_kernel(world: int, max_tokens: int, topk: int, num_experts: int, alignment: int,
                              hidden: int, group: int, out_dtype: str):
    """``(meta_RM, count_W, q_RD, sf_RG, local_idx_RK, weight_bits_RK, back_RW, counts_E, offsets_E,
    pos_RK, src_P, x_PD, rank)`` for ``num_experts`` local experts; every size is static (a
    dispatcher's receive buffers are)."""
    rows = world * max_tokens
    routes = rows * topk
    slots = -(-routes // THREADS)  # routes a thread counts
    run = -(-num_experts // THREADS)  # experts a thread scans
    num_rows = receive_rows(world, max_tokens, topk, num_experts, alignment)
    pad_blocks = -(-num_rows // PAD_ROWS)
    vec = vector_width(hidden, T.dtype(out_dtype).bytes)
    tile_n = -(-hidden // (THREADS * vec)) * THREADS * vec  # one whole row a CTA
    scan = block_scan(1, THREADS // WARP)

    def aligned(count):
        return (count + alignment - 1) // alignment * alignment

    @T.prim_func
    def receive_expand(
        meta_RM: T.Tensor[(rows, 2 * topk), T.int32],
        count_W: T.Tensor[(world,), T.int32],
        q_RD: T.Tensor[(rows, hidden), "float8_e4m3fn"],
        sf_RG: T.Tensor[(rows, T.ceildiv(hidden, group)), T.float32],
        local_idx_RK: T.Tensor[(rows, topk), T.int32],
        weight_bits_RK: T.Tensor[(rows, topk), T.int32],
        back_RW: T.Tensor[(rows, world), T.int32],
        counts_E: T.Tensor[(num_experts,), T.int32],
        offsets_E: T.Tensor[(num_experts,), T.int32],
        pos_RK: T.Tensor[(rows, topk), T.int32],
        src_P: T.Tensor[(num_rows,), T.int32],
        x_PD: T.Tensor[(num_rows, hidden), out_dtype],
        rank: T.int32,
    ):
        with T.Kernel(pad_blocks + rows, threads=THREADS) as pid:
            chained()
            tid = T.get_thread_binding()
            row = pid - pad_blocks  # this CTA's received row; < 0: a padding CTA
            src = row // max_tokens  # its sender (row >= 0 where used)
            expert_S = T.alloc_local((slots,), T.int32)  # each counted route's local expert, -1: none
            left_S = T.alloc_local((slots,), T.int32)  # > 0: its row is among those its sender sent
            own_1 = T.alloc_local((1,), T.int32)  # this thread's route of the CTA's row: its expert
            own_left_1 = T.alloc_local((1,), T.int32)
            own_bits_1 = T.alloc_local((1,), T.int32)  # and its weight's bits
            sum_1 = T.alloc_local((1,), T.int32)
            run_1 = T.alloc_local((1,), T.int32)
            q_frag = T.alloc_fragment((1, tile_n), "float8_e4m3fn")
            x_frag = T.alloc_fragment((1, tile_n), out_dtype)
            total_E = T.alloc_shared((num_experts,), T.int32)
            before_E = T.alloc_shared((num_experts,), T.int32)  # routes in the rows before this one
            first_E = T.alloc_shared((num_experts,), T.int32)
            totals_1Y = T.alloc_shared((1, THREADS // WARP), T.int32)
            expert_K = T.alloc_shared((topk,), T.int32)
            pos_K = T.alloc_shared((topk,), T.int32)
            pad_Q = T.alloc_shared((PAD_ROWS,), T.int32)  # 1: a padding row of this CTA
            layout = vector_layout(1, tile_n, THREADS, vec)
            T.annotate_layout({q_frag: layout, x_frag: layout})

            # 1. every load before the first store (the kernel waits for the one before it, so its
            # pointers are not __restrict__: a load after a store would cost a round trip of its own)
            for s in T.unroll(slots):
                route = s * THREADS + tid
                expert_S[s] = -1
                left_S[s] = 0
                if route < routes:
                    expert_S[s] = meta_RM[route // topk, route % topk] - rank * num_experts
                    left_S[s] = count_W[route // topk // max_tokens] - route // topk % max_tokens
            own_1[0] = -1
            own_left_1[0] = 0
            own_bits_1[0] = 0
            if T.And(row >= 0, tid < topk):
                own_1[0] = meta_RM[row, tid] - rank * num_experts
                own_left_1[0] = count_W[src] - (row - src * max_tokens)
                own_bits_1[0] = meta_RM[row, topk + tid]
            if row >= 0:  # the row's values, whether or not it holds data of this call: stored only if so
                T.copy(q_RD[row, 0], q_frag, disable_tma=True)
                for i, j in T.Parallel(1, tile_n):
                    x_frag[i, j] = T.cast(T.cast(q_frag[i, j], "float32") * sf_RG[row, j // group], out_dtype)
            for s in T.unroll(slots):  # -1 for every route that is not to a local expert
                if T.Or(T.Or(left_S[s] <= 0, expert_S[s] < 0), expert_S[s] >= num_experts):
                    expert_S[s] = -1
            if T.Or(T.Or(own_left_1[0] <= 0, own_1[0] < 0), own_1[0] >= num_experts):
                own_1[0] = -1
            for j in T.unroll(run):
                if j * THREADS + tid < num_experts:
                    total_E[j * THREADS + tid] = 0
                    before_E[j * THREADS + tid] = 0
            if tid < topk:
                expert_K[tid] = own_1[0]
            if tid < PAD_ROWS:
                pad_Q[tid] = 0
            T.sync_threads()

            # 2. each local expert's routes, and those in the rows before this one
            for s in T.unroll(slots):
                if expert_S[s] >= 0:
                    T.atomic_add(total_E[expert_S[s]], 1)
                    if s * THREADS + tid < row * topk:
                        T.atomic_add(before_E[expert_S[s]], 1)
            T.sync_threads()

            # 3. each segment's first row: a thread's run of experts, scanned over the threads
            sum_1[0] = 0
            for j in T.unroll(run):
                if tid * run + j < num_experts:
                    sum_1[0] = sum_1[0] + aligned(total_E[tid * run + j])
            run_1[0] = sum_1[0]
            scan(sum_1, totals_1Y, tid)  # inclusive: sum_1 - run_1 comes before this thread's run
            run_1[0] = sum_1[0] - run_1[0]
            for j in T.unroll(run):
                e = tid * run + j
                if e < num_experts:
                    first_E[e] = run_1[0]
                    run_1[0] = run_1[0] + aligned(total_E[e])
                    if pid == 0:
                        counts_E[e] = total_E[e]
                        offsets_E[e] = run_1[0]
            T.sync_threads()

            if row >= 0:
                # 4. the row's routes: rows, plan_receive's stores, then the dequantized row to each
                if tid < topk:
                    pos_K[tid] = -1
                    if own_1[0] >= 0:
                        sum_1[0] = 0  # the same expert among the row's earlier routes
                        for k in T.unroll(topk):
                            if T.And(k < tid, expert_K[k] == own_1[0]):
                                sum_1[0] = sum_1[0] + 1
                        pos_K[tid] = first_E[own_1[0]] + before_E[own_1[0]] + sum_1[0]
                        if pos_K[tid] < num_rows:
                            src_P[pos_K[tid]] = row * topk + tid
                    pos_RK[row, tid] = pos_K[tid]
                    local_idx_RK[row, tid] = own_1[0]
                    weight_bits_RK[row, tid] = T.if_then_else(own_1[0] >= 0, own_bits_1[0], 0)
                T.sync_threads()
                sum_1[0] = 0  # the row's routes here
                for k in T.unroll(topk):
                    if expert_K[k] >= 0:
                        sum_1[0] = sum_1[0] + 1
                if tid < world:
                    back_RW[row, tid] = T.if_then_else(T.And(sum_1[0] > 0, tid == src),
                                                       row + (rank - src) * max_tokens, -1)
                if sum_1[0] > 0:
                    for k in T.unroll(topk):
                        if T.And(pos_K[k] >= 0, pos_K[k] < num_rows):
                            for i, j in T.Parallel(1, tile_n):
                                x_PD[pos_K[k], j] = x_frag[i, j]
            else:
                # 4'. the padding rows among this CTA's: from each segment's count and end
                base = pid * PAD_ROWS
                for j in T.unroll(run):
                    e = tid * run + j
                    if e < num_experts:
                        start = T.max(first_E[e] + total_E[e], base)
                        end = T.min(first_E[e] + aligned(total_E[e]), base + PAD_ROWS)
                        for p in T.serial(T.max(end - start, 0)):
                            pad_Q[start + p - base] = 1
                T.sync_threads()
                used = first_E[num_experts - 1] + aligned(total_E[num_experts - 1])
                if tid < PAD_ROWS and base + tid < num_rows:
                    if T.Or(pad_Q[tid] == 1, base + tid >= used):
                        src_P[base + tid] = -1
                for r, j in T.Parallel(PAD_ROWS, hidden):
                    if T.And(pad_Q[r] == 1, base + r < num_rows):
                        x_PD[base + r, j] = T.cast(0, out_dtype)

    return receive_expand


def receive_expand(meta_RM: torch.Tensor, count_W: torch.Tensor, q_RD: torch.Tensor, sf_RG: torch.Tensor, *,
                   num_local_experts: int, rank: int, max_tokens: int, alignment: int, group: int,
                   out_dtype: torch.dtype) -> tuple[ReceivePlan, ExpertLayout, torch.Tensor]:
    """The TileLang twin of :func:`kernels.comm.reference.receive_expand` (same values; ``x_PD``
    unwritten past ``offsets_E[-1]``), for a batch that :func:`fits`, over ``receive_rows`` rows."""
    launch, rows, topk, world, num_rows = _plan(meta_RM, count_W, q_RD, sf_RG, num_local_experts, max_tokens, alignment,
                                                group, out_dtype)
    new = meta_RM.new_empty
    local_idx_RK, bits_RK, pos_RK, back_RW = new((rows, topk)), new((rows, topk)), new((rows, topk)), new((rows, world))
    counts_E, offsets_E, src_P = new(num_local_experts), new(num_local_experts), new(num_rows)
    x_PD = q_RD.new_empty((num_rows, q_RD.shape[1]), dtype=out_dtype)
    launch(meta_RM.contiguous(), count_W.contiguous(), q_RD.contiguous(), sf_RG.contiguous(), local_idx_RK, bits_RK,
           back_RW, counts_E, offsets_E, pos_RK, src_P, x_PD, rank)
    layout = ExpertLayout(counts_E=counts_E, offsets_E=offsets_E, pos_TK=pos_RK, src_P=src_P, alignment=alignment)
    return ReceivePlan(local_idx_RK=local_idx_RK, weights_RK=bits_RK.view(torch.float32), back_RW=back_RW), layout, x_PD


@per_signature
def _plan(meta_RM, count_W, q_RD, sf_RG, num_local_experts, max_tokens, alignment, group, out_dtype):
    """:func:`receive_expand`'s checks, its launch and sizes ``(R, K, W, P)``, once per signature of
    its arguments (``kernels.validate.per_signature``)."""
    check_tensor("meta_RM", meta_RM, dtype=torch.int32, ndim=2)
    check_tensor("count_W", count_W, dtype=torch.int32, ndim=1, device=meta_RM.device)
    world, (rows, words) = count_W.shape[0], meta_RM.shape
    if rows != world * max_tokens or words % 2:
        raise ValueError(f"meta_RM: expected shape ({world * max_tokens}, 2 * K), got {tuple(meta_RM.shape)}")
    topk, hidden = words // 2, q_RD.shape[-1]
    check_tensor("q_RD", q_RD, dtype=E4M3, shape=(rows, hidden), device=meta_RM.device)
    check_tensor("sf_RG", sf_RG, dtype=torch.float32, shape=(rows, -(-hidden // group)), device=meta_RM.device)
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    if not fits(world, max_tokens, topk, num_local_experts):
        raise ValueError(f"meta_RM: one launch takes at most {MAX_ROUTES} routes and {MAX_EXPERTS} experts, got "
                         f"{rows * topk} routes ({rows} rows of {topk}) and {num_local_experts} experts")
    num_rows = receive_rows(world, max_tokens, topk, num_local_experts, alignment)
    kernel = get_receive_expand_kernel(world, max_tokens, topk, num_local_experts, alignment, hidden, group,
                                       tl_dtype(out_dtype))
    return launcher(kernel), rows, topk, world, num_rows
