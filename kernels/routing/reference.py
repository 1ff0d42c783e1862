"""Routing ops in plain PyTorch: the specification of the routing kernels.

A router turns logits into scores, picks ``K`` experts per token (DeepSeek-V3 style: a selection
bias for aux-loss-free balancing, optional group-limited routing) and weighs the chosen experts.

Shape suffixes:
    T  tokens
    E  experts
    K  routes per token (top-k)
    V  vocabulary (rows of a hash-routing table)
    N  shared experts routed as fixed extra routes
    B  sequences in a batch
    S  tokens per sequence

An expert index of -1 marks a masked route: it reaches no expert and carries weight 0.

Scores and weights are computed in float32 for float32, bfloat16 and float16 logits, and in
float64 for float64 logits (so gradients can be checked in double precision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.validate import (
    check_finite,
    check_index_range,
    check_positive,
    check_tensor,
)

from .physical_map import PhysicalMap, physical_routes

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def score(logits_TE: torch.Tensor, scoring: str, *, values: bool = True) -> torch.Tensor:
    """Router scores from logits.

    Args:
        logits_TE: [T, E] float32, bfloat16, float16 (or float64); must be finite.
        scoring: "softmax" (over the E experts of a token), "sigmoid", or "sqrtsoftplus"
            (``sqrt(softplus(x))``).
        values: check that the logits are finite (a host sync; False for a caller that checked).

    Returns:
        scores_TE: [T, E] float32 (float64 for float64 logits).
    """
    check_tensor("logits_TE", logits_TE, dtype=LOGIT_DTYPES, ndim=2)
    if values:
        check_finite("logits_TE", logits_TE)
    x_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    if scoring == "softmax":
        return x_TE.softmax(dim=-1)
    if scoring == "sigmoid":
        return x_TE.sigmoid()
    if scoring == "sqrtsoftplus":
        return F.softplus(x_TE).sqrt()
    raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks ``topk`` experts per token and their weights.

    Selection scores are ``score(logits_TE, scoring) + bias_E``; the bias steers selection only.
    With ``num_groups > 1`` the E experts form ``num_groups`` contiguous groups of ``E // num_groups``;
    a group's score is the sum of its two best selection scores (its best alone if the group has a
    single expert), and only the experts of the ``topk_groups`` best groups can be chosen. Every
    ranking is stable: of equal scores the lower index wins, for groups and for experts alike.

    Args:
        logits_TE: [T, E] float32, bfloat16 or float16 (or float64); must be finite.
        topk: K, experts per token; at most ``topk_groups * E // num_groups``.
        scoring: see :func:`score`.
        bias_E: [E] float32 selection bias, or None.
        num_groups: expert groups; must divide E.
        topk_groups: groups kept per token, in [1, num_groups]; None keeps all.
        normalize, routed_scaling_factor: see :func:`topk_weights`.

    Returns:
        topk_idx_TK: [T, K] int64 chosen experts, by descending selection score (never -1).
        topk_weights_TK: [T, K] float32 (float64 for float64 logits), equal to
            ``topk_weights(logits_TE, topk_idx_TK, ...)`` with the same options.
    """
    scores_TE = score(logits_TE, scoring)
    num_tokens, num_experts = logits_TE.shape
    check_positive("topk", topk)
    check_positive("num_groups", num_groups)
    if num_experts % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the {num_experts} experts, got {num_groups}")
    if topk_groups is None:
        topk_groups = num_groups
    if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups: expected an int in [1, {num_groups}] or None, got {topk_groups!r}")
    group_size = num_experts // num_groups
    if topk > topk_groups * group_size:
        raise ValueError(
            f"topk: expected at most {topk_groups * group_size} (experts in {topk_groups} groups of "
            f"{group_size}), got {topk}"
        )

    select_TE = scores_TE.detach()
    if bias_E is not None:
        check_tensor("bias_E", bias_E, dtype=torch.float32, shape=(num_experts,), device=logits_TE.device)
        check_finite("bias_E", bias_E)
        select_TE = select_TE + bias_E

    if topk_groups < num_groups:
        select_TGM = select_TE.view(num_tokens, num_groups, group_size)
        best_TGM = select_TGM.sort(dim=-1, descending=True).values
        group_score_TG = best_TGM[..., : min(2, group_size)].sum(dim=-1)
        kept_TG = _stable_topk(group_score_TG, topk_groups)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, kept_TG, True)
        select_TE = select_TGM.masked_fill(~keep_TG[..., None], float("-inf")).view(num_tokens, num_experts)

    topk_idx_TK = _stable_topk(select_TE, topk)
    weights_TK = topk_weights(
        logits_TE, topk_idx_TK, scoring=scoring, normalize=normalize, routed_scaling_factor=routed_scaling_factor
    )
    return topk_idx_TK, weights_TK


@dataclass(frozen=True)
class GateRoutes:
    """What :func:`gate` returns.

    Fields:
        physical_idx_TK: [T, K + N] int64 routes for the dispatcher: the K chosen experts' physical
            slots, then the N shared routes' slots (logical ids without a map); -1 = no route.
        logical_idx_TK: [T, K] int64 the chosen logical experts (-1 for a masked token): the input
            of :func:`topk_weights` for weights with a gradient, and of the load statistics.
        weights_TK: [T, K + N] float32 (float64 for float64 logits): the K routes' weights as
            :func:`topk_weights` gives them, then 1.0 for each shared route; 0 where the route is -1.
        counts_E: [E] int32 routes per logical routed expert (:func:`expert_counts` of
            ``logical_idx_TK``), or None when not asked for.
    """

    physical_idx_TK: torch.Tensor
    logical_idx_TK: torch.Tensor
    weights_TK: torch.Tensor
    counts_E: torch.Tensor | None = None


def gate(
    logits_TE: torch.Tensor,
    *,
    topk: int,
    scoring: str = "softmax",
    bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int | None = None,
    normalize: bool = False,
    routed_scaling_factor: float = 1.0,
    physical_map: PhysicalMap | None = None,
    num_shared: int = 0,
    token_mask_T: torch.Tensor | None = None,
    fixed_T: torch.Tensor | None = None,
    fixed_idx_TK: torch.Tensor | None = None,
    with_counts: bool = False,
) -> GateRoutes:
    """The routing gate: :func:`topk_route`'s choice of logical experts, then the routes the
    dispatcher takes, on physical replicas.

    * ``physical_map``: every route (shared ones included) goes to a replica of its logical expert by
      the rule of :mod:`kernels.routing.physical_map`; without it, routes stay logical ids.
    * ``num_shared``: shared experts as N extra routes of every token, to logical experts
      ``E .. E + N - 1`` with weight 1.0 (for a layer that sends its shared experts through dispatch,
      so they can be replicated and placed like routed ones, instead of running them locally).
    * ``token_mask_T``: False marks a token that is not routed (padding, a token another rank
      serves): all its routes are -1 with weight 0, and it adds nothing to the counts.
    * ``fixed_T`` / ``fixed_idx_TK``: a token with ``fixed_T`` True takes the K logical experts of
      its ``fixed_idx_TK`` row instead of the top-k (hash-routed layers, a replay of recorded routes);
      its weights are those experts' scores, as for chosen ones. The token mask wins over it.

    Args:
        logits_TE, topk, scoring, bias_E, num_groups, topk_groups, normalize, routed_scaling_factor:
            as for :func:`topk_route`.
        physical_map: a map with ``E + N`` rows on the logits' device, or None.
        num_shared: N >= 0.
        token_mask_T: [T] bool, or None (every token routed).
        fixed_T: [T] bool, or None; given together with ``fixed_idx_TK``.
        fixed_idx_TK: [T, K] int32 or int64 experts in ``[0, E)`` or -1, distinct per token (not
            checked), or None. Read only where ``fixed_T`` is True.
        with_counts: also return ``counts_E``.
    """
    logical_idx_TK, _ = topk_route(logits_TE, topk=topk, scoring=scoring, bias_E=bias_E, num_groups=num_groups,
                                   topk_groups=topk_groups)
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    if isinstance(num_shared, bool) or not isinstance(num_shared, int) or num_shared < 0:
        raise ValueError(f"num_shared: expected an int >= 0, got {num_shared!r}")
    if (fixed_T is None) != (fixed_idx_TK is None):
        raise ValueError(f"fixed_idx_TK: expected it given with fixed_T, got fixed_T "
                         f"{'None' if fixed_T is None else 'a tensor'} and fixed_idx_TK "
                         f"{'None' if fixed_idx_TK is None else 'a tensor'}")
    if fixed_T is not None:
        check_tensor("fixed_T", fixed_T, dtype=torch.bool, shape=(num_tokens,), device=device)
        check_tensor("fixed_idx_TK", fixed_idx_TK, dtype=INDEX_DTYPES, shape=(num_tokens, topk), device=device)
        check_index_range("fixed_idx_TK", fixed_idx_TK[fixed_T], num_experts)
        logical_idx_TK = torch.where(fixed_T[:, None], fixed_idx_TK.long(), logical_idx_TK)
    routed_T = torch.ones(num_tokens, dtype=torch.bool, device=device)
    if token_mask_T is not None:
        routed_T = check_tensor("token_mask_T", token_mask_T, dtype=torch.bool, shape=(num_tokens,), device=device)
        logical_idx_TK = torch.where(routed_T[:, None], logical_idx_TK, -1)
    weights_TK = topk_weights(logits_TE, logical_idx_TK, scoring=scoring, normalize=normalize,
                              routed_scaling_factor=routed_scaling_factor, values=False)
    shared_TN = torch.arange(num_experts, num_experts + num_shared, device=device).expand(num_tokens, num_shared)
    routes_TK = torch.cat([logical_idx_TK, torch.where(routed_T[:, None], shared_TN, -1)], dim=1)
    weights_TK = torch.cat([weights_TK, routed_T[:, None].to(weights_TK.dtype).expand(num_tokens, num_shared)], dim=1)
    if physical_map is not None:
        if not isinstance(physical_map, PhysicalMap):
            raise TypeError(f"physical_map: expected a PhysicalMap, got {type(physical_map).__name__}")
        if physical_map.num_experts != num_experts + num_shared:
            raise ValueError(f"physical_map: expected {num_experts + num_shared} rows (experts + shared), got "
                             f"{physical_map.num_experts}")
        routes_TK = physical_routes(routes_TK, physical_map)
    counts_E = expert_counts(logical_idx_TK, num_experts) if with_counts else None
    return GateRoutes(routes_TK, logical_idx_TK, weights_TK, counts_E)


def _stable_topk(values_TN: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] int64 of the k largest values per row, ties to the lower index."""
    return values_TN.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def topk_weights(
    logits_TE: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    *,
    scoring: str = "softmax",
    normalize: bool = False,
    routed_scaling_factor: float = 1.0,
    values: bool = True,
) -> torch.Tensor:
    """Weights of chosen experts: their (unbiased) scores, optionally normalized, then scaled.

    Differentiable with respect to ``logits_TE``.

    Args:
        logits_TE: [T, E] float32, bfloat16 or float16 (or float64); must be finite.
        topk_idx_TK: [T, K] int32 or int64 experts in [0, E), or -1 for a masked route.
        scoring: see :func:`score`.
        normalize: divide each token's weights by their sum over its unmasked routes (a token whose
            routes are all masked keeps weights 0).
        routed_scaling_factor: multiplies every weight, after normalization.
        values: check the logits and the experts' range (host syncs; False for a caller whose
            routes come from :func:`topk_route` of logits it checked).

    Returns:
        topk_weights_TK: [T, K] float32 (float64 for float64 logits); 0 where ``topk_idx_TK`` is -1.
    """
    scores_TE = score(logits_TE, scoring, values=values)
    check_tensor(
        "topk_idx_TK", topk_idx_TK, dtype=INDEX_DTYPES, shape=(logits_TE.shape[0], None), device=logits_TE.device
    )
    if values:
        check_index_range("topk_idx_TK", topk_idx_TK, logits_TE.shape[1])
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor: expected a finite number, got {routed_scaling_factor!r}")
    routed_TK = topk_idx_TK >= 0
    gathered_TK = scores_TE.gather(1, topk_idx_TK.clamp(min=0).long())
    weights_TK = torch.where(routed_TK, gathered_TK, 0.0)
    if normalize:
        total_T1 = weights_TK.sum(dim=-1, keepdim=True)
        weights_TK = weights_TK / torch.where(total_T1 > 0, total_T1, 1.0)
    return weights_TK * routed_scaling_factor


def hash_route(token_ids_T: torch.Tensor, table_VK: torch.Tensor) -> torch.Tensor:
    """Fixed routing by token id (DeepSeek-V4's first layers): token t goes to ``table_VK[id_t]``.

    Args:
        token_ids_T: [T] int32 or int64 ids in [0, V).
        table_VK: [V, K] int32 or int64 expert ids per vocabulary entry (-1 gives a masked route).

    Returns:
        topk_idx_TK: [T, K] int64.
    """
    check_tensor("table_VK", table_VK, dtype=INDEX_DTYPES, ndim=2)
    check_tensor("token_ids_T", token_ids_T, dtype=INDEX_DTYPES, ndim=1, device=table_VK.device)
    check_index_range("token_ids_T", token_ids_T, table_VK.shape[0], allow_masked=False)
    return table_VK[token_ids_T.long()].long()


def expert_counts(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert.

    Args:
        topk_idx_TK: [T, K] int32 or int64 experts in [0, num_experts), or -1 (not counted).
        num_experts: E.

    Returns:
        counts_E: [E] int32.
    """
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=INDEX_DTYPES, ndim=2)
    check_positive("num_experts", num_experts)
    check_index_range("topk_idx_TK", topk_idx_TK, num_experts)
    routed_R = topk_idx_TK[topk_idx_TK >= 0].long()
    return torch.bincount(routed_R, minlength=num_experts).to(torch.int32)


def sequence_balance_stats(
    scores_BSE: torch.Tensor, topk_idx_BSK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence expert load and mean routing probability (DeepSeek-V3's sequence-wise balance).

    ``load_BE[b, i] = E / (K * S) * (routes of sequence b to expert i)`` (f_i in the paper) and
    ``prob_BE[b, i] = mean over s of scores_BSE[b, s, i] / sum_e scores_BSE[b, s, e]`` (P_i). The
    sequence-wise auxiliary loss is ``alpha * (load_BE * prob_BE).sum(-1).mean()``. Routes of -1 are
    not counted (K stays the nominal top-k). With S = 0 both are 0. ``prob_BE`` is differentiable with
    respect to ``scores_BSE``; ``load_BE`` is a constant.

    Args:
        scores_BSE: [B, S, E] float32, bfloat16 or float16 (or float64) router scores (unbiased).
        topk_idx_BSK: [B, S, K] int32 or int64 experts in [0, E), or -1.

    Returns:
        load_BE: [B, E] float32 (float64 for float64 scores).
        prob_BE: [B, E] float32 (float64 for float64 scores).
    """
    check_tensor("scores_BSE", scores_BSE, dtype=LOGIT_DTYPES, ndim=3)
    batch, seq_len, num_experts = scores_BSE.shape
    check_tensor(
        "topk_idx_BSK", topk_idx_BSK, dtype=INDEX_DTYPES, shape=(batch, seq_len, None), device=scores_BSE.device
    )
    check_index_range("topk_idx_BSK", topk_idx_BSK, num_experts)
    topk = topk_idx_BSK.shape[2]
    dtype = torch.promote_types(scores_BSE.dtype, torch.float32)

    routed_BR = (topk_idx_BSK >= 0).reshape(batch, seq_len * topk).to(dtype)
    expert_BR = topk_idx_BSK.clamp(min=0).reshape(batch, seq_len * topk).long()
    counts_BE = torch.zeros(batch, num_experts, dtype=dtype, device=scores_BSE.device)
    counts_BE.scatter_add_(1, expert_BR, routed_BR)
    load_BE = counts_BE * (num_experts / max(topk * seq_len, 1))

    s_BSE = scores_BSE.to(dtype)
    prob_BE = (s_BSE / s_BSE.sum(dim=-1, keepdim=True)).sum(dim=1) / max(seq_len, 1)
    return load_BE, prob_BE
