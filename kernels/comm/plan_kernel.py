"""TileLang kernels of :func:`kernels.comm.reference.plan_send` and
:func:`kernels.comm.reference.plan_receive`: the bookkeeping around a dispatch's stores, one launch
each instead of a few dozen small ones (what bounds a small batch's latency).

``plan_send`` is one CTA of ``SEND_THREADS`` threads, each owning a contiguous run of tokens: it
counts its tokens per destination rank, a Hillis-Steele scan over the threads turns the counts
into each run's first slot per rank, and a second walk writes the slots (and copies the ids and
weight bits a token carries). The data is small (``T * K`` ids), so one CTA suffices and the result
is deterministic. ``plan_receive`` is a thread per received row.

Values are not checked on the host (no host sync): an expert id outside ``[0, W * E_local)`` goes
nowhere, as -1 does (so does the reference).

Shape suffixes: T tokens, K routes, W ranks, M = 2K words of metadata, R = W * T_max rows.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.validate import check_tensor

from .reference import ReceivePlan, SendPlan

SEND_THREADS = 1024
RECEIVE_THREADS = 256
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_plan_send_kernel(world: int, topk: int):
    """``(idx_TK, weight_bits_TK, dest_TW, home_TW, count_W, meta_TM, e_local, rank, t_max)``."""
    num_tokens = T.dynamic("num_tokens")
    strides = [1 << i for i in range((SEND_THREADS - 1).bit_length())]

    @T.prim_func
    def plan_send_kernel(
        idx_TK: T.Tensor[(num_tokens, topk), T.int32],
        weight_bits_TK: T.Tensor[(num_tokens, topk), T.int32],
        dest_TW: T.Tensor[(num_tokens, world), T.int32],
        home_TW: T.Tensor[(num_tokens, world), T.int32],
        count_W: T.Tensor[(world,), T.int32],
        meta_TM: T.Tensor[(num_tokens, 2 * topk), T.int32],
        e_local: T.int32,
        rank: T.int32,
        t_max: T.int32,
    ):
        with T.Kernel(1, threads=SEND_THREADS):
            tid = T.get_thread_binding()
            run = T.ceildiv(num_tokens, SEND_THREADS)
            slot_W = T.alloc_local((world,), T.int32)
            goes_W = T.alloc_local((world,), T.int32)
            scan_XW = T.alloc_shared((SEND_THREADS * world,), T.int32)  # X: threads
            partial = T.alloc_var(T.int32)
            token = T.alloc_var(T.int32)
            for w in T.unroll(world):
                slot_W[w] = 0
            # Pass 1: this thread's tokens per destination rank.
            for j in T.serial(run):
                token = tid * run + j
                if token < num_tokens:
                    for w in T.unroll(world):
                        goes_W[w] = 0
                    for k in T.unroll(topk):
                        if idx_TK[token, k] >= 0 and idx_TK[token, k] < world * e_local:
                            goes_W[idx_TK[token, k] // e_local] = 1
                    for w in T.unroll(world):
                        slot_W[w] = slot_W[w] + goes_W[w]
            for w in T.unroll(world):
                scan_XW[tid * world + w] = slot_W[w]
            T.sync_threads()
            for w in T.unroll(world):
                for stride in strides:  # inclusive scan over the threads
                    partial = scan_XW[tid * world + w]
                    if tid >= stride:
                        partial = partial + scan_XW[(tid - stride) * world + w]
                    T.sync_threads()
                    scan_XW[tid * world + w] = partial
                    T.sync_threads()
            if tid < world:
                count_W[tid] = scan_XW[(SEND_THREADS - 1) * world + tid]
            for w in T.unroll(world):  # the run's first slot per rank
                slot_W[w] = scan_XW[tid * world + w] - slot_W[w]
            # Pass 2: slots, and what travels with each token.
            for j in T.serial(run):
                token = tid * run + j
                if token < num_tokens:
                    for w in T.unroll(world):
                        goes_W[w] = 0
                    for k in T.unroll(topk):
                        meta_TM[token, k] = idx_TK[token, k]
                        meta_TM[token, topk + k] = weight_bits_TK[token, k]
                        if idx_TK[token, k] >= 0 and idx_TK[token, k] < world * e_local:
                            goes_W[idx_TK[token, k] // e_local] = 1
                    for w in T.unroll(world):
                        dest_TW[token, w] = -1
                        home_TW[token, w] = -1
                        if goes_W[w] == 1:
                            dest_TW[token, w] = rank * t_max + slot_W[w]
                            home_TW[token, w] = w * t_max + slot_W[w]
                            slot_W[w] = slot_W[w] + 1

    return plan_send_kernel


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
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=torch.int32, ndim=2)
    check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=tuple(topk_idx_TK.shape),
                 device=topk_idx_TK.device)
    num_tokens, topk = topk_idx_TK.shape
    new = topk_idx_TK.new_empty
    plan = SendPlan(dest_TW=new((num_tokens, world)), home_TW=new((num_tokens, world)), count_W=new((world,)),
                    meta_TM=new((num_tokens, 2 * topk)))
    if num_tokens == 0:
        plan.count_W.zero_()
        return plan
    get_plan_send_kernel(world, topk)(topk_idx_TK.contiguous(), topk_weights_TK.contiguous().view(torch.int32),
                                      plan.dest_TW, plan.home_TW, plan.count_W, plan.meta_TM, num_local_experts,
                                      rank, max_tokens)
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
