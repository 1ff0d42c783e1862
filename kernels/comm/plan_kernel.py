"""TileLang kernels of :func:`kernels.comm.reference.plan_send` and
:func:`kernels.comm.reference.plan_receive`: the bookkeeping around a dispatch's stores, one launch
each instead of a few dozen small ones (what bounds a small batch's latency).

Both are a thread per row (token, or received row). A token's rows are fixed (its index in the
sender's block), so ``plan_send`` needs no scan over the batch; FP8 dispatch does its planning
inside ``put_tokens`` and launches no ``plan_send`` (session 15: the scan and its one-CTA launch were
5.2 us of a 256-token dispatch).

Each thread loads its row (ids, weight bits, metadata) into registers before it computes, and a
route's rank comes from comparisons with the ranks' expert ranges and a row's sender from one int32
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
from kernels.scan import HAND_SYNC_CONFIGS
from kernels.validate import check_tensor

from .reference import ReceivePlan, SendPlan

THREADS = 256


def goes_to(ids, w, e_local):
    """Whether any of a token's ids (a sequence of expressions) is one of rank w's experts
    ``[w * e_local, (w + 1) * e_local)``: comparisons, no division."""
    return functools.reduce(T.Or, [T.And(e >= w * e_local, e < (w + 1) * e_local) for e in ids])


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def get_plan_send_kernel(world: int, topk: int, index_dtype: str = "int32"):
    """``(idx_TK, weight_bits_TK, dest_TW, home_TW, meta_TM, e_local, rank, t_max)``; ids as the
    router returns them (``index_dtype`` int32 or int64: no conversion launch), int32 out."""
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def plan_send_kernel(
        idx_TK: T.Tensor[(num_tokens, topk), index_dtype],
        weight_bits_TK: T.Tensor[(num_tokens, topk), T.int32],
        dest_TW: T.Tensor[(num_tokens, world), T.int32],
        home_TW: T.Tensor[(num_tokens, world), T.int32],
        meta_TM: T.Tensor[(num_tokens, 2 * topk), T.int32],
        e_local: T.int32,
        rank: T.int32,
        t_max: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, THREADS), threads=THREADS) as b:
            chained()
            token = b * THREADS + T.get_thread_binding()
            ids_K = T.alloc_local((topk,), T.int32)
            bits_K = T.alloc_local((topk,), T.int32)
            if token < num_tokens:
                for k in T.unroll(topk):
                    ids_K[k] = T.Cast(T.int32, idx_TK[token, k])
                    bits_K[k] = weight_bits_TK[token, k]
                for k in T.unroll(topk):
                    meta_TM[token, k] = ids_K[k]
                    meta_TM[token, topk + k] = bits_K[k]
                for w in T.unroll(world):
                    goes = goes_to([ids_K[k] for k in range(topk)], w, e_local)
                    dest_TW[token, w] = T.if_then_else(goes, rank * t_max + token, -1)
                    home_TW[token, w] = T.if_then_else(goes, w * t_max + token, -1)

    return plan_send_kernel


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
        with T.Kernel(T.ceildiv(num_rows, THREADS), threads=THREADS) as block:
            chained()
            row = block * THREADS + T.get_thread_binding()
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
                    back_RW[row, w] = T.if_then_else(
                        valid and w == src and goes_to([meta_M[k] for k in range(topk)], rank, e_local),
                        rank * t_max + i, -1)

    return plan_receive_kernel


def plan_send(topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *, num_local_experts: int, world: int,
              rank: int, max_tokens: int) -> SendPlan:
    """The TileLang twin of :func:`kernels.comm.reference.plan_send` (same values)."""
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=tuple(topk_idx_TK.shape),
                 device=topk_idx_TK.device)
    num_tokens, topk = topk_idx_TK.shape
    if num_tokens > max_tokens:
        raise ValueError(f"topk_idx_TK: expected at most max_tokens={max_tokens} tokens, got {num_tokens}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world} (the regions' ranks), got {rank}")
    new = functools.partial(torch.empty, dtype=torch.int32, device=topk_idx_TK.device)
    plan = SendPlan(dest_TW=new((num_tokens, world)), home_TW=new((num_tokens, world)),
                    meta_TM=new((num_tokens, 2 * topk)))
    if num_tokens:
        kernel = get_plan_send_kernel(world, topk, str(topk_idx_TK.dtype).removeprefix("torch."))
        kernel(topk_idx_TK.contiguous(), topk_weights_TK.contiguous().view(torch.int32), plan.dest_TW, plan.home_TW,
               plan.meta_TM, num_local_experts, rank, max_tokens)
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
