"""TileLang kernels of :func:`kernels.comm.reference.plan_send` and
:func:`kernels.comm.reference.plan_receive`: the bookkeeping around a dispatch's stores, one launch
each instead of a few dozen small ones (what bounds a small batch's latency).

``plan_send`` is a thread per token. A CTA scans (``kernels.scan``, every rank at once) which ranks
its tokens go to: each token's slot among its CTA's, and the CTA's count per rank; it also copies
the ids and weight bits a token carries. Up to ``ONE_CTA_TOKENS`` tokens that CTA is the whole
batch, so it writes the final rows and counts itself (one launch); past that a second launch adds
to each slot the counts of the CTAs before it. Slots follow token order, so the result is
deterministic. (Session 4's single CTA, each thread walking a run of tokens with strided loads,
took 207 us of a 616 us dispatch at 4096 tokens on an H200.) ``plan_receive`` is a thread per
received row.

Each thread loads its row (ids, weight bits, metadata) into registers before it computes, and a
row's rank comes from comparisons with the ranks' expert ranges and its sender from one int32
division: 64-bit divisions by a runtime size, several per route as the straightforward indexing
lowers, were most of a small batch's ``plan_receive`` (7 us for 256 rows on an H100, session 11).

Values are not checked on the host (no host sync): an expert id outside ``[0, W * E_local)`` goes
nowhere, as -1 does (so does the reference).

Shape suffixes: T tokens, K routes, W ranks, M = 2K words of metadata, R = W * T_max rows.
"""

import functools

import tilelang
import torch
from tilelang import language as T

from kernels.pdl import chained
from kernels.scan import HAND_SYNC_CONFIGS, WARP, block_scan
from kernels.validate import check_tensor

from .reference import ReceivePlan, SendPlan

SEND_THREADS = 256  # tokens a CTA of a batch of several CTAs
ONE_CTA_TOKENS = 1024  # up to this many tokens, plan_send is one CTA and one launch
RECEIVE_THREADS = 256


def send_threads(num_tokens: int) -> int:
    """Threads (= tokens) of a ``plan_send`` CTA: the whole batch in one CTA where it fits."""
    if num_tokens <= ONE_CTA_TOKENS:
        return max(32, 1 << max(0, num_tokens - 1).bit_length())
    return SEND_THREADS


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_plan_send_kernel(world: int, topk: int, index_dtype: str = "int32", threads: int = SEND_THREADS):
    """``(idx_TK, weight_bits_TK, dest_TW, home_TW, meta_TM, block_BW, count_W, e_local, rank,
    t_max)``: per CTA of ``threads`` tokens, each token's slot among the CTA's tokens per rank, the
    CTA's count per rank (``block_BW``) and the metadata rows (ids as int32). A grid of one CTA
    writes the final ``dest_TW``, ``home_TW`` and ``count_W``; a larger one leaves the slots in
    ``dest_TW`` for :func:`get_plan_place_kernel` (``home_TW``, ``count_W`` untouched).
    ``index_dtype``: int32, or int64 as the router returns them (no conversion launch)."""
    num_tokens = T.dynamic("num_tokens")
    scan = block_scan(world, threads // WARP)

    @T.prim_func
    def plan_send_kernel(
        idx_TK: T.Tensor[(num_tokens, topk), index_dtype],
        weight_bits_TK: T.Tensor[(num_tokens, topk), T.int32],
        dest_TW: T.Tensor[(num_tokens, world), T.int32],
        home_TW: T.Tensor[(num_tokens, world), T.int32],
        meta_TM: T.Tensor[(num_tokens, 2 * topk), T.int32],
        block_BW: T.Tensor[(T.ceildiv(num_tokens, threads), world), T.int32],
        count_W: T.Tensor[(world,), T.int32],
        e_local: T.int32,
        rank: T.int32,
        t_max: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as b:
            chained()
            tid = T.get_thread_binding()
            token = b * threads + tid
            ids_K = T.alloc_local((topk,), T.int32)
            bits_K = T.alloc_local((topk,), T.int32)
            goes_W = T.alloc_local((world,), T.int32)
            upto_W = T.alloc_local((world,), T.int32)  # the CTA's tokens up to this one going to each rank
            totals_WY = T.alloc_shared((world, threads // WARP), T.int32)  # Y: warps
            for w in T.unroll(world):
                goes_W[w] = 0
            if token < num_tokens:
                for k in T.unroll(topk):
                    ids_K[k] = T.Cast(T.int32, idx_TK[token, k])
                    bits_K[k] = weight_bits_TK[token, k]
                for k in T.unroll(topk):
                    for w in T.unroll(world):  # rank w holds experts [w * e_local, (w + 1) * e_local)
                        if ids_K[k] >= w * e_local and ids_K[k] < (w + 1) * e_local:
                            goes_W[w] = 1
            for w in T.unroll(world):
                upto_W[w] = goes_W[w]
            scan(upto_W, totals_WY, tid)
            if tid == threads - 1:
                for w in T.unroll(world):
                    block_BW[b, w] = upto_W[w]
                    if T.ceildiv(num_tokens, threads) == 1:
                        count_W[w] = upto_W[w]
            if token < num_tokens:
                for k in T.unroll(topk):
                    meta_TM[token, k] = ids_K[k]
                    meta_TM[token, topk + k] = bits_K[k]
                for w in T.unroll(world):
                    slot = upto_W[w] - 1
                    if T.ceildiv(num_tokens, threads) == 1:
                        dest_TW[token, w] = T.if_then_else(goes_W[w] == 1, rank * t_max + slot, -1)
                        home_TW[token, w] = T.if_then_else(goes_W[w] == 1, w * t_max + slot, -1)
                    else:
                        dest_TW[token, w] = T.if_then_else(goes_W[w] == 1, slot, -1)

    return plan_send_kernel


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_plan_place_kernel(world: int):
    """Pass 2 of a batch of several CTAs, ``(dest_TW, home_TW, block_BW, count_W, rank, t_max)``:
    a CTA's base slot per rank is the sum of the earlier CTAs' counts; slots become rows of the
    receivers' buffers."""
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def plan_place_kernel(
        dest_TW: T.Tensor[(num_tokens, world), T.int32],
        home_TW: T.Tensor[(num_tokens, world), T.int32],
        block_BW: T.Tensor[(T.ceildiv(num_tokens, SEND_THREADS), world), T.int32],
        count_W: T.Tensor[(world,), T.int32],
        rank: T.int32,
        t_max: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, SEND_THREADS), threads=SEND_THREADS) as b:
            chained()
            tid = T.get_thread_binding()
            token = b * SEND_THREADS + tid
            base_W = T.alloc_shared((world,), T.int32)
            total = T.alloc_var(T.int32)
            slots_W = T.alloc_local((world,), T.int32)
            # every load before the first store (chained, so the pointers are not __restrict__)
            for w in T.unroll(world):
                slots_W[w] = T.if_then_else(token < num_tokens, dest_TW[token, w], -1)
            if tid < world:
                total = 0
                for i in T.serial(T.ceildiv(num_tokens, SEND_THREADS)):
                    if i == b:
                        base_W[tid] = total
                    total = total + block_BW[i, tid]
                if b == 0:
                    count_W[tid] = total
            T.sync_threads()
            if token < num_tokens:
                for w in T.unroll(world):
                    dest_TW[token, w] = T.if_then_else(slots_W[w] >= 0, rank * t_max + base_W[w] + slots_W[w], -1)
                    home_TW[token, w] = T.if_then_else(slots_W[w] >= 0, w * t_max + base_W[w] + slots_W[w], -1)

    return plan_place_kernel


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_plan_receive_kernel(world: int, topk: int):
    """``(meta_RM, count_W, local_idx_RK, weight_bits_RK, back_RW, e_local, rank, t_max)``."""
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def plan_receive_kernel(
        meta_RM: T.Tensor[(num_rows, 2 * topk), T.int32],
        count_W: T.Tensor[(world,), T.int32],
        local_idx_RK: T.Tensor[(num_rows, topk), T.int32],
        weight_bits_RK: T.Tensor[(num_rows, topk), T.int32],
        back_RW: T.Tensor[(num_rows, world), T.int32],
        e_local: T.int32,
        rank: T.int32,
        t_max: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_rows, RECEIVE_THREADS), threads=RECEIVE_THREADS) as block:
            chained()
            row = block * RECEIVE_THREADS + T.get_thread_binding()
            meta_M = T.alloc_local((2 * topk,), T.int32)
            src = T.alloc_var(T.int32)
            i = T.alloc_var(T.int32)
            valid = T.alloc_var(T.bool)
            if row < num_rows:
                src = row // t_max  # rows are >= 0: a truncating int32 division
                i = row - src * t_max
                for m in T.unroll(2 * topk):
                    meta_M[m] = meta_RM[row, m]
                valid = i < count_W[src]
                for k in T.unroll(topk):
                    mine = valid and meta_M[k] >= rank * e_local and meta_M[k] < (rank + 1) * e_local
                    local_idx_RK[row, k] = T.if_then_else(mine, meta_M[k] - rank * e_local, -1)
                    weight_bits_RK[row, k] = T.if_then_else(mine, meta_M[topk + k], 0)
                for w in T.unroll(world):
                    back_RW[row, w] = T.if_then_else(valid and w == src, rank * t_max + i, -1)

    return plan_receive_kernel


def plan_send(topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *, num_local_experts: int, world: int,
              rank: int, max_tokens: int) -> SendPlan:
    """The TileLang twin of :func:`kernels.comm.reference.plan_send` (same values)."""
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=tuple(topk_idx_TK.shape),
                 device=topk_idx_TK.device)
    num_tokens, topk = topk_idx_TK.shape
    new = functools.partial(torch.empty, dtype=torch.int32, device=topk_idx_TK.device)
    plan = SendPlan(dest_TW=new((num_tokens, world)), home_TW=new((num_tokens, world)), count_W=new((world,)),
                    meta_TM=new((num_tokens, 2 * topk)))
    if num_tokens == 0:
        plan.count_W.zero_()
        return plan
    threads = send_threads(num_tokens)
    block_BW = new((-(-num_tokens // threads), world))
    kernel = get_plan_send_kernel(world, topk, str(topk_idx_TK.dtype).removeprefix("torch."), threads)
    kernel(topk_idx_TK.contiguous(), topk_weights_TK.contiguous().view(torch.int32), plan.dest_TW, plan.home_TW,
           plan.meta_TM, block_BW, plan.count_W, num_local_experts, rank, max_tokens)
    if block_BW.shape[0] > 1:
        get_plan_place_kernel(world)(plan.dest_TW, plan.home_TW, block_BW, plan.count_W, rank, max_tokens)
    return plan


def plan_receive(meta_RM: torch.Tensor, count_W: torch.Tensor, *, num_local_experts: int, rank: int,
                 max_tokens: int) -> ReceivePlan:
    """The TileLang twin of :func:`kernels.comm.reference.plan_receive` (same values)."""
    check_tensor("meta_RM", meta_RM, dtype=torch.int32, ndim=2)
    check_tensor("count_W", count_W, dtype=torch.int32, ndim=1, device=meta_RM.device)
    world, (rows, words) = count_W.shape[0], meta_RM.shape
    if rows != world * max_tokens or words % 2:
        raise ValueError(f"meta_RM: expected shape ({world * max_tokens}, 2 * K), got {tuple(meta_RM.shape)}")
    topk = words // 2
    new = meta_RM.new_empty
    plan = ReceivePlan(local_idx_RK=new((rows, topk)), weights_RK=new((rows, topk)), back_RW=new((rows, world)))
    get_plan_receive_kernel(world, topk)(meta_RM.contiguous(), count_W.contiguous(), plan.local_idx_RK,
                                         plan.weights_RK, plan.back_RW, num_local_experts, rank, max_tokens)
    return ReceivePlan(local_idx_RK=plan.local_idx_RK, weights_RK=plan.weights_RK.view(torch.float32),
                       back_RW=plan.back_RW)
