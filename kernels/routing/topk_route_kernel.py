"""TileLang kernel of the whole router: scores, bias, group-limited stable top-k, weights, counts.

Computes :func:`kernels.routing.reference.topk_route` (and, optionally, the per-expert counts of
:func:`kernels.routing.reference.expert_counts` of its result) in one launch.

Design: one warp per token, ``TOKENS_PER_BLOCK`` tokens per CTA. Lane ``l`` keeps experts
``l, l + 32, l + 64, ...`` in registers. That is the layout of torch's warp softmax on CUDA (each
lane sums its experts in that order, then a butterfly over 16, 8, 4, 2, 1 lanes), so softmax scores
round the same way as the reference's. Group scores (sum of the top two) merge per-lane top-two
pairs over the warp; the top-k takes ``K`` rounds of a warp arg-max that breaks ties towards the
lower expert index. Lane ``k`` writes route ``k``.

Exactness against the reference on CUDA: ``topk_idx_TK`` and the counts are bit-exact (sigmoid and
sqrtsoftplus use the same ``expf``/``log1pf``/``sqrtf`` as torch; softmax follows torch's warp
softmax summation order). Weights are bit-exact without ``normalize``; with it, the K weights are
summed in rank order rather than in torch's reduction order, so they may differ by a few ulp
(relative 2e-6).

Values are not checked on the host (that would cost a host sync): with non-finite logits the
result is unspecified but every write stays in bounds (a token with nothing to pick gets -1).

Shape suffixes:
    T  tokens
    E  experts
    K  routes per token (top-k)
    G  expert groups
    S  expert slots of one lane (ceil(E / 32))
"""

import tilelang
import torch
from tilelang import language as T

from kernels.validate import check_positive, check_tensor

from .reference import SCORINGS

WARP = 32
TOKENS_PER_BLOCK = 4
MAX_EXPERTS = 32 * WARP
LOGIT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: x itself above it


@tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True})
def get_topk_route_kernel(
    num_experts: int,
    topk: int,
    num_groups: int,
    topk_groups: int,
    scoring: str,
    logits_dtype: str,
    normalize: bool,
    with_counts: bool,
):
    """The router for one configuration (see the module doc); the token count is dynamic."""
    num_tokens = T.dynamic("num_tokens")
    num_slots = (num_experts + WARP - 1) // WARP
    group_size = num_experts // num_groups
    grouped = topk_groups < num_groups
    neg_inf = -T.infinity(T.float32)

    # (slot, group) pairs such that some lane's expert in that slot is in that group, so the
    # per-group loops stay short (a Python list: the kernel unrolls over it).
    slot_groups = [
        (i, g)
        for i in range(num_slots)
        for g in range(WARP * i // group_size, min(WARP * i + WARP - 1, num_experts - 1) // group_size + 1)
    ]

    @T.prim_func
    def topk_route_kernel(
        logits_TE: T.Tensor[(num_tokens, num_experts), logits_dtype],
        bias_E: T.Tensor[(num_experts,), T.float32],
        topk_idx_TK: T.Tensor[(num_tokens, topk), T.int64],
        topk_weights_TK: T.Tensor[(num_tokens, topk), T.float32],
        counts_E: T.Tensor[(num_experts,), T.int32],
        routed_scaling_factor: T.float32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TOKENS_PER_BLOCK), threads=TOKENS_PER_BLOCK * WARP) as block:
            thread = T.get_thread_binding()
            lane = thread % WARP
            token = block * TOKENS_PER_BLOCK + thread // WARP

            score_S = T.alloc_local((num_slots,), T.float32)
            select_S = T.alloc_local((num_slots,), T.float32)
            first_G = T.alloc_local((num_groups,), T.float32)
            second_G = T.alloc_local((num_groups,), T.float32)
            group_score_G = T.alloc_local((num_groups,), T.float32)
            kept_G = T.alloc_local((num_groups,), T.int32)
            peak = T.alloc_var(T.float32)
            total = T.alloc_var(T.float32)
            rank = T.alloc_var(T.int32)
            best_select = T.alloc_var(T.float32)
            best_expert = T.alloc_var(T.int32)
            best_score = T.alloc_var(T.float32)
            my_expert = T.alloc_var(T.int32)
            my_weight = T.alloc_var(T.float32)

            if token < num_tokens:
                # 1. Scores (unbiased, float32) and selection scores (-inf past E).
                for i in T.unroll(num_slots):
                    if lane + WARP * i < num_experts:
                        score_S[i] = T.Cast(T.float32, logits_TE[token, lane + WARP * i])
                    else:
                        score_S[i] = neg_inf
                if scoring == "softmax":
                    peak = neg_inf
                    for i in T.unroll(num_slots):
                        peak = T.max(peak, score_S[i])
                    for o in T.unroll(5):
                        peak = T.max(peak, T.shfl_xor(peak, 16 >> o))
                    total = 0.0
                    for i in T.unroll(num_slots):
                        if lane + WARP * i < num_experts:
                            score_S[i] = T.exp(score_S[i] - peak)
                            total = total + score_S[i]
                    for o in T.unroll(5):
                        total = total + T.shfl_xor(total, 16 >> o)
                for i in T.unroll(num_slots):
                    if lane + WARP * i < num_experts:
                        if scoring == "softmax":
                            score_S[i] = score_S[i] / total
                        elif scoring == "sigmoid":
                            score_S[i] = T.sigmoid(score_S[i])
                        else:
                            score_S[i] = T.sqrt(
                                T.if_then_else(
                                    score_S[i] > SOFTPLUS_THRESHOLD, score_S[i], T.log1p(T.exp(score_S[i]))
                                )
                            )
                        select_S[i] = score_S[i] + bias_E[lane + WARP * i]
                    else:
                        select_S[i] = neg_inf

                # 2. Group limit: keep the experts of the topk_groups groups with the best top-2 sums.
                if grouped:
                    for g in T.unroll(num_groups):
                        first_G[g] = neg_inf
                        second_G[g] = neg_inf
                    for i, g in slot_groups:
                        if (lane + WARP * i) // group_size == g:
                            second_G[g] = T.max(second_G[g], T.min(first_G[g], select_S[i]))
                            first_G[g] = T.max(first_G[g], select_S[i])
                    for g in T.unroll(num_groups):
                        for o in T.unroll(5):
                            other_first = T.shfl_xor(first_G[g], 16 >> o)
                            other_second = T.shfl_xor(second_G[g], 16 >> o)
                            second_G[g] = T.max(T.min(first_G[g], other_first), T.max(second_G[g], other_second))
                            first_G[g] = T.max(first_G[g], other_first)
                        if group_size > 1:
                            group_score_G[g] = first_G[g] + second_G[g]
                        else:
                            group_score_G[g] = first_G[g]
                    for g in T.unroll(num_groups):
                        rank = 0
                        for h in T.unroll(num_groups):
                            if h < g:
                                rank = rank + T.Cast(T.int32, group_score_G[h] >= group_score_G[g])
                            elif h > g:
                                rank = rank + T.Cast(T.int32, group_score_G[h] > group_score_G[g])
                        kept_G[g] = T.Cast(T.int32, rank < topk_groups)
                    for i, g in slot_groups:
                        if (lane + WARP * i) // group_size == g and kept_G[g] == 0:
                            select_S[i] = neg_inf

                # 3. Top-k: K rounds of a warp arg-max, ties to the lower expert index.
                total = 0.0
                my_expert = -1
                my_weight = 0.0
                for k in T.unroll(topk):
                    best_select = neg_inf
                    best_expert = num_experts
                    best_score = 0.0
                    for i in T.unroll(num_slots):
                        if select_S[i] > best_select:
                            best_select = select_S[i]
                            best_expert = lane + WARP * i
                            best_score = score_S[i]
                    for o in T.unroll(5):
                        other_select = T.shfl_xor(best_select, 16 >> o)
                        other_expert = T.shfl_xor(best_expert, 16 >> o)
                        other_score = T.shfl_xor(best_score, 16 >> o)
                        if other_select > best_select or (other_select == best_select and other_expert < best_expert):
                            best_select = other_select
                            best_expert = other_expert
                            best_score = other_score
                    for i in T.unroll(num_slots):
                        if lane + WARP * i == best_expert:
                            select_S[i] = neg_inf
                    total = total + best_score
                    if lane == k and best_expert < num_experts:
                        my_expert = best_expert
                        my_weight = best_score

                # 4. Weights (normalized over the K routes, then scaled), indices, counts.
                if lane < topk:
                    if normalize and total > 0:
                        my_weight = my_weight / total
                    topk_idx_TK[token, lane] = T.Cast(T.int64, my_expert)
                    topk_weights_TK[token, lane] = my_weight * routed_scaling_factor
                    if with_counts and my_expert >= 0:
                        T.atomic_add(counts_E[my_expert], 1)

    return topk_route_kernel


def topk_route(
    logits_TE: torch.Tensor,
    *,
    topk: int,
    scoring: str = "softmax",
    bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int | None = None,
    normalize: bool = False,
    routed_scaling_factor: float = 1.0,
    with_counts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kernels.routing.reference.topk_route` on the GPU, in one kernel.

    Args:
        logits_TE: [T, E] float32, bfloat16 or float16, contiguous, on a CUDA device; E <= 1024.
        topk, scoring, bias_E, num_groups, topk_groups, normalize, routed_scaling_factor: as in the
            reference (``bias_E`` [E] float32 contiguous on the same device). ``topk`` <= 32 and,
            when groups limit the choice, ``num_groups`` <= 32.
        with_counts: also return ``counts_E``, the routes per expert, counted in the same kernel.

    Returns:
        topk_idx_TK: [T, K] int64, by descending selection score.
        topk_weights_TK: [T, K] float32.
        counts_E: [E] int32, only with ``with_counts``.
    """
    check_tensor("logits_TE", logits_TE, dtype=tuple(LOGIT_DTYPES), ndim=2)
    check_cuda_contiguous("logits_TE", logits_TE)
    num_tokens, num_experts = logits_TE.shape
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    check_positive("topk", topk)
    check_positive("num_groups", num_groups)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"logits_TE: expected at most {MAX_EXPERTS} experts, got shape {tuple(logits_TE.shape)}")
    if num_experts % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the {num_experts} experts, got {num_groups}")
    topk_groups = num_groups if topk_groups is None else topk_groups
    if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups: expected an int in [1, {num_groups}] or None, got {topk_groups!r}")
    if topk_groups < num_groups and num_groups > WARP:
        raise ValueError(f"num_groups: expected at most {WARP} when topk_groups < num_groups, got {num_groups}")
    allowed = topk_groups * (num_experts // num_groups)
    if topk > min(allowed, WARP):
        raise ValueError(f"topk: expected at most {min(allowed, WARP)}, got {topk}")
    device = logits_TE.device
    if bias_E is None:
        bias_E = torch.zeros(num_experts, dtype=torch.float32, device=device)  # + 0.0 is exact
    check_tensor("bias_E", bias_E, dtype=torch.float32, shape=(num_experts,), device=device)
    check_cuda_contiguous("bias_E", bias_E)

    topk_idx_TK = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    topk_weights_TK = torch.empty(num_tokens, topk, dtype=torch.float32, device=device)
    counts_E = (torch.zeros if with_counts else torch.empty)(num_experts, dtype=torch.int32, device=device)
    if num_tokens:
        kernel = get_topk_route_kernel(
            num_experts, topk, num_groups, topk_groups, scoring, LOGIT_DTYPES[logits_TE.dtype], normalize, with_counts
        )
        kernel(logits_TE, bias_E, topk_idx_TK, topk_weights_TK, counts_E, float(routed_scaling_factor))
    if with_counts:
        return topk_idx_TK, topk_weights_TK, counts_E
    return topk_idx_TK, topk_weights_TK


def check_cuda_contiguous(name: str, t: torch.Tensor) -> None:
    """A CUDA tensor in row-major order (what every kernel here indexes); shared by the kernel wrappers."""
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a tensor on a CUDA device, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
