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

__all__ = ["choose_replicas", "replica_fractions"]

_PHI = 0.6180339887498949  # golden ratio conjugate: consecutive token indices spread evenly
_PSI = 0.7548776662466927  # plastic-number conjugate: decorrelates experts
_THETA = 0.4142135623730951  # sqrt(2) - 1: decorrelates source GPUs


def replica_fractions(log2phy_ER: torch.Tensor, node_of_physical: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Share of each source node's routes to expert e that each replica slot takes.

    Args:
        log2phy_ER: [E, R] physical ids of each expert's replicas, -1 padded (or [L, E, R]).
        node_of_physical: [P] node holding each physical expert.
        num_nodes: N.

    Returns:
        fraction_NER: [N, E, R] float64 (or [L, N, E, R]); sums over R are 1 for every (n, e);
        0 on padding.
    """
    valid_ER = log2phy_ER >= 0
    count_E1 = valid_ER.sum(-1, keepdim=True).to(torch.float64)
    node_ER = torch.where(valid_ER, node_of_physical[log2phy_ER.clamp(min=0)], -1)
    onehot_NER = (node_ER.unsqueeze(-3) == torch.arange(num_nodes).view(num_nodes, 1, 1)).to(torch.float64)
    local_count_NE1 = onehot_NER.sum(-1, keepdim=True)
    # Step 1: each node's 1/N share served by its own replicas, each replica holding 1/count.
    local_flow_NE1 = torch.minimum(torch.full_like(local_count_NE1, 1.0 / num_nodes),
                                   local_count_NE1 / count_E1.unsqueeze(-3))
    per_replica_local_NE1 = local_flow_NE1 / local_count_NE1.clamp(min=1)
    local_NER = onehot_NER * per_replica_local_NE1
    spare_ER = torch.where(valid_ER, 1.0 / count_E1 - local_NER.sum(-3), 0.0).clamp(min=0)
    left_NE1 = 1.0 / num_nodes - local_flow_NE1
    # Step 2: what is left of each node's share spreads over the spare capacity, proportionally.
    spare_total_E1 = spare_ER.sum(-1, keepdim=True)
    spread_ER = torch.where(spare_total_E1 > 0, spare_ER / spare_total_E1.clamp(min=1e-300), 0.0)
    return (local_NER + left_NE1 * spread_ER.unsqueeze(-3)) * num_nodes


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
    e_TK = topk_idx_TK.clamp(min=0).to(torch.float64)
    start_T = token_index_T.to(torch.float64) * _PHI + torch.as_tensor(source_T, dtype=torch.float64,
                                                                         device=token_index_T.device) * _THETA
    u_TK = torch.frac(start_T.unsqueeze(-1) + e_TK * _PSI)
    cdf_TKR = fraction_TKR.cumsum(-1)
    # Scaling u by the total (1 up to rounding) never lands past the last replica with a share.
    pick_TK = ((u_TK * cdf_TKR[..., -1]).unsqueeze(-1) >= cdf_TKR).sum(-1)
    pick_TK = pick_TK.clamp(max=log2phy_TKR.shape[-1] - 1)
    physical_TK = log2phy_TKR.gather(-1, pick_TK.unsqueeze(-1)).squeeze(-1)
    return torch.where(topk_idx_TK >= 0, physical_TK, -1)
