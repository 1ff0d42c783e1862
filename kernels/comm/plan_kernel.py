"""TileLang kernels of :func:`kernels.comm.reference.put_routes` and
:func:`kernels.comm.reference.plan_receive`: the bookkeeping around a dispatch's rows, one launch
each instead of a few dozen small ones (what bounds a small batch's latency).

Both are a thread per row (token, or received row). A token's rows are fixed (its index in the
sender's block), so ``put_routes`` needs no scan over the batch: each thread plans its token's way
there and back and stores the token's routes (2K words) into every rank's region, the first thread
the count. It runs beside the rows (``put_tokens`` or ``put_rows``), on a stream of its own in the
``nvlink`` dispatcher, so the receivers lay the routes out while the rows travel.

Each thread loads its row (ids, weight bits, metadata) into registers before it computes, and a
route's rank comes from comparisons with the ranks' expert ranges and a row's sender from one int32
division: 64-bit divisions by a runtime size, several per route as the straightforward indexing
lowers, were most of a small batch's ``plan_receive`` (7 us for 256 rows on an H100).

Values are not checked on the host (no host sync): ``put_routes`` checks each token's routes on
the device (:func:`assert_routes`), where the reference raises.

Shape suffixes: T tokens, K routes, W ranks, M = 2K words of metadata, R = W * T_max rows.
"""

import functools
import math

import tilelang
import torch
from tilelang import language as T
from tvm import tirx

from kernels.launch import launcher
from kernels.pdl import chained
from kernels.tiles import PEER_PASS_CONFIGS
from kernels.scan import HAND_SYNC_CONFIGS
from kernels.validate import check_tensor

from .put_rows_kernel import peer_copy
from .reference import ReceivePlan, RouteRegions

THREADS = 256
MAX_TOPK = 16  # put_routes stages THREADS tokens' 2K words in shared memory: 32 KB at 16
ROUTES_MESSAGE = "topk_idx_TK: expected expert ids in [0, num_experts) or -1, distinct per token"


def goes_to(ids, w, e_local):
    """Whether any of a token's ids (a sequence of expressions) is one of rank w's experts
    ``[w * e_local, (w + 1) * e_local)``: comparisons, no division."""
    return functools.reduce(T.Or, [T.And(e >= w * e_local, e < (w + 1) * e_local) for e in ids])


def routes_valid(ids, num_experts):
    """Whether a token's ids (expressions, as the router gave them) are each -1 or an expert of
    ``[0, num_experts)``, the experts distinct: :func:`kernels.validate.check_routes` on the device."""
    bound = [T.Cast(e.dtype, num_experts) for e in ids]
    in_range = [T.And(e >= -1, e < n) for e, n in zip(ids, bound)]
    distinct = [T.Or(ids[i] < 0, ids[i] != ids[j]) for i in range(len(ids)) for j in range(i)]
    return functools.reduce(T.And, in_range + distinct)


def assert_routes(ids, num_experts):
    """A device-side assert of :func:`routes_valid`. Bad routes would otherwise go nowhere (an id
    past the experts) or overflow a receiver's buffer (a repeated expert); the assert stops the
    process at its next sync instead ("device-side assert triggered", :data:`ROUTES_MESSAGE`
    printed by the GPU), as PyTorch's own index checks do. No host sync."""
    return T.call_intrin("void", tirx.op.Op.get("tl.device_assert_with_msg"), routes_valid(ids, num_experts),
                         ROUTES_MESSAGE)


@tilelang.jit(pass_configs={**HAND_SYNC_CONFIGS, **PEER_PASS_CONFIGS})
def get_put_routes_kernel(world: int, topk: int, index_dtype: str = "int32"):
    """``(idx_TK, weight_bits_TK, delta_W, dest_TW, home_TW, meta_FV, counts_F, e_local, rank, t_max)``;
    ids as the router returns them (``index_dtype`` int32 or int64: no conversion launch), int32
    out. ``meta_FV`` (as vectors of ``vec`` words) and ``counts_F`` are rank 0's copies, flat; rank
    w's lie ``delta_W[w]`` bytes on (as in :mod:`kernels.comm.put_rows_kernel`).

    A CTA's tokens' routes are one contiguous run of every rank's metadata rows: they go through
    shared memory and out as consecutive 16-byte vectors of consecutive threads (a thread storing
    its own row would leave each warp's store 32 words 64 bytes apart: 8x the NVLink writes)."""
    num_tokens, num_vectors = T.dynamic("num_tokens"), T.dynamic("num_vectors")
    words = 2 * topk
    vec = math.gcd(4, words)
    row_vectors = words // vec

    @T.prim_func
    def put_routes_kernel(
        idx_TK: T.Tensor[(num_tokens, topk), index_dtype],
        weight_bits_TK: T.Tensor[(num_tokens, topk), T.int32],
        delta_W: T.Tensor[(world,), T.int64],
        dest_TW: T.Tensor[(num_tokens, world), T.int32],
        home_TW: T.Tensor[(num_tokens, world), T.int32],
        meta_FV: T.Tensor[(num_vectors, vec), T.int32],
        counts_F: T.Tensor[(world,), T.int32],
        e_local: T.int32,
        rank: T.int32,
        t_max: T.int32,
    ):
        # At least one CTA: with no tokens the counts (zeros) still go out.
        with T.Kernel(T.max(T.ceildiv(num_tokens, THREADS), 1), threads=THREADS) as b:
            chained()
            tid = T.get_thread_binding()
            token = b * THREADS + tid
            meta_M = T.alloc_local((words,), T.int32)
            meta_S = T.alloc_shared((THREADS * words,), T.int32)  # the CTA's rows, as they travel
            deltas_W = T.alloc_local((world,), T.int64)
            for w in T.unroll(world):  # every load before the first store (chained: not __restrict__)
                deltas_W[w] = delta_W[w]
            if token < num_tokens:
                for k in T.unroll(topk):
                    meta_M[k] = T.Cast(T.int32, idx_TK[token, k])
                    meta_M[topk + k] = weight_bits_TK[token, k]
                assert_routes([idx_TK[token, k] for k in range(topk)], world * e_local)
                for m in T.unroll(words):
                    meta_S[tid * words + m] = meta_M[m]
                for w in T.unroll(world):
                    goes = goes_to([meta_M[k] for k in range(topk)], w, e_local)
                    dest_TW[token, w] = T.if_then_else(goes, rank * t_max + token, -1)
                    home_TW[token, w] = T.if_then_else(goes, w * t_max + token, -1)
            T.sync_threads()
            first = T.Cast(T.int64, rank * t_max + b * THREADS) * row_vectors  # the CTA's first vector
            for w in T.unroll(world):  # every rank gets the routes: how it tells this call's rows apart
                for s in T.unroll(row_vectors):
                    v = s * THREADS + tid
                    if b * THREADS + v // row_vectors < num_tokens:
                        for j in T.vectorized(vec):
                            meta_FV[deltas_W[w] // (4 * vec) + first + v, j] = meta_S[v * vec + j]
            if b == 0 and tid == 0:
                for w in T.unroll(world):
                    counts_F[deltas_W[w] // 4 + rank] = num_tokens

    return put_routes_kernel


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


def put_routes(topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, regions: RouteRegions, *,
               num_local_experts: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The TileLang twin of :func:`kernels.comm.reference.put_routes` (same bytes in every region,
    same ``(dest_TW, home_TW)``). The regions must lie in one symmetric heap (one ``delta_W``)."""
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int32, torch.int64), ndim=2)
    num_tokens, topk = topk_idx_TK.shape
    check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=(num_tokens, topk),
                 device=topk_idx_TK.device)
    if topk > MAX_TOPK:
        raise ValueError(f"topk_idx_TK: expected at most {MAX_TOPK} routes a token (a CTA stages its tokens' "
                         f"routes in shared memory), got {topk}")
    world = regions.counts.world
    meta = peer_copy(regions.meta, "regions.meta", dtype=torch.int32, width=2 * topk)
    counts = peer_copy(regions.counts, "regions.counts", dtype=torch.int32, width=1)
    if meta.shape[0] % world or counts.shape[0] != world:
        raise ValueError(f"regions: expected W * T_max metadata rows and W counts for W = {world}, got "
                         f"{tuple(meta.shape)} and {tuple(counts.shape)}")
    max_tokens = meta.shape[0] // world
    if num_tokens > max_tokens:
        raise ValueError(f"topk_idx_TK: expected at most max_tokens={max_tokens} tokens, got {num_tokens}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world} (the regions' ranks), got {rank}")
    if num_tokens == 0:  # an empty slice keeps its parent's strides, which the kernel's packed arguments reject
        topk_idx_TK, topk_weights_TK = topk_idx_TK.new_empty((0, topk)), topk_weights_TK.new_empty((0, topk))
    dest_TW = torch.empty((num_tokens, world), dtype=torch.int32, device=topk_idx_TK.device)
    home_TW = torch.empty_like(dest_TW)
    launch = launcher(get_put_routes_kernel(world, topk, str(topk_idx_TK.dtype).removeprefix("torch.")))
    vec = math.gcd(4, 2 * topk)
    meta_FV = peer_copy(regions.meta, dtype=torch.int32, width=2 * topk, layout=(torch.int32, -1, vec))
    counts_F = peer_copy(regions.counts, dtype=torch.int32, width=1, layout=(torch.int32, -1))
    launch(topk_idx_TK.contiguous(), topk_weights_TK.contiguous().view(torch.int32), regions.meta.delta_W, dest_TW,
           home_TW, meta_FV, counts_F, num_local_experts, rank, max_tokens)
    return dest_TW, home_TW


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
