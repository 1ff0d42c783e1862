"""Packing primitives shared by every placement policy, batched over independent problems.

Shape suffixes: B independent problems (layers, or layers x nodes), E logical experts, P physical
experts (replicas), N items, K packs.
"""

from __future__ import annotations

import torch

__all__ = ["replicate_greedy", "pack_equal", "expand_replicas"]


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
