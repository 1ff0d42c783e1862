"""Expert placement at run time: routes on logical experts go to physical replica slots, replicas
stay identical, and the placement can change between steps.

A layer's placement (``ExpertPlacement``, one row ``phy2log_P`` of ``topology.Plan.phy2log_LP``)
says which logical expert each of ``P`` physical slots holds; EP rank ``r`` holds slots
``[r * P / W, (r + 1) * P / W)``. Every slot of a logical expert holds the same weights (and
optimizer state), so which replica serves a route changes where the work runs, not what it computes.

* Routing: a route to logical expert ``e`` from a token of EP rank ``r`` goes to one of ``e``'s
  slots by ``topology.Plan.physical_route``'s rule (local node first, every replica serving
  ``1 / count_e`` of the routes; the pick is a pure function of the placement, ``r``'s node, ``e`` and
  the token's position in ``r``'s batch). ``physical_map(r)`` holds it for the routing gate
  (``kernels.routing.gate``), which picks the replicas as it routes. The dispatcher works over the
  ``P`` physical experts.
* Gradients and switching: ``ep_runtime.replicas`` (collectives over a model's MoE layers).

Shape letters: T tokens, K routes per token, E logical experts, P physical slots over the EP group,
S slots per rank (``P / W``), R replicas per expert (max, -1 padded), W EP ranks, L MoE layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.routing import PhysicalMap, physical_routes
from kernels.validate import check_index_range, check_tensor
from topology.planner import invert_phy2log
from topology.routing import draw_terms, replica_fractions


__all__ = ["ExpertPlacement", "placements_from_phy2log", "placements_from_plan"]


@dataclass(frozen=True, kw_only=True)
class ExpertPlacement:
    """Where one MoE layer's experts live.

    Fields:
        phy2log_P: [P] int64, the logical expert in each physical slot; every expert in
            ``[0, num_experts)`` at least once. Slot ``p`` lives on EP rank ``p // (P / ep_size)``.
        num_experts: E, logical experts (the router's).
        ep_size: W, ranks of the EP group; ``P`` must be a multiple of it.
        node_of_rank: node of each EP rank (replicas on the token's own node are preferred);
            None: all ranks on one node.
    """

    phy2log_P: torch.Tensor
    num_experts: int
    ep_size: int
    node_of_rank: tuple[int, ...] | None = None

    def __post_init__(self):
        p = "placement"
        if not isinstance(self.phy2log_P, torch.Tensor) or self.phy2log_P.dim() != 1:
            raise ValueError(f"{p}.phy2log_P: expected a 1-D tensor, got "
                             f"{tuple(self.phy2log_P.shape) if isinstance(self.phy2log_P, torch.Tensor) else type(self.phy2log_P).__name__}")
        if self.phy2log_P.dtype.is_floating_point or self.phy2log_P.dtype == torch.bool:
            raise TypeError(f"{p}.phy2log_P: expected an integer dtype, got {self.phy2log_P.dtype}")
        if not (isinstance(self.num_experts, int) and self.num_experts >= 1):
            raise ValueError(f"{p}.num_experts: expected an int >= 1, got {self.num_experts!r}")
        if not (isinstance(self.ep_size, int) and self.ep_size >= 1):
            raise ValueError(f"{p}.ep_size: expected an int >= 1, got {self.ep_size!r}")
        phy2log_P = self.phy2log_P.detach().to("cpu", torch.int64).clone()
        object.__setattr__(self, "phy2log_P", phy2log_P)
        P = phy2log_P.numel()
        if P == 0 or P % self.ep_size:
            raise ValueError(f"{p}.phy2log_P: expected a multiple of the EP size {self.ep_size} physical experts, "
                             f"got {P}")
        if int(phy2log_P.min()) < 0 or int(phy2log_P.max()) >= self.num_experts:
            raise ValueError(f"{p}.phy2log_P: expected logical experts in [0, {self.num_experts}), got values in "
                             f"[{int(phy2log_P.min())}, {int(phy2log_P.max())}]")
        missing = (self.replica_counts_E == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(f"{p}.phy2log_P: expected every logical expert to have a replica, experts {missing} "
                             "have none")
        if self.node_of_rank is not None:
            nodes = tuple(self.node_of_rank)
            object.__setattr__(self, "node_of_rank", nodes)
            if len(nodes) != self.ep_size or any(not isinstance(n, int) or n < 0 for n in nodes):
                raise ValueError(f"{p}.node_of_rank: expected {self.ep_size} ints >= 0, got {nodes!r}")

    @staticmethod
    def identity(num_experts: int, ep_size: int) -> ExpertPlacement:
        """Expert ``e`` in slot ``e``, no replicas (what a layer without a placement does)."""
        return ExpertPlacement(phy2log_P=torch.arange(num_experts), num_experts=num_experts, ep_size=ep_size)

    # ------------------------------------------------------------------------------------- sizes
    @property
    def num_physical_experts(self) -> int:
        return self.phy2log_P.numel()

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical_experts // self.ep_size

    @property
    def replica_counts_E(self) -> torch.Tensor:
        """[E] int64 slots of each logical expert."""
        return torch.bincount(self.phy2log_P, minlength=self.num_experts)

    @property
    def log2phy_ER(self) -> torch.Tensor:
        """[E, R] int64 each logical expert's slots, ascending, -1 padded."""
        return invert_phy2log(self.phy2log_P[None].long(), self.replica_counts_E[None])[0]

    def local_experts(self, ep_rank: int) -> list[int]:
        """The logical expert of each of ``ep_rank``'s slots, in slot order."""
        S = self.slots_per_rank
        return self.phy2log_P[ep_rank * S:(ep_rank + 1) * S].tolist()

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def _node(self, ep_rank: int) -> int:
        return 0 if self.node_of_rank is None else self.node_of_rank[ep_rank]

    # ----------------------------------------------------------------------------------- routing
    def route_tables(self, ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fraction_ER float64, log2phy_ER int64): the share of ``ep_rank``'s routes to expert ``e``
        that each of ``e``'s replicas takes, and those replicas' slots."""
        if not 0 <= ep_rank < self.ep_size:
            raise ValueError(f"ep_rank: expected 0..{self.ep_size - 1}, got {ep_rank}")
        nodes = self.node_of_rank or (0,) * self.ep_size
        node_of_physical = torch.tensor(nodes).repeat_interleave(self.slots_per_rank)
        log2phy_ER = self.log2phy_ER
        fraction_NER = replica_fractions(log2phy_ER, node_of_physical, max(nodes) + 1)
        return fraction_NER[self._node(ep_rank)], log2phy_ER

    def physical_route(self, topk_idx_TK: torch.Tensor, *, ep_rank: int) -> torch.Tensor:
        """[T, K] logical routes of ``ep_rank``'s tokens (-1 = none) -> [T, K] int64 physical slots
        (-1 kept). Token ``t`` is the ``t``-th row of the rank's batch."""
        check_tensor("topk_idx_TK", topk_idx_TK, ndim=2, dtype=(torch.int64, torch.int32))
        check_index_range("topk_idx_TK", topk_idx_TK, self.num_experts)
        return physical_routes(topk_idx_TK, self.physical_map(ep_rank).to(topk_idx_TK.device))

    def physical_map(self, ep_rank: int) -> PhysicalMap:
        """The map the routing gate picks ``ep_rank``'s replicas from (``kernels.routing.gate``):
        the replicas of ``route_tables`` and the draw of ``topology.routing``, so the gate's picks are
        ``topology.Plan.physical_route``'s. On the CPU."""
        fraction_ER, log2phy_ER = self.route_tables(ep_rank)
        token_step, source_term, expert_term_E = draw_terms(ep_rank, self.num_experts)
        return PhysicalMap.from_replicas(log2phy_ER, fraction_ER, num_physical=self.num_physical_experts,
                                         token_step=token_step, source_term=source_term, expert_term_E=expert_term_E)


def placements_from_phy2log(phy2log_LP: torch.Tensor, *, num_experts: int, ep_size: int,
                            node_of_rank: Sequence[int] | None = None) -> list[ExpertPlacement]:
    """One ``ExpertPlacement`` per MoE layer from a ``[L, P]`` physical-to-logical map."""
    if not isinstance(phy2log_LP, torch.Tensor) or phy2log_LP.dim() != 2:
        raise ValueError(f"phy2log_LP: expected a [L, P] tensor, got "
                         f"{tuple(phy2log_LP.shape) if isinstance(phy2log_LP, torch.Tensor) else type(phy2log_LP).__name__}")
    nodes = tuple(node_of_rank) if node_of_rank is not None else None
    return [ExpertPlacement(phy2log_P=row, num_experts=num_experts, ep_size=ep_size, node_of_rank=nodes)
            for row in phy2log_LP]


def placements_from_plan(plan) -> list[ExpertPlacement]:
    """The placements of a ``topology.Plan`` (its GPUs are the EP group's ranks, in order); routes
    then pick replicas exactly as ``plan.physical_route`` does."""
    t = plan.topology
    return placements_from_phy2log(plan.phy2log_LP, num_experts=plan.num_experts, ep_size=t.num_gpus,
                                   node_of_rank=t.node_of_gpu)
