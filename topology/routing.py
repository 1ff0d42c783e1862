"""How a token's route to a logical expert picks one of the expert's physical replicas.

The rule is local first, then spread, and it keeps every replica's expected load equal:

1. Tokens of source node ``n`` (a ``1/N`` share of expert ``e``'s routes, tokens being spread evenly
   over the nodes) go to the replicas of ``e`` on node ``n``, up to those replicas' capacity (each
   replica serves ``1/count_e`` of the routes).
2. What is left of each node's share is spread over what is left of the replicas' capacity, in
   proportion to it.

The result is ``fraction_NER``: the share of node ``n``'s routes to ``e`` that replica ``r`` takes.
Every replica receives exactly ``load_e / count_e`` in expectation, whatever the node of the replica,
so a plan's per-GPU load does not depend on where tokens come from. A token picks its replica by a
low-discrepancy number ``u = frac(token_index * phi + e * psi + source * theta)`` looked up in the
cumulative fractions: deterministic (a pure function of the source GPU, the token's index in its
batch and the expert), and over consecutive token indices it hits each replica in proportion to its
fraction. The source term keeps ranks with the same fractions (a node's) from all picking the same
replica for their first tokens: with a token or two per rank, they would pile onto one replica.

Shape suffixes: N nodes, E logical experts, R replica slots (max replicas), T tokens, K top-k.
"""

from __future__ import annotations

import torch

__all__ = ["choose_replicas", "draw_terms", "replica_draws", "replica_fractions", "slot_fractions"]

_PHI = 0.6180339887498949  # golden ratio conjugate: consecutive token indices spread evenly
_PSI = 0.7548776662466927  # plastic-number conjugate: decorrelates experts
_THETA = 0.4142135623730951  # sqrt(2) - 1: decorrelates source GPUs


def slot_fractions(phy2log_LP: torch.Tensor, node_of_physical: torch.Tensor, num_experts: int,
                   num_nodes: int) -> torch.Tensor:
    """Share of each source node's routes to a slot's expert that the slot takes (the rule above).

    Args:
        phy2log_LP: [L, P] logical expert of each physical slot.
        node_of_physical: [P] node holding each physical slot.
        num_experts, num_nodes: E, N.

    Returns:
        fraction_LNP: [L, N, P] float64; for every (l, n, e) the slots of e sum to 1.
    """
    L, P = phy2log_LP.shape
    N, E = num_nodes, num_experts
    node_LP = node_of_physical.expand(L, P)
    count_LE = torch.zeros(L, E, dtype=torch.float64).scatter_add_(1, phy2log_LP, torch.ones(L, P, dtype=torch.float64))
    cell_LP = node_LP * E + phy2log_LP  # (node, expert) of each slot
    local_LC = torch.zeros(L, N * E, dtype=torch.float64).scatter_add_(1, cell_LP, torch.ones(L, P, dtype=torch.float64))
    count_LC = count_LE.repeat(1, N)
    # Step 1: each node's 1/N share served by its own replicas, each replica holding 1/count.
    local_flow_LC = torch.minimum(torch.full_like(local_LC, 1.0 / N), local_LC / count_LC.clamp(min=1))
    own_LP = (local_flow_LC / local_LC.clamp(min=1)).gather(1, cell_LP)
    spare_LP = (1.0 / count_LE.gather(1, phy2log_LP) - own_LP).clamp(min=0)
    spare_total_LE = torch.zeros(L, E, dtype=torch.float64).scatter_add_(1, phy2log_LP, spare_LP)
    spread_LP = torch.where(spare_total_LE.gather(1, phy2log_LP) > 0,
                            spare_LP / spare_total_LE.gather(1, phy2log_LP).clamp(min=1e-300), 0.0)
    # Step 2: what is left of each node's share spreads over the spare capacity, proportionally.
    left_LNE = 1.0 / N - local_flow_LC.view(L, N, E)
    fraction_LNP = left_LNE.gather(2, phy2log_LP.unsqueeze(1).expand(L, N, P)) * spread_LP.unsqueeze(1)
    fraction_LNP[:, node_LP[0], torch.arange(P)] += own_LP
    return fraction_LNP * N


def replica_fractions(log2phy_ER: torch.Tensor, node_of_physical: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """:func:`slot_fractions` per expert's replica list.

    Args:
        log2phy_ER: [E, R] physical ids of each expert's replicas, -1 padded (or [L, E, R]).
        node_of_physical: [P] node holding each physical expert.
        num_nodes: N.

    Returns:
        fraction_NER: [N, E, R] float64 (or [L, N, E, R]); sums over R are 1 for every (n, e);
        0 on padding.
    """
    layered = log2phy_ER.dim() == 3
    log2phy_LER = log2phy_ER if layered else log2phy_ER.unsqueeze(0)
    L, E, R = log2phy_LER.shape
    P = node_of_physical.numel()
    valid_LER = log2phy_LER >= 0
    slot_LER = torch.where(valid_LER, log2phy_LER, P)  # padding lands in a spare column, dropped
    phy2log_LP = torch.zeros(L, P + 1, dtype=torch.int64).scatter_(
        1, slot_LER.view(L, -1), torch.arange(E).view(1, E, 1).expand(L, E, R).reshape(L, -1))[:, :P]
    fraction_LNP = slot_fractions(phy2log_LP, node_of_physical, E, num_nodes)
    index = log2phy_LER.clamp(min=0).view(L, 1, E * R).expand(L, num_nodes, E * R)
    fraction_LNER = torch.where(valid_LER.unsqueeze(1), fraction_LNP.gather(2, index).view(L, num_nodes, E, R), 0.0)
    return fraction_LNER if layered else fraction_LNER[0]


def draw_terms(source: int, num_experts: int) -> tuple[float, float, torch.Tensor]:
    """The terms of :func:`replica_draws` for tokens of GPU ``source``, as a routing gate takes them
    (``kernels.routing.PhysicalMap``): ``(token_step, source_term, expert_term_E)`` with
    ``u = frac((t * token_step + source_term) + expert_term_E[e])``, the same float64 operations."""
    return _PHI, source * _THETA, torch.arange(num_experts, dtype=torch.float64) * _PSI


def replica_draws(expert: torch.Tensor, token_index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The number ``u`` in [0, 1) a route looks up in its expert's cumulative fractions
    (broadcasting expert ids, token indices and source GPUs)."""
    start = token_index.to(torch.float64) * _PHI + source.to(torch.float64) * _THETA
    return torch.frac(start + expert.to(torch.float64) * _PSI)


def choose_replicas(
    topk_idx_TK: torch.Tensor,
    fraction_TKR: torch.Tensor,
    log2phy_TKR: torch.Tensor,
    token_index_T: torch.Tensor,
    source_T: torch.Tensor | int,
) -> torch.Tensor:
    """Picks one replica per route from its fractions (see the module docstring); -1 routes stay -1.
    ``source_T``: the GPU (EP rank) each token comes from, or one for all.

    Returns physical_idx_TK (int64).
    """
    u_TK = replica_draws(topk_idx_TK.clamp(min=0), token_index_T.unsqueeze(-1),
                         torch.as_tensor(source_T, device=token_index_T.device).unsqueeze(-1))
    cdf_TKR = fraction_TKR.cumsum(-1)
    # Scaling u by the total (1 up to rounding) never lands past the last replica with a share.
    pick_TK = ((u_TK * cdf_TKR[..., -1]).unsqueeze(-1) >= cdf_TKR).sum(-1)
    pick_TK = pick_TK.clamp(max=log2phy_TKR.shape[-1] - 1)
    physical_TK = log2phy_TKR.gather(-1, pick_TK.unsqueeze(-1)).squeeze(-1)
    return torch.where(topk_idx_TK >= 0, physical_TK, -1)
