"""TileLang kernel of the whole router: scores, bias, group-limited stable top-k, weights, counts.

Computes :func:`kernels.routing.reference.topk_route` (and, optionally, the per-expert counts of
:func:`kernels.routing.reference.expert_counts` of its result) in one launch; with the gate's
stages compiled in, :func:`kernels.routing.reference.gate` (``gate_kernel.py`` says how).
``docs/design/routing.md`` has the design and the figures that decided it.

Design: one warp per token, ``WARPS`` tokens per CTA (with counts, a grid of at most
``COUNT_CTAS_PER_SM`` CTAs an SM whose warps route tokens in turn). Lane ``l`` holds the ``S`` consecutive
experts ``l*S .. l*S+S-1`` in registers (16-byte loads when ``32*S == E``). ``S`` is chosen so that
expert groups line up with lanes: a group spans ``L`` lanes (a power of two) or a lane holds ``Q``
whole groups. Then:

1. scores as torch computes them (``expf``/``log1pf``/``sqrtf``, IEEE division). Softmax sums in
   torch's warp-softmax order: the exponentials go through the warp's shared-memory row so that
   lane ``l`` adds experts ``l, l+32, ...``, then a butterfly over 16, 8, 4, 2, 1 lanes;
2. group scores (sum of the best two): per-lane top two, a butterfly over the ``L`` lanes of the
   group; each lane then ranks its own group(s) against the ``G`` group scores (one shuffle each)
   and masks its experts if the group is not kept;
3. top-k: selection scores become order-preserving int32 keys; when the kept groups' experts fill
   the warp with fewer slots a lane (DeepSeek-V3: 4 groups of 32 experts, 4 a lane instead of 8),
   each lane first fetches its share of them, in expert order, from the lanes holding them (one
   ballot of the kept groups, ``S`` shuffles). Each of the ``K`` rounds is then a local arg-max
   (ties to the lower slot), one ``redux.sync.max`` over the warp, one ballot whose lowest set lane
   wins (ties to the lower lane, hence the lower expert) and one shuffle of the winner's expert;
4. lane ``k`` writes route ``k``; its weight is read back from the score row in shared memory,
   normalized by the sum of the K weights taken in rank order, scaled. Counts go to a per-CTA
   shared-memory histogram, then one coalesced global atomic per expert per CTA (hence the bounded
   grid: fewer CTAs, fewer atomics on the same ``E`` counters).

Exactness against the reference on CUDA: ``topk_idx_TK`` and the counts are bit-exact; weights are
bit-exact without ``normalize``; with it, the K weights are summed in rank order rather than in
torch's reduction order, so they may differ by a few ulp (relative 2e-6).

Values are not checked on the host (that would cost a host sync): with non-finite logits the
result is unspecified but every write stays in bounds (a token with nothing to pick gets -1).

Shape suffixes:
    T  tokens
    E  experts
    K  routes per token (top-k)
    G  expert groups
    S  expert slots of one lane (consecutive experts)
    Q  whole groups held by one lane
    W  warps (tokens) of one CTA
"""

import functools
from dataclasses import dataclass

import tilelang
import torch
from tilelang import language as T

from kernels.tiles import check_cuda, sm_count
from kernels.validate import check_positive, check_tensor

from .reference import SCORINGS

WARP = 32
WARPS = 8  # warps per CTA, each routing one token at a time
# With counts, the grid is at most this many CTAs an SM, each warp routing tokens in turn: a CTA's
# histogram then covers more routes and fewer CTAs add theirs to the global counts (all of them
# hit the same E addresses). Without counts, a warp routes one token.
COUNT_CTAS_PER_SM = 8  # (H100: 23.8 us; 2, 4, unbounded: 28.6, 25.8, 29.2)
MAX_EXPERTS = 32 * WARP
MAX_SLOTS = 32  # experts per lane (registers)
LOGIT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: x itself above it
KEY_REMOVED = -(2**31)  # below every float's key (the key of -inf is -2139095041)
KEY_NEG_INF = -2139095041


def lane_layout(num_experts: int, num_groups: int, topk_groups: int) -> tuple[int, int, int] | None:
    """``(S, L, Q)``: experts per lane, lanes per group, groups per lane; None if no layout with at
    most ``MAX_SLOTS`` experts per lane lines groups up with lanes. Ungrouped routing (every group
    kept) uses ``S = ceil(E / 32)``."""
    first = -(-num_experts // WARP)
    if topk_groups >= num_groups:
        return first, 1, 1
    group_size = num_experts // num_groups
    for slots in range(first, MAX_SLOTS + 1):
        if slots % group_size == 0:
            return slots, 1, slots // group_size
        lanes, rest = divmod(group_size, slots)
        if not rest and lanes & (lanes - 1) == 0:
            return slots, lanes, 1
    return None


# Barriers are explicit (a warp reads only its own shared row, after __syncwarp): TileLang's
# automatic ones would be CTA-wide.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
}


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_topk_route_kernel(
    num_experts: int,
    topk: int,
    num_groups: int,
    topk_groups: int,
    scoring: str,
    logits_dtype: str,
    normalize: bool,
    with_counts: bool,
    compact: bool = True,
    *,
    num_shared: int = 0,
    with_map: bool = False,
    with_mask: bool = False,
    with_fixed: bool = False,
):
    """The router for one configuration (see the module doc); the token count and the grid
    (``num_ctas``, each warp routing tokens ``WARPS`` * ``num_ctas`` apart) are dynamic.
    ``compact=False`` keeps the kept groups in place (the sweep's comparison). The gate's stages
    (``kernels.routing.gate_kernel``): ``num_shared`` extra routes, replicas picked from a physical
    map, a token mask and fixed routes; the tensors of those left out are not read."""
    num_tokens = T.dynamic("num_tokens")
    mask_len, fixed_len, fixed_k = T.dynamic("mask_len"), T.dynamic("fixed_len"), T.dynamic("fixed_k")
    map_rows, replicas = T.dynamic("map_rows"), T.dynamic("replicas")
    logical_len, logical_k = T.dynamic("logical_len"), T.dynamic("logical_k")
    routes = topk + num_shared
    slots, group_lanes, lane_groups = lane_layout(num_experts, num_groups, topk_groups)
    group_size = num_experts // num_groups
    grouped = topk_groups < num_groups
    ragged = WARP * slots != num_experts  # some lanes hold slots past E
    strided_slots = (num_experts + WARP - 1) // WARP  # torch's warp-softmax elements per lane
    row = WARP * slots
    threads = WARPS * WARP
    neg_inf = -T.infinity(T.float32)
    full_mask = T.uint32(0xFFFFFFFF)
    # (source lane, its local group) of each group's score
    group_sources = [((h * group_size) // slots, (h * group_size) % slots // group_size) for h in range(num_groups)]
    # Compaction: when the kept groups' experts fill the warp with fewer slots a lane (DeepSeek-V3:
    # 4 groups of 32 = 4 a lane instead of 8), they move into those slots (in expert order) before
    # the top-k rounds, whose local scans then cover half the slots.
    kept_slots, kept_rest = divmod(topk_groups * group_size, WARP)
    compact = (
        compact and grouped and lane_groups == 1 and not kept_rest and 0 < kept_slots < slots
        and slots % kept_slots == 0 and group_size % kept_slots == 0
    )
    cand_slots = kept_slots if compact else slots
    kept_group_lanes = group_size // kept_slots if compact else 0  # lanes of one kept group, compacted

    @T.prim_func
    def topk_route_kernel(
        logits_TE: T.Tensor[(num_tokens, num_experts), logits_dtype],
        bias_E: T.Tensor[(num_experts,), T.float32],
        topk_idx_TK: T.Tensor[(num_tokens, routes), T.int64],
        topk_weights_TK: T.Tensor[(num_tokens, routes), T.float32],
        counts_E: T.Tensor[(num_experts,), T.int32],
        token_mask_T: T.Tensor[(mask_len,), T.bool],
        fixed_T: T.Tensor[(fixed_len,), T.bool],
        fixed_idx_TK: T.Tensor[(fixed_len, fixed_k), T.int64],
        log2phy_ER: T.Tensor[(map_rows, replicas), T.int32],
        cdf_ER: T.Tensor[(map_rows, replicas), T.float64],
        expert_term_E: T.Tensor[(map_rows,), T.float64],
        logical_idx_TK: T.Tensor[(logical_len, logical_k), T.int64],
        routed_scaling_factor: T.float32,
        token_step: T.float64,
        source_term: T.float64,
        num_ctas: T.int32,
    ):
        with T.Kernel(num_ctas, threads=threads) as block:
            thread = T.get_thread_binding()
            lane = thread % WARP
            warp = thread // WARP
            first = lane * slots  # this lane's first expert

            scores_WE = T.alloc_shared((WARPS, row), T.float32)
            hist_E = T.alloc_shared((num_experts,), T.int32)
            x_S = T.alloc_local((slots,), T.float32)
            key_S = T.alloc_local((slots,), T.int32)
            cand_C = T.alloc_local((cand_slots,), T.int32) if compact else key_S  # the top-k rounds' keys
            kept_mask = T.alloc_var(T.int32)
            group_bit = T.alloc_var(T.int32)
            cand_base = T.alloc_var(T.int32)  # expert of this lane's candidate slot 0
            first_Q = T.alloc_local((lane_groups,), T.float32)
            second_Q = T.alloc_local((lane_groups,), T.float32)
            above_Q = T.alloc_local((lane_groups,), T.int32)
            peak = T.alloc_var(T.float32)
            total = T.alloc_var(T.float32)
            other_first = T.alloc_var(T.float32)
            other_second = T.alloc_var(T.float32)
            mine = T.alloc_var(T.float32)
            theirs = T.alloc_var(T.float32)
            best = T.alloc_var(T.int32)
            best_slot = T.alloc_var(T.int32)
            top = T.alloc_var(T.int32)
            winner = T.alloc_var(T.int32)
            expert = T.alloc_var(T.int32)
            my_expert = T.alloc_var(T.int32)
            my_weight = T.alloc_var(T.float32)
            draw = T.alloc_var(T.float64)
            fixed_id = T.alloc_var(T.int64)
            routed = T.alloc_var(T.int32)
            pick = T.alloc_var(T.int32)

            if with_counts:
                for s in T.serial(T.ceildiv(num_experts, threads)):
                    if s * threads + thread < num_experts:
                        hist_E[s * threads + thread] = 0
                T.sync_threads()

            for r in T.serial(T.ceildiv(num_tokens, num_ctas * WARPS) if with_counts else 1):
                token = (r * num_ctas + block) * WARPS + warp
                if token < num_tokens:
                    # 1. Scores (float32, unbiased) into x_S and the warp's shared row.
                    if ragged or slots % 4:
                        for j in T.unroll(slots):
                            x_S[j] = neg_inf
                            if not ragged or first + j < num_experts:
                                x_S[j] = T.Cast(T.float32, logits_TE[token, first + j])
                    else:
                        for j in T.vectorized(slots):
                            x_S[j] = T.Cast(T.float32, logits_TE[token, first + j])
                    if scoring == "softmax":
                        peak = neg_inf
                        for j in T.unroll(slots):
                            peak = T.max(peak, x_S[j])
                        for o in T.unroll(5):
                            peak = T.max(peak, T.shfl_xor(peak, 16 >> o))
                        for j in T.unroll(slots):
                            if not ragged or first + j < num_experts:
                                scores_WE[warp, first + j] = T.exp(x_S[j] - peak)
                        T.sync_warp()
                        total = 0.0
                        for i in T.unroll(strided_slots):  # torch's order: experts lane, lane + 32, ...
                            if lane + WARP * i < num_experts:
                                total = total + scores_WE[warp, lane + WARP * i]
                        for o in T.unroll(5):
                            total = total + T.shfl_xor(total, 16 >> o)
                        for j in T.unroll(slots):
                            if not ragged or first + j < num_experts:
                                x_S[j] = scores_WE[warp, first + j] / total
                        T.sync_warp()
                    else:
                        for j in T.unroll(slots):
                            if not ragged or first + j < num_experts:
                                if scoring == "sigmoid":
                                    x_S[j] = T.sigmoid(x_S[j])
                                else:
                                    x_S[j] = T.sqrt(
                                        T.if_then_else(x_S[j] > SOFTPLUS_THRESHOLD, x_S[j], T.log1p(T.exp(x_S[j])))
                                    )
                    for j in T.unroll(slots):
                        if not ragged or first + j < num_experts:
                            scores_WE[warp, first + j] = x_S[j]
                            x_S[j] = x_S[j] + bias_E[first + j]  # selection score
                    T.sync_warp()

                    # 2. Group limit: keep the experts of the topk_groups groups with the best top-2 sums.
                    if grouped:
                        for q in T.unroll(lane_groups):
                            first_Q[q] = neg_inf
                            second_Q[q] = neg_inf
                            for j in T.unroll(min(slots, group_size)):
                                second_Q[q] = T.max(second_Q[q], T.min(first_Q[q], x_S[q * group_size + j]))
                                first_Q[q] = T.max(first_Q[q], x_S[q * group_size + j])
                        if group_lanes > 1:
                            for o in T.unroll(group_lanes.bit_length() - 1):
                                other_first = T.shfl_xor(first_Q[0], group_lanes >> (o + 1))
                                other_second = T.shfl_xor(second_Q[0], group_lanes >> (o + 1))
                                second_Q[0] = T.max(T.min(first_Q[0], other_first), T.max(second_Q[0], other_second))
                                first_Q[0] = T.max(first_Q[0], other_first)
                        for q in T.unroll(lane_groups):
                            if group_size > 1:
                                first_Q[q] = first_Q[q] + second_Q[q]  # the group's score
                            above_Q[q] = 0
                        # Rank of each of this lane's groups g among all groups (ties to the lower index).
                        for h, (source_lane, source_group) in enumerate(group_sources):
                            theirs = T.shfl_sync(first_Q[source_group], source_lane)
                            for q in T.unroll(lane_groups):
                                mine = first_Q[q]
                                above_Q[q] = above_Q[q] + T.Cast(
                                    T.int32,
                                    theirs > mine or (theirs == mine and h < (first // group_size) + q),
                                )
                        if not compact:
                            for q in T.unroll(lane_groups):
                                if above_Q[q] >= topk_groups:
                                    for j in T.unroll(min(slots, group_size)):
                                        x_S[q * group_size + j] = neg_inf

                    # 3. Top-k over order-preserving int keys of the selection scores.
                    for j in T.unroll(slots):
                        key_S[j] = T.reinterpret(x_S[j], T.int32)
                        key_S[j] = key_S[j] ^ ((key_S[j] >> 31) & 0x7FFFFFFF)
                    cand_base = lane * slots
                    if compact:
                        # Lane l takes kept_slots experts of the (l // kept_group_lanes)-th kept group (in
                        # group order) from the lane holding them: one bit a kept group at its first lane.
                        kept_mask = T.Cast(T.int32, T.ballot_sync(lane % group_lanes == 0 and above_Q[0] < topk_groups))
                        for r in T.unroll(topk_groups):  # the rank-th lowest set bit
                            if r == lane // kept_group_lanes:
                                group_bit = kept_mask & -kept_mask
                            kept_mask = kept_mask & (kept_mask - 1)
                        cand_base = (
                            (T.call_extern("int32", "__ffs", group_bit) - 1) // group_lanes * group_size
                            + lane % kept_group_lanes * kept_slots
                        )
                        for h in T.unroll(slots // kept_slots):  # the source lane's slots in kept_slots chunks
                            for j in T.unroll(kept_slots):
                                theirs_key = T.shfl_sync(key_S[h * kept_slots + j], cand_base // slots)
                                if cand_base % slots == h * kept_slots:
                                    cand_C[j] = theirs_key
                    my_expert = -1
                    for k in T.unroll(topk):
                        best = cand_C[0]
                        best_slot = 0
                        for j in T.unroll(cand_slots):
                            if cand_C[j] > best:
                                best = cand_C[j]
                                best_slot = j
                        top = T.call_extern("int32", "__reduce_max_sync", full_mask, best)
                        winner = T.call_extern("int32", "__ffs", T.Cast(T.int32, T.ballot_sync(best == top))) - 1
                        expert = T.shfl_sync(cand_base + best_slot, winner)
                        if lane == winner:
                            for j in T.unroll(cand_slots):
                                if j == best_slot:
                                    cand_C[j] = KEY_REMOVED
                        if lane == k and top > KEY_NEG_INF:
                            my_expert = expert

                    # 4. Fixed routes, the token mask; weights (normalized over the K routes in rank
                    # order, then scaled), shared routes, replicas, indices, counts.
                    if with_fixed:
                        if fixed_T[token] and lane < topk:  # an id off [0, E) reads as -1: reads stay in bounds
                            fixed_id = fixed_idx_TK[token, lane]
                            my_expert = T.if_then_else(fixed_id >= 0 and fixed_id < num_experts,
                                                       T.Cast(T.int32, fixed_id), -1)
                    if with_mask:
                        routed = T.Cast(T.int32, token_mask_T[token])
                        if routed == 0:
                            my_expert = -1
                    my_weight = 0.0
                    if lane < topk and my_expert >= 0:
                        my_weight = scores_WE[warp, my_expert]
                    if normalize:
                        total = 0.0
                        for k in T.unroll(topk):
                            total = total + T.shfl_sync(my_weight, k)
                        if total > 0:
                            my_weight = my_weight / total
                    if lane < topk:
                        my_weight = my_weight * routed_scaling_factor
                        if with_counts and my_expert >= 0:
                            T.atomic_add(hist_E[my_expert], 1)
                        if with_map:
                            logical_idx_TK[token, lane] = T.Cast(T.int64, my_expert)
                    if num_shared:
                        if lane >= topk and lane < routes and (not with_mask or routed != 0):
                            my_expert = num_experts + lane - topk
                            my_weight = 1.0
                    if with_map:
                        if lane < routes and my_expert >= 0:
                            # The draw of kernels.routing.physical_map, rounded op by op as torch does.
                            draw = T.call_extern("float64", "__dadd_rn", T.call_extern(
                                "float64", "__dadd_rn",
                                T.call_extern("float64", "__dmul_rn", T.Cast(T.float64, token), token_step),
                                source_term), expert_term_E[my_expert])
                            draw = T.call_extern("float64", "__dmul_rn", draw - T.floor(draw),
                                                 cdf_ER[my_expert, replicas - 1])
                            pick = 0
                            for r in T.serial(replicas - 1):
                                pick = pick + T.Cast(T.int32, draw >= cdf_ER[my_expert, r])
                            my_expert = log2phy_ER[my_expert, pick]
                    if lane < routes:
                        topk_idx_TK[token, lane] = T.Cast(T.int64, my_expert)
                        topk_weights_TK[token, lane] = my_weight
                if with_counts:
                    T.sync_warp()  # the warp's shared row is read before its next token writes it

            if with_counts:
                T.sync_threads()
                for s in T.serial(T.ceildiv(num_experts, threads)):
                    if s * threads + thread < num_experts and hist_E[s * threads + thread] > 0:
                        T.atomic_add(counts_E[s * threads + thread], hist_E[s * threads + thread])

    return topk_route_kernel


@functools.cache
def supports(num_experts: int, topk: object, num_groups: object, topk_groups: object) -> bool:
    """False for valid options beyond the kernel's limits (more than ``MAX_EXPERTS`` experts, ``topk``
    above a warp, more than a warp of groups to choose from, groups that do not line up with lanes):
    the public op then runs the reference. Invalid options are left to :func:`topk_route` to reject."""
    if num_experts > MAX_EXPERTS or (isinstance(topk, int) and topk > WARP):
        return False
    if not (isinstance(num_groups, int) and num_groups >= 1 and num_experts % num_groups == 0):
        return True
    topk_groups = num_groups if topk_groups is None else topk_groups
    if not (isinstance(topk_groups, int) and 1 <= topk_groups < num_groups):
        return True
    return num_groups <= WARP and lane_layout(num_experts, num_groups, topk_groups) is not None


@functools.cache
def _router(
    num_experts: int,
    topk: int,
    num_groups: int,
    topk_groups: int | None,
    scoring: str,
    logits_dtype: torch.dtype,
    normalize: bool,
    with_counts: bool,
    gate: tuple[int, bool, bool, bool] = (0, False, False, False),
):
    """The compiled kernel of one configuration, its options validated once (cached: a call with a
    known configuration costs a dictionary look-up). ``gate``: ``(num_shared, with_map, with_mask,
    with_fixed)``, the gate's stages (see ``get_topk_route_kernel``)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    check_positive("topk", topk)
    check_positive("num_groups", num_groups)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"logits_TE: expected at most {MAX_EXPERTS} experts, got {num_experts}")
    if num_experts % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the {num_experts} experts, got {num_groups}")
    topk_groups = num_groups if topk_groups is None else topk_groups
    if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups: expected an int in [1, {num_groups}] or None, got {topk_groups!r}")
    if topk_groups < num_groups and num_groups > WARP:
        raise ValueError(f"num_groups: expected at most {WARP} when topk_groups < num_groups, got {num_groups}")
    if lane_layout(num_experts, num_groups, topk_groups) is None:
        raise ValueError(
            f"num_groups: {num_groups} groups of {num_experts // num_groups} experts do not line up with "
            f"warp lanes of at most {MAX_SLOTS} experts (see lane_layout)"
        )
    allowed = topk_groups * (num_experts // num_groups)
    if topk > min(allowed, WARP):
        raise ValueError(f"topk: expected at most {min(allowed, WARP)}, got {topk}")
    num_shared, with_map, with_mask, with_fixed = gate
    if topk + num_shared > WARP:
        raise ValueError(f"num_shared: expected at most {WARP - topk} (a warp's lanes less topk), got {num_shared}")
    return get_topk_route_kernel(
        num_experts, topk, num_groups, topk_groups, scoring, LOGIT_DTYPES[logits_dtype], bool(normalize), with_counts,
        num_shared=num_shared, with_map=with_map, with_mask=with_mask, with_fixed=with_fixed,
    )


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
        logits_TE: [T, E] float32, bfloat16 or float16 on a CUDA device (copied if not contiguous);
            E <= 1024.
        topk, scoring, bias_E, num_groups, topk_groups, normalize, routed_scaling_factor: as in the
            reference (``bias_E`` [E] float32 on the same device). ``topk`` <= 32 and,
            when groups limit the choice, ``num_groups`` <= 32 and the groups line up with lanes
            (:func:`lane_layout` is not None; true for every E <= 1024 whose group size is a power
            of two times ``ceil(E / 32)`` or a divisor of it, DeepSeek-V3 included).
        with_counts: also return ``counts_E``, the routes per expert, counted in the same kernel.

    Returns:
        topk_idx_TK: [T, K] int64, by descending selection score.
        topk_weights_TK: [T, K] float32.
        counts_E: [E] int32, only with ``with_counts``.
    """
    idx_TK, weights_TK, counts_E = launch(logits_TE, bias_E, topk=topk, scoring=scoring, num_groups=num_groups,
                                          topk_groups=topk_groups, normalize=normalize,
                                          routed_scaling_factor=routed_scaling_factor, with_counts=with_counts)
    return (idx_TK, weights_TK, counts_E) if with_counts else (idx_TK, weights_TK)


def launch(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, *, topk: int, scoring: str, num_groups: int,
           topk_groups: int | None, normalize: bool, routed_scaling_factor: float, with_counts: bool,
           gate: "GateLaunch | None" = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks the logits and bias (attributes only), allocates the outputs and runs the router:
    ``(topk_idx_TK, topk_weights_TK, counts_E)``, ``[T, K + num_shared]`` routes with ``gate``;
    ``counts_E`` is zeros unless ``with_counts``."""
    # Cheap checks only (no host sync, no per-call validation of the options beyond the cache key).
    if not isinstance(logits_TE, torch.Tensor) or logits_TE.dtype not in LOGIT_DTYPES:
        check_tensor("logits_TE", logits_TE, dtype=tuple(LOGIT_DTYPES))
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE: expected a 2-D tensor, got shape {tuple(logits_TE.shape)}")
    check_cuda("logits_TE", logits_TE)
    if not logits_TE.is_contiguous() or logits_TE.data_ptr() % 16:  # rows are read with 16-byte loads
        logits_TE = logits_TE.clone(memory_format=torch.contiguous_format)
    num_tokens, num_experts = logits_TE.shape
    gate = gate or GateLaunch.absent(logits_TE.device)
    kernel = _router(num_experts, topk, num_groups, topk_groups, scoring, logits_TE.dtype, normalize, with_counts,
                     gate.flags)
    device = logits_TE.device
    if bias_E is None:
        bias_E = torch.zeros(num_experts, dtype=torch.float32, device=device)  # + 0.0 is exact
    elif bias_E.dtype != torch.float32 or bias_E.shape != (num_experts,) or bias_E.device != device:
        check_tensor("bias_E", bias_E, dtype=torch.float32, shape=(num_experts,), device=device)
    check_cuda("bias_E", bias_E)
    bias_E = bias_E.contiguous()

    routes = topk + gate.flags[0]
    topk_idx_TK = torch.empty(num_tokens, routes, dtype=torch.int64, device=device)
    topk_weights_TK = torch.empty(num_tokens, routes, dtype=torch.float32, device=device)
    counts_E = (torch.zeros if with_counts else torch.empty)(num_experts, dtype=torch.int32, device=device)
    if num_tokens:
        kernel(logits_TE, bias_E, topk_idx_TK, topk_weights_TK, counts_E, gate.token_mask_T, gate.fixed_T,
               gate.fixed_idx_TK, gate.log2phy_ER, gate.cdf_ER, gate.expert_term_E, gate.logical_idx_TK,
               float(routed_scaling_factor), gate.token_step, gate.source_term,
               grid_size(num_tokens, with_counts, device))
    return topk_idx_TK, topk_weights_TK, counts_E


@dataclass(frozen=True)
class GateLaunch:
    """The gate's inputs of one launch (``kernels.routing.gate_kernel`` builds them); a stage left
    out gets one-element stand-ins that the kernel does not read. ``flags``: ``(num_shared,
    with_map, with_mask, with_fixed)``."""

    flags: tuple[int, bool, bool, bool]
    token_mask_T: torch.Tensor
    fixed_T: torch.Tensor
    fixed_idx_TK: torch.Tensor
    log2phy_ER: torch.Tensor
    cdf_ER: torch.Tensor
    expert_term_E: torch.Tensor
    logical_idx_TK: torch.Tensor
    token_step: float = 0.0
    source_term: float = 0.0

    @staticmethod
    @functools.cache
    def absent(device: torch.device) -> "GateLaunch":
        def one(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return GateLaunch(flags=(0, False, False, False), token_mask_T=one(1, dtype=torch.bool),
                          fixed_T=one(1, dtype=torch.bool), fixed_idx_TK=one(1, 1, dtype=torch.int64),
                          log2phy_ER=one(1, 1, dtype=torch.int32), cdf_ER=one(1, 1, dtype=torch.float64),
                          expert_term_E=one(1, dtype=torch.float64), logical_idx_TK=one(1, 1, dtype=torch.int64))


def grid_size(num_tokens: int, with_counts: bool, device: torch.device, ctas_per_sm: int = COUNT_CTAS_PER_SM) -> int:
    """The router's CTAs: one token a warp, or with counts at most ``ctas_per_sm`` CTAs an SM."""
    ctas = -(-num_tokens // WARPS)
    return min(ctas, sm_count(device) * ctas_per_sm) if with_counts else ctas


