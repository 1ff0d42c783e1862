"""TileLang kernels of :func:`kernels.comm.reference.plan_send` and
:func:`kernels.comm.reference.plan_receive`: the bookkeeping around a dispatch's stores, one launch
each instead of a few dozen small ones (what bounds a small batch's latency).

``plan_send`` is two launches with a thread per token. The first, in CTAs of ``SEND_THREADS``
tokens, scans (Hillis-Steele, every rank at once) which ranks the CTA's tokens go to: each token's
slot among its CTA's, and the CTA's count per rank; it also copies the ids and weight bits a token
carries. The second adds to each slot the counts of the CTAs before it. Slots follow token order,
so the result is deterministic. (Session 4's single CTA, each thread walking a run of tokens with
strided loads, took 207 us of a 616 us dispatch at 4096 tokens on an H200.) ``plan_receive`` is a
thread per received row.

Values are not checked on the host (no host sync): an expert id outside ``[0, W * E_local)`` goes
nowhere, as -1 does (so does the reference).

Shape suffixes: T tokens, K routes, W ranks, M = 2K words of metadata, R = W * T_max rows.
"""

import functools

import tilelang
import torch
from tilelang import language as T

from kernels.validate import check_tensor

from .reference import ReceivePlan, SendPlan

SEND_THREADS = 256
RECEIVE_THREADS = 256
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


@T.macro
def _destinations(idx_TK, token, num_tokens, goes_W, world: int, topk: int, e_local):
    """``goes_W[w] = 1`` when ``token`` has a route to an expert of rank ``w`` (0 past the end)."""
    for w in T.unroll(world):
        goes_W[w] = 0
    if token < num_tokens:
        for k in T.unroll(topk):
            if idx_TK[token, k] >= 0 and idx_TK[token, k] < world * e_local:
                goes_W[idx_TK[token, k] // e_local] = 1


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_plan_send_kernel(world: int, topk: int, index_dtype: str = "int32"):
    """Pass 1, ``(idx_TK, weight_bits_TK, dest_TW, meta_TM, block_BW, e_local)``: per CTA of
    ``SEND_THREADS`` tokens, each token's slot among the CTA's tokens per rank (into ``dest_TW``,
    -1 where it does not go), the CTA's count per rank (``block_BW``), and the metadata rows (ids
    as int32). ``index_dtype``: int32, or int64 as the router returns them (no conversion launch)."""
    num_tokens = T.dynamic("num_tokens")
    strides = [1 << i for i in range((SEND_THREADS - 1).bit_length())]

    @T.prim_func
    def plan_send_kernel(
        idx_TK: T.Tensor[(num_tokens, topk), index_dtype],
        weight_bits_TK: T.Tensor[(num_tokens, topk), T.int32],
        dest_TW: T.Tensor[(num_tokens, world), T.int32],
        meta_TM: T.Tensor[(num_tokens, 2 * topk), T.int32],
        block_BW: T.Tensor[(T.ceildiv(num_tokens, SEND_THREADS), world), T.int32],
        e_local: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, SEND_THREADS), threads=SEND_THREADS) as b:
            tid = T.get_thread_binding()
            token = b * SEND_THREADS + tid
            goes_W = T.alloc_local((world,), T.int32)
            partial_W = T.alloc_local((world,), T.int32)
            scan_XW = T.alloc_shared((SEND_THREADS, world), T.int32)  # X: threads
            _destinations(idx_TK, token, num_tokens, goes_W, world, topk, e_local)
            for w in T.unroll(world):
                scan_XW[tid, w] = goes_W[w]
            T.sync_threads()
            for stride in strides:  # inclusive scan over the threads, every rank at once
                for w in T.unroll(world):
                    partial_W[w] = scan_XW[tid, w]
                    if tid >= stride:
                        partial_W[w] = partial_W[w] + scan_XW[tid - stride, w]
                T.sync_threads()
                for w in T.unroll(world):
                    scan_XW[tid, w] = partial_W[w]
                T.sync_threads()
            if tid < world:
                block_BW[b, tid] = scan_XW[SEND_THREADS - 1, tid]
            if token < num_tokens:
                for k in T.unroll(topk):
                    meta_TM[token, k] = T.Cast("int32", idx_TK[token, k])
                    meta_TM[token, topk + k] = weight_bits_TK[token, k]
                for w in T.unroll(world):
                    dest_TW[token, w] = T.if_then_else(goes_W[w] == 1, scan_XW[tid, w] - 1, -1)

    return plan_send_kernel


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_plan_place_kernel(world: int):
    """Pass 2, ``(dest_TW, home_TW, block_BW, count_W, rank, t_max)``: a CTA's base slot per rank
    is the sum of the earlier CTAs' counts; slots become rows of the receivers' buffers."""
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
            tid = T.get_thread_binding()
            token = b * SEND_THREADS + tid
            base_W = T.alloc_shared((world,), T.int32)
            total = T.alloc_var(T.int32)
            slot = T.alloc_var(T.int32)
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
                    slot = dest_TW[token, w]
                    dest_TW[token, w] = -1
                    home_TW[token, w] = -1
                    if slot >= 0:
                        dest_TW[token, w] = rank * t_max + base_W[w] + slot
                        home_TW[token, w] = w * t_max + base_W[w] + slot

    return plan_place_kernel


@tilelang.jit(pass_configs=PASS_CONFIGS)
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
            row = block * RECEIVE_THREADS + T.get_thread_binding()
            if row < num_rows:
                src = row // t_max
                i = row % t_max
                valid = i < count_W[src]
                for k in T.unroll(topk):
                    local_idx_RK[row, k] = -1
                    weight_bits_RK[row, k] = 0
                    if valid and meta_RM[row, k] >= rank * e_local and meta_RM[row, k] < (rank + 1) * e_local:
                        local_idx_RK[row, k] = meta_RM[row, k] - rank * e_local
                        weight_bits_RK[row, k] = meta_RM[row, topk + k]
                for w in T.unroll(world):
                    back_RW[row, w] = -1
                    if valid and w == src:
                        back_RW[row, w] = rank * t_max + i

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
    block_BW = new((-(-num_tokens // SEND_THREADS), world))
    kernel = get_plan_send_kernel(world, topk, str(topk_idx_TK.dtype).removeprefix("torch."))
    kernel(topk_idx_TK.contiguous(), topk_weights_TK.contiguous().view(torch.int32), plan.dest_TW, plan.meta_TM, block_BW,
           num_local_experts)
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
