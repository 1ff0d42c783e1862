"""Packing primitives shared by every placement policy, batched over independent problems.

Shape suffixes: B independent problems (layers, or layers x nodes), E logical experts, P physical
experts (replicas), N items, K packs.
"""

from __future__ import annotations

import torch

__all__ = ["replicate_greedy", "replicate_packable", "packing_lower_bound", "pack_equal", "expand_replicas"]


def replicate_greedy(weight_BE: torch.Tensor, num_physical: int) -> torch.Tensor:
    """Replica counts minimising the heaviest replica (the replica of e carries weight_e / count_e).

    Every expert starts with one replica; each extra replica goes, one at a time, to the expert whose
    replicas are currently the heaviest (first index on ties).

    Returns counts_BE (int64), each row summing to ``num_physical``.
    """
    B, E = weight_BE.shape
    counts_BE = torch.ones(B, E, dtype=torch.int64)
    rows_B = torch.arange(B)
    w_BE = weight_BE.double()
    for _ in range(num_physical - E):
        hot_B = (w_BE / counts_BE).argmax(-1)
        counts_BE[rows_B, hot_B] += 1
    return counts_BE


def packing_lower_bound(load_BE: torch.Tensor, counts_BE: torch.Tensor, num_packs: int) -> torch.Tensor:
    """A lower bound on the heaviest pack when the replicas are packed ``P / num_packs`` per pack.

    The larger of the mean pack load and, for every m >= 0, the m + 1 lightest of the
    ``m * num_packs + 1`` heaviest replicas (by pigeonhole some pack holds m + 1 of them) plus the
    ``P / num_packs - m - 1`` lightest replicas of all (that pack's other slots).

    Returns bound_B (float64).
    """
    w_BE = load_BE.double()
    weight_BE = w_BE / counts_BE
    order_BE = weight_BE.argsort(dim=-1, descending=True, stable=True)
    count_BE = counts_BE.gather(-1, order_BE).double()
    replica_w_BE = weight_BE.gather(-1, order_BE)
    ends_BE = count_BE.cumsum(-1)  # replicas up to and including each expert, heaviest first
    mass_BE = (replica_w_BE * count_BE).cumsum(-1)
    B, E = w_BE.shape
    P = int(counts_BE[0].sum())
    per_pack = P // num_packs

    def heaviest(n: int) -> torch.Tensor:
        """Total weight of the n heaviest replicas, [B]."""
        if n <= 0:
            return torch.zeros(B, dtype=torch.float64)
        at_B = torch.searchsorted(ends_BE, torch.full((B, 1), float(n), dtype=torch.float64)).clamp(max=E - 1)
        before_B = torch.where(at_B > 0, ends_BE.gather(-1, (at_B - 1).clamp(min=0)), 0.0)
        mass_before_B = torch.where(at_B > 0, mass_BE.gather(-1, (at_B - 1).clamp(min=0)), 0.0)
        return (mass_before_B + (n - before_B) * replica_w_BE.gather(-1, at_B)).squeeze(-1)

    total_B = mass_BE[:, -1]
    bound_B = total_B / num_packs
    for m in range(per_pack):
        top, rest = m * num_packs + 1, per_pack - m - 1
        if top > P:
            break
        bound_B = torch.maximum(bound_B, heaviest(top) - heaviest(top - m - 1) + total_B - heaviest(P - rest))
    return bound_B


def replicate_packable(load_BE: torch.Tensor, num_physical: int, num_packs: int) -> torch.Tensor:
    """Replica counts like :func:`replicate_greedy`, unless giving the heavy experts fewer extra
    replicas lowers :func:`packing_lower_bound`.

    Greedy replication can leave, say, 36 equally heavy replicas for 32 GPUs: four GPUs then carry two.
    Candidate k stops greedy replication k slots early and gives the k remaining slots to the k
    lightest single-replica experts (splitting them is harmless); k runs up to the number of packs,
    every value to 32, every 4th to 128, every 16th beyond. The candidate with the lowest bound wins,
    the fewest stops on ties.

    Returns counts_BE (int64).
    """
    B, E = load_BE.shape
    w_BE = load_BE.double()
    rows_B = torch.arange(B)
    extras = num_physical - E
    picks = []
    counts_BE = torch.ones(B, E, dtype=torch.int64)
    for _ in range(extras):
        hot_B = (w_BE / counts_BE).argmax(-1)
        picks.append(hot_B)
        counts_BE[rows_B, hot_B] += 1
    best_counts_BE = counts_BE.clone()
    best_bound_B = packing_lower_bound(w_BE, counts_BE, num_packs)
    top_k = min(extras, num_packs)
    tried = [k for k in range(1, top_k + 1) if k <= 32 or (k <= 128 and k % 4 == 0) or k % 16 == 0]
    undone = 0
    for k in tried:
        while undone < k:  # undo greedy picks from the last one back
            undone += 1
            counts_BE[rows_B, picks[extras - undone]] -= 1
        candidate_BE = counts_BE.clone()
        cold_BE = torch.where(candidate_BE == 1, w_BE, float("inf")).argsort(dim=-1, stable=True)[:, :k]
        candidate_BE.scatter_add_(1, cold_BE, torch.ones_like(cold_BE))
        bound_B = packing_lower_bound(w_BE, candidate_BE, num_packs)
        better_B = bound_B < best_bound_B * (1 - 1e-9)
        best_counts_BE[better_B] = candidate_BE[better_B]
        best_bound_B = torch.where(better_B, bound_B, best_bound_B)
    return best_counts_BE


def expand_replicas(counts_BE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists replicas expert-major: expert_BP[b, p] is the expert of replica p, rank_BP its replica rank."""
    B, E = counts_BE.shape
    P = int(counts_BE[0].sum())
    end_BE = counts_BE.cumsum(-1)
    p_BP = torch.arange(P).expand(B, P).contiguous()
    expert_BP = torch.searchsorted(end_BE, p_BP, right=True)
    rank_BP = p_BP - (end_BE - counts_BE).gather(-1, expert_BP)
    return expert_BP, rank_BP


def pack_equal(weight_BN: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs N items into ``num_packs`` packs of exactly N / num_packs items each, balancing weight.

    Longest-processing-time order: items by decreasing weight (stable on ties), each into the lightest
    pack that still has room (lowest pack index on ties).

    Returns pack_BN (pack of each item) and slot_BN (its position inside the pack), both int64.
    """
    B, N = weight_BN.shape
    per_pack = N // num_packs
    pack_BN = torch.empty(B, N, dtype=torch.int64)
    slot_BN = torch.empty(B, N, dtype=torch.int64)
    if per_pack == 1:
        pack_BN.copy_(torch.arange(N).expand(B, N))
        slot_BN.zero_()
        return pack_BN, slot_BN
    w_BN = weight_BN.double()
    order_BN = w_BN.sort(dim=-1, descending=True, stable=True).indices
    load_BK = torch.zeros(B, num_packs, dtype=torch.float64)
    fill_BK = torch.zeros(B, num_packs, dtype=torch.int64)
    rows_B = torch.arange(B)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for j in range(N):
        item_B = order_BN[:, j]
        pack_B = torch.where(fill_BK < per_pack, load_BK, inf).argmin(-1)
        pack_BN[rows_B, item_B] = pack_B
        slot_BN[rows_B, item_B] = fill_BK[rows_B, pack_B]
        load_BK[rows_B, pack_B] += w_BN[rows_B, item_B]
        fill_BK[rows_B, pack_B] += 1
    return pack_BN, slot_BN
