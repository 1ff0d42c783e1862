"""TileLang kernel of :func:`kernels.routing.reference.expert_counts`: routes per expert.

Design: each CTA counts ``ROUTES_PER_BLOCK`` consecutive routes into a shared-memory histogram
(shared atomics), then adds its non-zero bins to the global counts (one global atomic per bin).
Integer atomics make the result exact and independent of the order. Values are not checked on the
host (no host sync): entries outside ``[0, E)`` are not counted, like -1.

Shape suffixes:
    T  tokens
    K  routes per token
    E  experts
    R  flattened routes, T * K
"""

import functools

import tilelang
import torch
from tilelang import language as T

from kernels.tiles import check_cuda
from kernels.validate import check_positive, check_tensor

from .reference import INDEX_DTYPES

THREADS = 256
ROUTES_PER_THREAD = 16
ROUTES_PER_BLOCK = THREADS * ROUTES_PER_THREAD
INDEX_DTYPE_NAMES = {torch.int32: "int32", torch.int64: "int64"}


@tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True})
def get_expert_counts_kernel(num_experts: int, index_dtype: str):
    """Counts for E experts from routes of ``index_dtype``; the route count is dynamic."""
    num_routes = T.dynamic("num_routes")

    @T.prim_func
    def expert_counts_kernel(
        topk_idx_R: T.Tensor[(num_routes,), index_dtype],
        counts_E: T.Tensor[(num_experts,), T.int32],
    ):
        with T.Kernel(T.ceildiv(num_routes, ROUTES_PER_BLOCK), threads=THREADS) as block:
            thread = T.get_thread_binding()
            hist_E = T.alloc_shared((num_experts,), T.int32)
            expert = T.alloc_var(T.int32)
            for e in T.serial(T.ceildiv(num_experts, THREADS)):
                if e * THREADS + thread < num_experts:
                    hist_E[e * THREADS + thread] = 0
            T.sync_threads()
            for j in T.unroll(ROUTES_PER_THREAD):
                route = block * ROUTES_PER_BLOCK + j * THREADS + thread
                if route < num_routes:
                    expert = T.Cast(T.int32, topk_idx_R[route])
                    if expert >= 0 and expert < num_experts:
                        T.atomic_add(hist_E[expert], 1)
            T.sync_threads()
            for e in T.serial(T.ceildiv(num_experts, THREADS)):
                if e * THREADS + thread < num_experts and hist_E[e * THREADS + thread] > 0:
                    T.atomic_add(counts_E[e * THREADS + thread], hist_E[e * THREADS + thread])

    return expert_counts_kernel


def expert_counts(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """:func:`kernels.routing.reference.expert_counts` on the GPU.

    Args:
        topk_idx_TK: [T, K] int32 or int64 on a CUDA device (a strided view is copied first);
            experts in [0, E) or -1.
        num_experts: E.

    Returns:
        counts_E: [E] int32.
    """
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=INDEX_DTYPES, ndim=2)
    check_cuda("topk_idx_TK", topk_idx_TK)
    kernel = _counter(num_experts, topk_idx_TK.dtype)
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx_TK.device)
    if topk_idx_TK.numel():
        kernel(topk_idx_TK.contiguous().view(-1), counts_E)  # a view of a wider tensor is copied
    return counts_E


@functools.cache
def _counter(num_experts: int, index_dtype: torch.dtype):
    """The compiled kernel for E experts (cached: known arguments cost a dictionary look-up)."""
    check_positive("num_experts", num_experts)
    return get_expert_counts_kernel(num_experts, INDEX_DTYPE_NAMES[index_dtype])
