"""Logical experts to physical replicas: the map a routing gate picks replicas from, and its rule.

A placement keeps ``R`` or fewer physical slots (replicas) of each logical expert. One source rank's
routes to expert ``e`` are shared among ``e``'s replicas in fixed proportions (the planner's
``topology.routing`` decides them: local node first, every replica the same expected load). The
:class:`PhysicalMap` holds those proportions as cumulative shares, built once per placement and
source rank, and :func:`physical_routes` is the rule every gate applies:

    u = frac((t * token_step + source_term) + expert_term_E[e])     float64, rounded op by op
    r = #{ r < R - 1 : u * cdf_ER[e, R - 1] >= cdf_ER[e, r] }
    physical slot = log2phy_ER[e, r]

``t`` is the token's row in the source rank's batch. Over consecutive rows the draws ``u`` are
spread evenly over [0, 1) (a Weyl sequence), so every replica receives its share of the routes, and
the pick is a pure function of (map, t, e): deterministic, with no host sync and no state.

Shape suffixes: T tokens, K routes per token, E logical experts (rows of the map), R replicas
(the most any expert has).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.validate import check_index_range, check_tensor

__all__ = ["PhysicalMap", "physical_routes"]


@dataclass(frozen=True, kw_only=True)
class PhysicalMap:
    """The replicas of every logical expert and the shares of one source rank's routes they take.

    Build it with :meth:`from_replicas` (which checks the values once); the constructor checks
    shapes, dtypes and devices only, so rebuilding it from stored tensors costs no host sync.

    Fields:
        log2phy_ER: [E, R] int32 physical slots of each expert; an expert with fewer than ``R``
            replicas repeats its last one.
        cdf_ER: [E, R] float64 cumulative shares of the replicas (non-decreasing along R).
        expert_term_E: [E] float64, each expert's term of the draw.
        token_step: the draw's step from one token row to the next.
        source_term: the source rank's term of the draw.
    """

    log2phy_ER: torch.Tensor
    cdf_ER: torch.Tensor
    expert_term_E: torch.Tensor
    token_step: float
    source_term: float

    def __post_init__(self):
        check_tensor("log2phy_ER", self.log2phy_ER, dtype=torch.int32, ndim=2)
        device = self.log2phy_ER.device
        check_tensor("cdf_ER", self.cdf_ER, dtype=torch.float64, shape=tuple(self.log2phy_ER.shape), device=device)
        check_tensor("expert_term_E", self.expert_term_E, dtype=torch.float64, shape=(self.num_experts,),
                     device=device)
        if self.log2phy_ER.shape[1] < 1:
            raise ValueError(f"log2phy_ER: expected at least one replica column, got shape {tuple(self.log2phy_ER.shape)}")
        for name in ("token_step", "source_term"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: expected a float, got {type(value).__name__}")

    @property
    def num_experts(self) -> int:
        return self.log2phy_ER.shape[0]

    @property
    def max_replicas(self) -> int:
        return self.log2phy_ER.shape[1]

    @staticmethod
    def from_replicas(log2phy_ER: torch.Tensor, fraction_ER: torch.Tensor, *, num_physical: int, token_step: float,
                      source_term: float, expert_term_E: torch.Tensor) -> PhysicalMap:
        """The map of a planner's replica lists.

        Args:
            log2phy_ER: [E, R] int physical slots of each expert in ``[0, num_physical)``, -1 padded
                (at least one slot each, padding after the slots).
            fraction_ER: [E, R] float64 share of the routes each replica takes (>= 0; 0 on padding).
            num_physical: P, physical slots of the placement.
            token_step, source_term, expert_term_E: the draw's terms (module doc).
        """
        check_tensor("log2phy_ER", log2phy_ER, dtype=(torch.int32, torch.int64), ndim=2)
        check_tensor("fraction_ER", fraction_ER, dtype=torch.float64, shape=tuple(log2phy_ER.shape),
                     device=log2phy_ER.device)
        check_index_range("log2phy_ER", log2phy_ER, num_physical)
        valid_ER = log2phy_ER >= 0
        counts_E = valid_ER.sum(1)
        if log2phy_ER.shape[1] == 0 or bool((counts_E == 0).any()):
            raise ValueError(f"log2phy_ER: expected at least one replica for every expert, got replica counts "
                             f"{counts_E.tolist()}")
        if bool((valid_ER[:, 1:] & ~valid_ER[:, :-1]).any()):
            raise ValueError("log2phy_ER: expected each expert's -1 padding after its slots")
        if not bool(torch.isfinite(fraction_ER).all()) or bool((fraction_ER < 0).any()):
            raise ValueError("fraction_ER: expected finite shares >= 0")
        last_E1 = log2phy_ER.gather(1, (counts_E - 1)[:, None])
        return PhysicalMap(log2phy_ER=torch.where(valid_ER, log2phy_ER, last_E1).to(torch.int32),
                           cdf_ER=torch.where(valid_ER, fraction_ER, 0.0).cumsum(1), expert_term_E=expert_term_E,
                           token_step=float(token_step), source_term=float(source_term))

    def to(self, device: torch.device | str) -> PhysicalMap:
        return PhysicalMap(log2phy_ER=self.log2phy_ER.to(device), cdf_ER=self.cdf_ER.to(device),
                           expert_term_E=self.expert_term_E.to(device), token_step=self.token_step,
                           source_term=self.source_term)


def physical_routes(routes_TK: torch.Tensor, physical_map: PhysicalMap) -> torch.Tensor:
    """Physical slots of logical routes by the rule of the module doc; -1 routes stay -1.

    Args:
        routes_TK: [T, K] int32 or int64 logical experts in ``[0, E)`` (E: the map's rows), or -1;
            row ``t`` is token ``t`` of the source rank's batch.
        physical_map: the source rank's map, on the routes' device.

    Returns:
        physical_idx_TK: [T, K] int64.
    """
    check_tensor("routes_TK", routes_TK, dtype=(torch.int32, torch.int64), ndim=2)
    if not isinstance(physical_map, PhysicalMap):
        raise TypeError(f"physical_map: expected a PhysicalMap, got {type(physical_map).__name__}")
    if physical_map.log2phy_ER.device != routes_TK.device:
        raise ValueError(f"physical_map: expected a map on {routes_TK.device}, got one on "
                         f"{physical_map.log2phy_ER.device}")
    check_index_range("routes_TK", routes_TK, physical_map.num_experts)
    e_TK = routes_TK.long().clamp(min=0)
    token_T1 = torch.arange(routes_TK.shape[0], device=routes_TK.device, dtype=torch.float64)[:, None]
    u_TK = torch.frac((token_T1 * physical_map.token_step + physical_map.source_term)
                      + physical_map.expert_term_E[e_TK])
    cdf_TKR = physical_map.cdf_ER[e_TK]
    pick_TK = ((u_TK * cdf_TKR[..., -1])[..., None] >= cdf_TKR[..., :-1]).sum(-1)
    physical_TK = physical_map.log2phy_ER[e_TK].gather(-1, pick_TK[..., None]).squeeze(-1).long()
    return torch.where(routes_TK >= 0, physical_TK, -1)
