"""Where experts go: :func:`plan` turns per-expert load into a :class:`Plan`.

Shape suffixes used here and in every ``Plan`` field:
    L  MoE layers             E  logical experts          P  physical experts (replica slots)
    R  replica slots per expert (max replicas; -1 padded)  G  GPUs (ranks)   N  nodes
    T  tokens                 K  routes per token (top-k)

Physical expert ``p`` lives on GPU ``p // (P / G)`` (every GPU holds ``P / G`` of them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .baselines import eplb_global, eplb_hierarchical, greedy, no_replication
from .cluster import Topology
from .placement import locality_policy
from .routing import choose_replicas, replica_fractions
from .traffic import DEFAULT_TRAFFIC, Traffic, TrafficModel, count_traffic

__all__ = ["POLICIES", "Migration", "Plan", "ReplanCheck", "migration", "plan", "plan_from_phy2log"]


def _global(load_LE, topology, num_physical, expert_groups):
    return eplb_global(load_LE, topology, num_physical)


def _hierarchical(load_LE, topology, num_physical, expert_groups):
    if expert_groups is None:
        raise ValueError("expert_groups: policy 'eplb_hierarchical' needs expert groups, got None")
    return eplb_hierarchical(load_LE, topology, num_physical, expert_groups)


def _greedy(load_LE, topology, num_physical, expert_groups):
    return greedy(load_LE, topology, num_physical)


def _none(load_LE, topology, num_physical, expert_groups):
    return no_replication(load_LE, topology, num_physical)


POLICIES: dict[str, Callable[..., torch.Tensor]] = {
    "locality": locality_policy,
    "eplb_global": _global,
    "eplb_hierarchical": _hierarchical,
    "greedy": _greedy,
    "none": _none,
}
"""Placement policies by name: ``locality`` (ours, the default), DeepSeek EPLB's ``eplb_global`` and
``eplb_hierarchical`` (our implementation of the published algorithm), ``greedy`` (EPLB's replica
counts placed in id order on the least-loaded GPU) and ``none`` (no replication: expert e on slot e)."""

DEFAULT_EXPERT_BYTES = 3 * 7168 * 2048 * 2
"""One DeepSeek-V3 routed expert (gate, up, down projections of 7168 x 2048) in bf16: 88 MB."""


@dataclass(frozen=True, kw_only=True)
class Migration:
    """What switching from one plan to another copies between GPUs.

    Fields:
        source_LP: [L, P] for each physical slot of the new plan, the old plan's slot whose weights it
            takes (itself when unchanged; see :func:`migration` for the order of preference).
        moved_LP: [L, P] bool, True where the source is on another GPU (weights travel).
        experts_moved_L: [L] expert weights that travel per layer (one per GPU and expert arriving).
        expert_bytes: bytes of one expert's weights.
    """

    source_LP: torch.Tensor
    moved_LP: torch.Tensor
    experts_moved_L: torch.Tensor
    expert_bytes: int

    @property
    def experts_moved(self) -> int:
        return int(self.experts_moved_L.sum())

    @property
    def bytes_moved(self) -> int:
        return self.experts_moved * self.expert_bytes


@dataclass(frozen=True, kw_only=True)
class ReplanCheck:
    """How a re-plan (:func:`topology.replan`) compares with a fresh plan of the same load.

    Fields:
        balance_L, fresh_balance_L: [L] max/mean GPU load of the re-plan and of the fresh plan.
        off_home_L, fresh_off_home_L: [L] fraction of the load placed against locality (replicas off
            their group's home node; second replicas on one node of experts spread over all nodes).
        remote_nodes, fresh_remote_nodes: expected remote nodes per token of both, counted on the same
            routes (None when the re-plan skipped the traffic estimate).
        moved_slots_L, fresh_moved_slots_L: [L] slots that receive weights from another GPU, for the
            re-plan and for switching to the fresh plan instead.
        num_physical_experts: P.
        tolerance, locality_tolerance, max_moved: the re-plan's bars.
    """

    balance_L: torch.Tensor
    fresh_balance_L: torch.Tensor
    off_home_L: torch.Tensor
    fresh_off_home_L: torch.Tensor
    remote_nodes: float | None
    fresh_remote_nodes: float | None
    moved_slots_L: torch.Tensor
    fresh_moved_slots_L: torch.Tensor
    num_physical_experts: int
    tolerance: float
    locality_tolerance: float
    max_moved: float

    @property
    def balance_excess(self) -> float:
        """Worst layer's relative excess of max/mean GPU load over the fresh plan's."""
        return float((self.balance_L / self.fresh_balance_L).max()) - 1

    @property
    def remote_excess(self) -> float | None:
        """Relative excess of expected remote nodes per token over the fresh plan's."""
        if self.remote_nodes is None or not self.fresh_remote_nodes:
            return None
        return self.remote_nodes / self.fresh_remote_nodes - 1

    @property
    def within(self) -> bool:
        """Every layer within the balance tolerance and the locality bar, and the remote nodes per token
        within 2% of the fresh plan's when estimated."""
        slack = self.fresh_off_home_L * self.locality_tolerance + 0.002 + 1e-9
        remote = self.remote_excess
        return (self.balance_excess <= self.tolerance + 1e-9 and bool((self.off_home_L <= self.fresh_off_home_L + slack).all())
                and (remote is None or remote <= 0.02))

    def describe(self) -> str:
        """One line: within the bars, or how far from them, and what a full re-plan would move."""
        P = self.num_physical_experts
        moved = float(self.moved_slots_L.double().mean()) / P
        fresh = float(self.fresh_moved_slots_L.double().mean()) / P
        remote = self.remote_excess
        far = (f"balance {100 * self.balance_excess:+.2f}% (worst layer), load off home "
               f"{100 * float((self.off_home_L - self.fresh_off_home_L).max()):+.2f} points"
               + (f", remote nodes per token {100 * remote:+.2f}%" if remote is not None else ""))
        if self.within:
            return f"re-plan as good as a fresh plan ({far}), moving {100 * moved:.1f}% of the slots"
        return (f"re-plan short of a fresh plan: {far}, moving {100 * moved:.1f}% of the slots (at most "
                f"{100 * self.max_moved:.0f}%); a full re-plan moves {100 * fresh:.1f}%")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A placement of replicated experts onto GPUs, with the load and traffic it expects.

    Fields:
        phy2log_LP: [L, P] int64, logical expert held by each physical expert.
        log2phy_LER: [L, E, R] int64, physical experts of each logical expert (ascending), -1 padded.
        replica_counts_LE: [L, E] int64, replicas of each logical expert (>= 1).
        load_LE: [L, E] float64, the load planned for (any unit: tokens, routes per step).
        gpu_load_LG: [L, G] float64, expected load per GPU (each replica serves load / count).
        topology: the cluster planned for.
        policy: name of the policy that made the plan.
        expert_groups: groups of group-limited routing the plan assumed (None: no groups).
        traffic: expected dispatch traffic (None when not estimated).
        migration: weights copied from the plan this one replaced (set by :func:`replan`).
        replan_check: how the re-plan compares with a fresh plan (set by :func:`replan`).

    A token's route to logical expert ``e`` picks a replica with :meth:`physical_route`.
    """

    phy2log_LP: torch.Tensor
    log2phy_LER: torch.Tensor
    replica_counts_LE: torch.Tensor
    load_LE: torch.Tensor
    gpu_load_LG: torch.Tensor
    topology: Topology
    policy: str
    expert_groups: int | None = None
    traffic: Traffic | None = None
    migration: Migration | None = None
    replan_check: ReplanCheck | None = None

    # ------------------------------------------------------------------------------------- sizes
    @property
    def num_layers(self) -> int:
        return self.phy2log_LP.shape[0]

    @property
    def num_experts(self) -> int:
        return self.replica_counts_LE.shape[1]

    @property
    def num_physical_experts(self) -> int:
        return self.phy2log_LP.shape[1]

    @property
    def experts_per_gpu(self) -> int:
        return self.num_physical_experts // self.topology.num_gpus

    # ----------------------------------------------------------------------------------- balance
    @property
    def balance_L(self) -> torch.Tensor:
        """[L] max / mean GPU load per layer (1.0 is perfect; 1.0 for a layer without load)."""
        mean_L = self.gpu_load_LG.mean(-1)
        return torch.where(mean_L > 0, self.gpu_load_LG.max(-1).values / mean_L.clamp(min=1e-300), 1.0)

    @property
    def balance(self) -> float:
        """Mean over layers of max / mean GPU load (each layer's all-to-all waits for its busiest GPU)."""
        return float(self.balance_L.mean())

    # ----------------------------------------------------------------------------------- routing
    def gpu_of_physical(self) -> torch.Tensor:
        """[P] GPU holding each physical expert."""
        return torch.arange(self.num_physical_experts) // self.experts_per_gpu

    def replica_fractions(self, layer: int) -> torch.Tensor:
        """fraction_NER: share of source node n's routes to expert e that replica slot r takes."""
        node_of_physical = torch.tensor(self.topology.node_of_gpu).repeat_interleave(self.experts_per_gpu)
        return replica_fractions(self.log2phy_LER[layer], node_of_physical, self.topology.num_nodes)

    def physical_route(self, topk_idx_TK: torch.Tensor, layer: int, *, source_gpu: int,
                       token_index_T: torch.Tensor | None = None) -> torch.Tensor:
        """Maps logical routes of tokens on ``source_gpu`` to physical experts, deterministically.

        A route to expert e takes a replica on the token's own node when there is one with capacity
        left, else one elsewhere, each replica receiving ``load_e / count_e`` in expectation; which
        one is a pure function of (layer, source GPU, e, token index), see :mod:`topology.routing`.

        Args:
            topk_idx_TK: [T, K] int logical expert ids, -1 = no route.
            layer: MoE layer index.
            source_gpu: rank whose tokens these are.
            token_index_T: [T] int position of each token in the rank's batch (default 0..T-1).

        Returns:
            physical_idx_TK: [T, K] int64 physical expert ids, -1 where the route was -1.
        """
        if not isinstance(topk_idx_TK, torch.Tensor) or topk_idx_TK.dim() != 2:
            raise ValueError(f"topk_idx_TK: expected a [T, K] tensor, got {_describe(topk_idx_TK)}")
        if topk_idx_TK.dtype.is_floating_point or topk_idx_TK.dtype == torch.bool:
            raise TypeError(f"topk_idx_TK: expected an integer dtype, got {topk_idx_TK.dtype}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0..{self.num_layers - 1}, got {layer}")
        if not 0 <= source_gpu < self.topology.num_gpus:
            raise ValueError(f"source_gpu: expected 0..{self.topology.num_gpus - 1}, got {source_gpu}")
        T = topk_idx_TK.shape[0]
        if topk_idx_TK.numel() and (int(topk_idx_TK.min()) < -1 or int(topk_idx_TK.max()) >= self.num_experts):
            raise ValueError(f"topk_idx_TK: expected entries in -1 or [0, {self.num_experts}), got values in "
                             f"[{int(topk_idx_TK.min())}, {int(topk_idx_TK.max())}]")
        if token_index_T is None:
            token_index_T = torch.arange(T)
        elif token_index_T.shape != (T,):
            raise ValueError(f"token_index_T: expected shape ({T},), got {tuple(token_index_T.shape)}")
        device = topk_idx_TK.device
        idx_TK = topk_idx_TK.long().cpu()
        node = self.topology.node_of_gpu[source_gpu]
        e_TK = idx_TK.clamp(min=0)
        fraction_ER = self.replica_fractions(layer)[node]
        log2phy_ER = self.log2phy_LER[layer]
        physical_TK = choose_replicas(idx_TK, fraction_ER[e_TK], log2phy_ER[e_TK], token_index_T.cpu(), source_gpu)
        return physical_TK.to(device)

    # ---------------------------------------------------------------------------------- judging
    def evaluate(self, routes_LTK: torch.Tensor, *, tokens_per_gpu: int = 4096,
                 token_bytes: int = 7168 * 2) -> Traffic:
        """Judges the plan on routes it was not built from: a second sample, or the next window of
        measured routes (judged on its own, a plan fits the noise of its load). Every route picks its
        replica by :meth:`physical_route`'s rule, token ``t`` sitting on GPU ``t % G``.

        Args:
            routes_LTK: [L, T, K] int logical expert ids, -1 = no route.
            tokens_per_gpu, token_bytes: scale the counts to bytes per step.

        Returns:
            A :class:`Traffic` of those routes: ``balance`` / ``balance_L`` (max/mean routes a GPU
            received), remote nodes and intra-node copies per token, bytes per step.
        """
        routes_LTK = _check_routes(routes_LTK, self.num_layers, self.num_experts, "routes_LTK")
        for name, value in (("tokens_per_gpu", tokens_per_gpu), ("token_bytes", token_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        return count_traffic(self.phy2log_LP, self.experts_per_gpu, self.topology, routes_LTK,
                             num_experts=self.num_experts, tokens_per_gpu=tokens_per_gpu, token_bytes=token_bytes)

    # ------------------------------------------------------------------------------------ output
    def summary(self) -> str:
        """A few lines: sizes, replicas, balance, traffic (and migration when replanned)."""
        t = self.topology
        lines = [
            (f"plan '{self.policy}': {self.num_layers} layers, {self.num_experts} experts -> "
             f"{self.num_physical_experts} physical ({self.experts_per_gpu} per GPU) on {t.num_nodes} nodes x "
             f"{t.gpus_per_node} GPUs; groups: {self.expert_groups}"),
            (f"  replicas: max {int(self.replica_counts_LE.max())}, experts with >1: "
             f"{float((self.replica_counts_LE > 1).sum(-1).double().mean()):.1f} per layer"),
            (f"  balance (max/mean GPU load) on the load it was built from: mean over layers {self.balance:.4f}, "
             f"worst layer {float(self.balance_L.max()):.4f} (fitted; judge it with evaluate(held-out routes))"),
        ]
        if self.traffic is not None:
            tr = self.traffic
            inter = t.inter_node.kind if t.inter_node is not None else "none"
            lines.append(
                f"  expected traffic per token ({tr.sampled_tokens} sampled tokens a layer): "
                f"{tr.remote_nodes_per_token:.3f} remote nodes ({inter}), "
                f"{tr.intra_node_copies_per_token:.3f} intra-node copies ({t.intra_node.kind})")
            lines.append(
                f"  dispatch bytes per step ({tr.tokens_per_step} tokens x {self.num_layers} layers): "
                f"{inter} {tr.inter_node_bytes / 1e9:.2f} GB, {t.intra_node.kind} {tr.intra_node_bytes / 1e9:.2f} GB")
        if self.migration is not None:
            m = self.migration
            lines.append(f"  migration: {m.experts_moved} expert copies ({m.bytes_moved / 1e9:.2f} GB)")
        if self.replan_check is not None:
            lines.append(f"  {self.replan_check.describe()}")
        return "\n".join(lines)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


# ------------------------------------------------------------------------------------- validation
def _check_routes(routes_LTK: object, L: int, E: int, name: str) -> torch.Tensor:
    if (not isinstance(routes_LTK, torch.Tensor) or routes_LTK.dim() != 3 or routes_LTK.shape[0] != L
            or routes_LTK.dtype.is_floating_point or routes_LTK.dtype == torch.bool):
        raise ValueError(f"{name}: expected an integer [{L}, T, K] tensor, got {_describe(routes_LTK)}")
    if routes_LTK.numel() and (int(routes_LTK.min()) < -1 or int(routes_LTK.max()) >= E):
        raise ValueError(f"{name}: expected entries in -1 or [0, {E}), got values in "
                         f"[{int(routes_LTK.min())}, {int(routes_LTK.max())}]")
    return routes_LTK.long().cpu()


def _check_load(load: object, name: str = "load") -> torch.Tensor:
    if not isinstance(load, torch.Tensor):
        try:
            load = torch.as_tensor(load, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name}: expected a [layers, experts] tensor of numbers, got {type(load).__name__}") from exc
    if load.dtype.is_complex or load.dtype == torch.bool:
        raise TypeError(f"{name}: expected a real dtype, got {load.dtype}")
    if load.dim() != 2 or load.shape[0] < 1 or load.shape[1] < 1:
        raise ValueError(f"{name}: expected a [layers, experts] tensor with both >= 1, got shape {tuple(load.shape)}")
    load = load.detach().cpu().to(torch.float64)
    bad = ~torch.isfinite(load)
    if bad.any():
        raise ValueError(f"{name}: expected finite values, got {int(bad.sum())} NaN/Inf entries")
    if (load < 0).any():
        raise ValueError(f"{name}: expected values >= 0, got minimum {float(load.min())}")
    return load


def _check_args(load_LE: torch.Tensor, topology: object, num_physical_experts: object,
                expert_groups: object, policy: object) -> None:
    E = load_LE.shape[1]
    if not isinstance(topology, Topology):
        raise TypeError(f"topology: expected a topology.Topology, got {type(topology).__name__}")
    G = topology.num_gpus
    if not isinstance(num_physical_experts, int) or isinstance(num_physical_experts, bool):
        raise TypeError(f"num_physical_experts: expected an int, got {type(num_physical_experts).__name__}")
    if num_physical_experts < E:
        raise ValueError(f"num_physical_experts: expected at least the {E} logical experts, got {num_physical_experts}")
    if num_physical_experts % G:
        raise ValueError(f"num_physical_experts: expected a multiple of the {G} GPUs, got {num_physical_experts}")
    if expert_groups is not None:
        if not isinstance(expert_groups, int) or isinstance(expert_groups, bool) or expert_groups < 1:
            raise ValueError(f"expert_groups: expected a positive int or None, got {expert_groups!r}")
        if E % expert_groups:
            raise ValueError(f"expert_groups: expected a divisor of the {E} experts, got {expert_groups}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {sorted(POLICIES)}, got {policy!r}")


# ------------------------------------------------------------------------------------------ plans
def plan(
    load: torch.Tensor,
    topology: Topology,
    num_physical_experts: int,
    expert_groups: int | None = None,
    policy: str = "locality",
    *,
    traffic: TrafficModel | None = DEFAULT_TRAFFIC,
) -> Plan:
    """Decides replicas per expert and the GPU of every replica.

    Args:
        load: [L, E] per-expert load of every MoE layer (e.g. a moving average of routed tokens);
            finite, >= 0.
        topology: the cluster.
        num_physical_experts: P, replica slots per layer; >= E and a multiple of the GPUs.
        expert_groups: groups of group-limited routing (experts c*E/C .. (c+1)*E/C - 1 form group c),
            or None.
        policy: a name in :data:`POLICIES`.
        traffic: how to estimate traffic (see :class:`TrafficModel`); None skips the estimate.

    Returns:
        A :class:`Plan` with equal physical experts per GPU and every expert replicated at least once.
    """
    load_LE = _check_load(load)
    _check_args(load_LE, topology, num_physical_experts, expert_groups, policy)
    phy2log_LP = POLICIES[policy](load_LE, topology, num_physical_experts, expert_groups)
    return plan_from_phy2log(phy2log_LP, load_LE, topology, policy=policy, expert_groups=expert_groups,
                             traffic=traffic)


def plan_from_phy2log(
    phy2log_LP: torch.Tensor,
    load: torch.Tensor,
    topology: Topology,
    *,
    policy: str = "custom",
    expert_groups: int | None = None,
    traffic: TrafficModel | None = DEFAULT_TRAFFIC,
    migration: Migration | None = None,
) -> Plan:
    """Builds a :class:`Plan` (inverse map, counts, loads, traffic) from a physical-to-logical map."""
    load_LE = _check_load(load)
    L, E = load_LE.shape
    if not isinstance(phy2log_LP, torch.Tensor) or phy2log_LP.dim() != 2 or phy2log_LP.shape[0] != L:
        raise ValueError(f"phy2log_LP: expected a [{L}, P] tensor, got {_describe(phy2log_LP)}")
    phy2log_LP = phy2log_LP.long().cpu()
    P = phy2log_LP.shape[1]
    G = topology.num_gpus
    if P % G:
        raise ValueError(f"phy2log_LP: expected a multiple of the {G} GPUs physical experts, got {P}")
    if int(phy2log_LP.min()) < 0 or int(phy2log_LP.max()) >= E:
        raise ValueError(f"phy2log_LP: expected entries in [0, {E}), got [{int(phy2log_LP.min())}, "
                         f"{int(phy2log_LP.max())}]")
    counts_LE = torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, phy2log_LP, torch.ones_like(phy2log_LP))
    if (counts_LE == 0).any():
        layer, expert = (counts_LE == 0).nonzero()[0].tolist()
        raise ValueError(f"phy2log_LP: expected every logical expert at least once, expert {expert} is missing "
                         f"in layer {layer}")
    log2phy_LER = invert_phy2log(phy2log_LP, counts_LE)
    weight_LP = (load_LE / counts_LE).gather(1, phy2log_LP)
    gpu_load_LG = weight_LP.view(L, G, P // G).sum(-1)
    traffic_out = None
    if traffic is not None:
        routes_LTK = traffic.routes_LTK
        if routes_LTK is None:
            # Imported here so that `python -m topology.synthetic` runs cleanly.
            from .synthetic import draw_routes

            topk_groups = traffic.topk_groups
            if expert_groups is not None and topk_groups is None:
                topk_groups = max(1, expert_groups // 2)
            if expert_groups is not None:
                topk_groups = min(topk_groups, expert_groups)
            reachable = E if expert_groups is None else topk_groups * (E // expert_groups)
            popularity_LE = load_LE + 1e-9 * load_LE.sum(-1, keepdim=True).clamp(min=1) / E
            routes_LTK = draw_routes(popularity_LE, traffic.sample_tokens, min(traffic.topk, reachable),
                                     expert_groups=expert_groups,
                                     topk_groups=topk_groups, seed=traffic.seed)
        else:
            routes_LTK = _check_routes(routes_LTK, L, E, "traffic.routes_LTK")
        traffic_out = count_traffic(phy2log_LP, P // G, topology, routes_LTK, num_experts=E,
                                    tokens_per_gpu=traffic.tokens_per_gpu, token_bytes=traffic.token_bytes)
    return Plan(phy2log_LP=phy2log_LP, log2phy_LER=log2phy_LER, replica_counts_LE=counts_LE, load_LE=load_LE,
                gpu_load_LG=gpu_load_LG, topology=topology, policy=policy, expert_groups=expert_groups,
                traffic=traffic_out, migration=migration)


def invert_phy2log(phy2log_LP: torch.Tensor, counts_LE: torch.Tensor) -> torch.Tensor:
    """log2phy_LER: each expert's physical ids ascending, -1 padded to the largest count
    (``counts_LE``: each expert's physical ids per layer). Shared with ``ep_runtime.placement``."""
    L, P = phy2log_LP.shape
    E = counts_LE.shape[1]
    R = int(counts_LE.max())
    order_LP = (phy2log_LP * P + torch.arange(P)).sort(-1).indices
    expert_LP = phy2log_LP.gather(1, order_LP)
    rank_LP = torch.arange(P) - (counts_LE.cumsum(-1) - counts_LE).gather(1, expert_LP)
    log2phy_LER = torch.full((L, E * R), -1, dtype=torch.int64)
    log2phy_LER.scatter_(1, expert_LP * R + rank_LP, order_LP)
    return log2phy_LER.view(L, E, R)


def migration_sources(old_P: list[int], new_P: list[int], old_gpu_Q: list[int], new_gpu_P: list[int],
                      node_of_gpu: Sequence[int]) -> list[int]:
    """For each new slot, the old slot its weights come from: itself when it keeps its expert on
    its GPU, else a slot of its expert on the same GPU, on the same node, or the expert's lowest.
    Shared by :func:`migration` and the runtime's plan switch (``ep_runtime.placement``)."""
    on_gpu: dict[tuple[int, int], int] = {}
    on_node: dict[tuple[int, int], int] = {}
    anywhere: dict[int, int] = {}
    for q, e in enumerate(old_P):
        on_gpu.setdefault((e, old_gpu_Q[q]), q)
        on_node.setdefault((e, node_of_gpu[old_gpu_Q[q]]), q)
        anywhere.setdefault(e, q)
    sources = []
    for p, e in enumerate(new_P):
        g = new_gpu_P[p]
        if p < len(old_P) and old_P[p] == e and old_gpu_Q[p] == g:
            sources.append(p)
        else:
            sources.append(on_gpu.get((e, g), on_node.get((e, node_of_gpu[g]), anywhere[e])))
    return sources


def migration(old: Plan, new: Plan, *, expert_bytes: int = DEFAULT_EXPERT_BYTES) -> Migration:
    """The copies that turn ``old``'s placement into ``new``'s (same layers, experts and GPUs).

    Weights travel to a GPU only for an expert it did not hold before (a second replica on a GPU that
    already has one copies locally). Each new slot's source is, in order of preference: the same slot
    when it held the expert; another slot of the same GPU; a slot on the same node; the expert's
    lowest-numbered old replica.
    """
    if (old.num_layers, old.num_experts) != (new.num_layers, new.num_experts):
        raise ValueError(f"new: expected {old.num_layers} layers x {old.num_experts} experts like old, got "
                         f"{new.num_layers} x {new.num_experts}")
    if old.topology.node_of_gpu != new.topology.node_of_gpu:
        raise ValueError(f"new: expected the GPUs and nodes of old ({old.topology.num_nodes} x "
                         f"{old.topology.gpus_per_node}), got {new.topology.num_nodes} x {new.topology.gpus_per_node}")
    old_gpu_Q = (torch.arange(old.num_physical_experts) // old.experts_per_gpu).tolist()
    new_gpu_P = (torch.arange(new.num_physical_experts) // new.experts_per_gpu).tolist()
    L, P = new.phy2log_LP.shape
    source_LP = torch.tensor([migration_sources(old.phy2log_LP[layer].tolist(), new.phy2log_LP[layer].tolist(),
                                                old_gpu_Q, new_gpu_P, new.topology.node_of_gpu)
                              for layer in range(L)], dtype=torch.int64).view(L, P)
    moved_LP = torch.tensor(old_gpu_Q)[source_LP] != torch.tensor(new_gpu_P)
    # One transfer per (GPU, expert) that arrives; duplicates on that GPU copy locally.
    experts_moved_L = torch.tensor([len({(new_gpu_P[p], int(new.phy2log_LP[layer, p]))
                                         for p in moved_LP[layer].nonzero().flatten().tolist()})
                                    for layer in range(L)], dtype=torch.int64)
    return Migration(source_LP=source_LP, moved_LP=moved_LP, experts_moved_L=experts_moved_L,
                     expert_bytes=expert_bytes)
