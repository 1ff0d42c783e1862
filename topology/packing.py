"""Packing primitives shared by every placement policy, batched over independent problems.

Computed with numpy on the CPU (single-threaded, so small problems do not pay for thread start-up or
suffer when other processes hold the cores); tensors in and out.

Shape suffixes: B independent problems (layers, or layers x nodes), E logical experts, P physical
experts (replicas), N items, K packs, Q queries.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["expand_replicas", "pack_equal", "packing_lower_bound", "replicate_greedy", "replicate_packable"]


def _np(t: torch.Tensor | np.ndarray, dtype) -> np.ndarray:
    return t.detach().cpu().numpy().astype(dtype, copy=False) if isinstance(t, torch.Tensor) else t.astype(dtype)


def _greedy_picks(w_BE: np.ndarray, extras: int) -> tuple[np.ndarray, list[np.ndarray]]:
    B, E = w_BE.shape
    counts_BE = np.ones((B, E), dtype=np.int64)
    rows_B = np.arange(B)
    picks = []
    for _ in range(extras):
        hot_B = (w_BE / counts_BE).argmax(-1)
        picks.append(hot_B)
        counts_BE[rows_B, hot_B] += 1
    return counts_BE, picks


def replicate_greedy(weight_BE: torch.Tensor, num_physical: int) -> torch.Tensor:
    """Replica counts minimising the heaviest replica (the replica of e carries weight_e / count_e).

    Every expert starts with one replica; each extra replica goes, one at a time, to the expert whose
    replicas are currently the heaviest (first index on ties).

    Returns counts_BE (int64), each row summing to ``num_physical``.
    """
    w_BE = _np(weight_BE, np.float64)
    counts_BE, _ = _greedy_picks(w_BE, num_physical - w_BE.shape[1])
    return torch.from_numpy(counts_BE)


def _lower_bound(w_BE: np.ndarray, counts_BE: np.ndarray, num_packs: int) -> np.ndarray:
    E = w_BE.shape[1]
    weight_BE = w_BE / counts_BE
    order_BE = np.argsort(-weight_BE, axis=-1, kind="stable")
    count_BE = np.take_along_axis(counts_BE, order_BE, -1).astype(np.float64)
    replica_w_BE = np.take_along_axis(weight_BE, order_BE, -1)
    ends_BE = count_BE.cumsum(-1)  # replicas up to and including each expert, heaviest first
    mass_BE = (replica_w_BE * count_BE).cumsum(-1)
    P = int(counts_BE[0].sum())
    per_pack = P // num_packs
    levels = [m for m in range(per_pack) if m * num_packs + 1 <= P]
    # Prefix sizes whose weight the bounds need: top, top - m - 1 and P - rest for each level m.
    sizes = sorted({n for m in levels for n in (m * num_packs + 1, m * num_packs - m, P - (per_pack - m - 1))})
    n_Q = np.array(sizes, dtype=np.float64)
    at_BQ = np.minimum((ends_BE[:, None, :] < n_Q[None, :, None]).sum(-1), E - 1)  # expert of the n-th replica
    prev_BQ = np.maximum(at_BQ - 1, 0)
    before_BQ = np.where(at_BQ > 0, np.take_along_axis(ends_BE, prev_BQ, -1), 0.0)
    mass_before_BQ = np.where(at_BQ > 0, np.take_along_axis(mass_BE, prev_BQ, -1), 0.0)
    heaviest_BQ = np.where(n_Q > 0, mass_before_BQ + (n_Q - before_BQ) * np.take_along_axis(replica_w_BE, at_BQ, -1),
                           0.0)
    column = {n: q for q, n in enumerate(sizes)}
    total_B = mass_BE[:, -1]
    bound_B = total_B / num_packs
    for m in levels:
        top, rest = m * num_packs + 1, per_pack - m - 1
        bound_B = np.maximum(bound_B, heaviest_BQ[:, column[top]] - heaviest_BQ[:, column[top - m - 1]]
                             + total_B - heaviest_BQ[:, column[P - rest]])
    return bound_B


def packing_lower_bound(load_BE: torch.Tensor, counts_BE: torch.Tensor, num_packs: int) -> torch.Tensor:
    """A lower bound on the heaviest pack when the replicas are packed ``P / num_packs`` per pack.

    The larger of the mean pack load and, for every m >= 0, the m + 1 lightest of the
    ``m * num_packs + 1`` heaviest replicas (by pigeonhole some pack holds m + 1 of them) plus the
    ``P / num_packs - m - 1`` lightest replicas of all (that pack's other slots).

    Returns bound_B (float64).
    """
    return torch.from_numpy(_lower_bound(_np(load_BE, np.float64), _np(counts_BE, np.int64), num_packs))


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
    w_BE = _np(load_BE, np.float64)
    B, E = w_BE.shape
    rows_B = np.arange(B)
    extras = num_physical - E
    counts_BE, picks = _greedy_picks(w_BE, extras)
    best_counts_BE = counts_BE.copy()
    best_bound_B = _lower_bound(w_BE, counts_BE, num_packs)
    top_k = min(extras, num_packs)
    tried = [k for k in range(1, top_k + 1) if k <= 32 or (k <= 128 and k % 4 == 0) or k % 16 == 0]
    undone = 0
    for k in tried:
        while undone < k:  # undo greedy picks from the last one back
            undone += 1
            counts_BE[rows_B, picks[extras - undone]] -= 1
        candidate_BE = counts_BE.copy()
        cold_BK = np.argsort(np.where(candidate_BE == 1, w_BE, np.inf), axis=-1, kind="stable")[:, :k]
        np.add.at(candidate_BE, (rows_B[:, None], cold_BK), 1)
        bound_B = _lower_bound(w_BE, candidate_BE, num_packs)
        better_B = bound_B < best_bound_B * (1 - 1e-9)
        best_counts_BE[better_B] = candidate_BE[better_B]
        best_bound_B = np.where(better_B, bound_B, best_bound_B)
    return torch.from_numpy(best_counts_BE)


def expand_replicas(counts_BE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists replicas expert-major: expert_BP[b, p] is the expert of replica p, rank_BP its replica rank."""
    c_BE = _np(counts_BE, np.int64)
    B = c_BE.shape[0]
    P = int(c_BE[0].sum())
    end_BE = c_BE.cumsum(-1)
    p_P = np.arange(P)
    expert_BP = np.stack([np.searchsorted(end_BE[b], p_P, side="right") for b in range(B)]) if B else \
        np.empty((0, P), dtype=np.int64)
    rank_BP = p_P - np.take_along_axis(end_BE - c_BE, expert_BP, -1)
    return torch.from_numpy(expert_BP.astype(np.int64)), torch.from_numpy(rank_BP.astype(np.int64))


def pack_equal(weight_BN: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs N items into ``num_packs`` packs of exactly N / num_packs items each, balancing weight.

    Longest-processing-time order: items by decreasing weight (stable on ties), each into the lightest
    pack that still has room (lowest pack index on ties).

    Returns pack_BN (pack of each item) and slot_BN (its position inside the pack), both int64.
    """
    w_BN = _np(weight_BN, np.float64)
    B, N = w_BN.shape
    per_pack = N // num_packs
    if per_pack == 1:
        return torch.arange(N).expand(B, N).clone(), torch.zeros(B, N, dtype=torch.int64)
    pack_BN = np.empty((B, N), dtype=np.int64)
    slot_BN = np.empty((B, N), dtype=np.int64)
    order_BN = np.argsort(-w_BN, axis=-1, kind="stable")
    load_BK = np.zeros((B, num_packs))
    fill_BK = np.zeros((B, num_packs), dtype=np.int64)
    rows_B = np.arange(B)
    for j in range(N):
        item_B = order_BN[:, j]
        pack_B = np.where(fill_BK < per_pack, load_BK, np.inf).argmin(-1)
        pack_BN[rows_B, item_B] = pack_B
        slot_BN[rows_B, item_B] = fill_BK[rows_B, pack_B]
        load_BK[rows_B, pack_B] += w_BN[rows_B, item_B]
        fill_BK[rows_B, pack_B] += 1
    return torch.from_numpy(pack_BN), torch.from_numpy(slot_BN)
