"""Expert placement at run time: routes on logical experts go to physical replica slots, replicas
stay identical, and the placement can change between steps.

A layer's placement (``ExpertPlacement``, one row ``phy2log_P`` of ``topology.Plan.phy2log_LP``)
says which logical expert each of ``P`` physical slots holds; EP rank ``r`` holds slots
``[r * P / W, (r + 1) * P / W)``. Every slot of a logical expert holds the same weights (and
optimizer state), so which replica serves a route changes where the work runs, not what it computes.

* Routing: a route to logical expert ``e`` from a token of EP rank ``r`` goes to one of ``e``'s
  slots by ``topology.Plan.physical_route``'s rule (local node first, every replica serving
  ``1 / count_e`` of the routes; the pick is a pure function of the placement, ``r``'s node, ``e`` and
  the token's position in ``r``'s batch). The dispatcher works over the ``P`` physical experts.
* Gradients: ``sync_replica_gradients`` gives every slot the sum of its logical expert's slots'
  gradients over the EP group (one all-reduce per step, of the replicated experts only).
* Switching: ``switch_placement`` moves expert weights and their optimizer state so that every new
  slot holds its logical expert's tensors. Only what arrives on a rank that did not hold the expert
  travels (one all-to-all per layer, the same transfers ``topology.migration`` counts).

Shape letters: T tokens, K routes per token, E logical experts, P physical slots over the EP group,
S slots per rank (``P / W``), R replicas per expert (max, -1 padded), W EP ranks, L MoE layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kernels.validate import check_index_range, check_tensor
from topology.planner import invert_phy2log, migration_sources
from topology.routing import choose_replicas, replica_fractions

from .parallel import ParallelContext

__all__ = ["ExpertPlacement", "placements_from_phy2log", "placements_from_plan", "switch_placement",
           "sync_replica_gradients"]


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
        fraction_ER, log2phy_ER = self.route_tables(ep_rank)
        return route_to_replicas(topk_idx_TK, fraction_ER.to(topk_idx_TK.device), log2phy_ER.to(topk_idx_TK.device),
                                 ep_rank=ep_rank)


def route_to_replicas(topk_idx_TK: torch.Tensor, fraction_ER: torch.Tensor, log2phy_ER: torch.Tensor, *,
                      ep_rank: int) -> torch.Tensor:
    """The replica pick of ``ExpertPlacement.physical_route`` from ``ep_rank``'s ``route_tables``
    (on the routes' device, no host sync)."""
    idx_TK = topk_idx_TK.long()
    e_TK = idx_TK.clamp(min=0)
    token_index_T = torch.arange(idx_TK.shape[0], device=idx_TK.device)
    return choose_replicas(idx_TK, fraction_ER[e_TK], log2phy_ER[e_TK], token_index_T, ep_rank)


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


# ------------------------------------------------------------------------------------------------
# Collectives over the model's MoE layers (same order on every rank: ``model.modules()`` order).


def _moe_layers(model: nn.Module) -> list:
    from .moe import MoELayer  # moe imports this module

    return [m for m in model.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def sync_replica_gradients(model: nn.Module, ctx: ParallelContext) -> None:
    """Gives every physical slot of a replicated logical expert the sum of the gradients of all that
    expert's slots over the EP group, so that replicas take identical optimizer steps.

    Only the ranks holding an expert exchange its gradient: each holder adds up its own slots, the
    holder of the expert's lowest slot (its primary) receives the other holders' sums and adds them
    in rank order, then sends the total back, so every replica gets the same bits. Two
    ``all_to_all_single`` calls over ``ctx.ep_group`` for all layers together (none when no
    replica sits on another rank); a rank moves about (replica slots it holds) x (expert gradient)
    bytes, not (replicated experts) x (expert gradient) as an all-reduce of every replicated expert
    would. A slot that got no gradient counts as zeros.

    Collective over the EP group: every rank calls it, after backward and before the optimizer step.
    """
    jobs: list[_ReplicaJob] = []  # per replicated expert, same order on every rank
    for layer in _moe_layers(model):
        placement = layer.placement
        if placement is None or not bool((placement.replica_counts_E > 1).any()):
            continue
        params = list(layer.experts.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for e in (placement.replica_counts_E > 1).nonzero().flatten().tolist():
            slots_e = (placement.phy2log_P == e).nonzero().flatten().tolist()
            holders = sorted({placement.rank_of_slot(q) for q in slots_e})
            slots = [s for s, x in enumerate(layer.experts.logical_ids) if x == e]
            jobs.append(_ReplicaJob(params=params, slots=slots, holders=holders))
    me = ctx.ep_rank
    total = {i: _slot_sum(j) for i, j in enumerate(jobs) if j.slots}  # this rank's own slots first
    cross = [i for i, j in enumerate(jobs) if len(j.holders) > 1]
    if cross:
        if ctx.ep_group is None or ctx.ep_size == 1:
            raise ValueError(f"sync_replica_gradients: replicas on several ranks need an EP group, got "
                             f"EP size {ctx.ep_size}")
        dtype = jobs[0].params[0].grad.dtype
        # Phase 1: the other holders -> the primary, which adds them in rank order.
        up = [i for i in cross if me in jobs[i].holders[1:]]
        incoming = [(i, r) for i in cross if jobs[i].holders[0] == me for r in jobs[i].holders[1:]]
        rows = _exchange_rows([(jobs[i].holders[0], total[i]) for i in up],
                              [(r, jobs[i].row_numel) for i, r in incoming], dtype, ctx)
        for (i, _), row in zip(sorted(incoming, key=lambda x: x[1]), rows):
            total[i] = total[i] + row
        # Phase 2: the primary -> the other holders: every replica gets the same bits.
        down = [(r, total[i]) for i in cross if jobs[i].holders[0] == me for r in jobs[i].holders[1:]]
        rows = _exchange_rows(down, [(jobs[i].holders[0], jobs[i].row_numel) for i in up], dtype, ctx)
        for i, row in zip(sorted(up, key=lambda i: jobs[i].holders[0]), rows):
            total[i] = row
    for i, job in enumerate(jobs):
        if not job.slots:
            continue
        for p, chunk in zip(job.params, total[i].split([p[0].numel() for p in job.params])):
            for s in job.slots:
                p.grad[s] = chunk.view_as(p.grad[s])


@dataclass(frozen=True)
class _ReplicaJob:
    """One replicated expert of one layer: its layer's expert parameters, this rank's slots of it
    (maybe none) and the ranks holding it (ascending; the first is its primary)."""

    params: list[nn.Parameter]
    slots: list[int]
    holders: list[int]

    @property
    def row_numel(self) -> int:
        return sum(p[0].numel() for p in self.params)


def _slot_sum(job: _ReplicaJob) -> torch.Tensor:
    """This rank's slots' gradients of the expert added up (slot order), all parameters in one row."""
    rows = []
    for p in job.params:
        acc = p.grad[job.slots[0]].clone()
        for s in job.slots[1:]:
            acc += p.grad[s]
        rows.append(acc.flatten())
    return torch.cat(rows)


def _exchange_rows(send: list[tuple[int, torch.Tensor]], recv: list[tuple[int, int]], dtype: torch.dtype,
                   ctx: ParallelContext) -> list[torch.Tensor]:
    """One ``all_to_all_single`` of 1-D rows: ``send`` (destination rank, row), ``recv`` (source
    rank, numel) in the order the peers send them. Rows go out grouped by destination rank (keeping
    their order within a rank) and come back in ``recv``'s order stably sorted by source rank."""
    W = ctx.ep_size
    order = sorted(range(len(send)), key=lambda i: send[i][0])
    rows = [send[i][1] for i in order]
    device = rows[0].device if rows else ctx.device
    send_splits = [sum(r.numel() for d, r in send if d == w) for w in range(W)]
    incoming = sorted(recv, key=lambda x: x[0])
    recv_splits = [sum(n for s, n in incoming if s == w) for w in range(W)]
    out = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    dist.all_to_all_single(out, torch.cat(rows) if rows else out.new_empty(0), recv_splits, send_splits,
                           group=ctx.ep_group)
    return list(out.split([n for _, n in incoming]))


@dataclass(frozen=True)
class _Transfer:
    """Logical expert ``expert`` arrives on rank ``dest`` from old slot ``source`` (another rank's)."""

    dest: int
    expert: int
    source: int


def _transfers(old: ExpertPlacement, new: ExpertPlacement) -> tuple[list[int], list[_Transfer]]:
    """For each new slot, its old source slot, and the transfers between ranks (one per rank and
    expert arriving), by ``topology.planner.migration_sources``: the same slot, a slot of the same
    rank, a slot on the same node, the expert's lowest old slot."""
    old_P, new_P = old.phy2log_P.tolist(), new.phy2log_P.tolist()
    old_rank_Q = [old.rank_of_slot(q) for q in range(len(old_P))]
    new_rank_P = [new.rank_of_slot(p) for p in range(len(new_P))]
    sources = migration_sources(old_P, new_P, old_rank_Q, new_rank_P, [new._node(r) for r in range(new.ep_size)])
    transfers, seen = [], set()
    for p, (e, q) in enumerate(zip(new_P, sources)):
        r = new_rank_P[p]
        if old_rank_Q[q] != r and (r, e) not in seen:
            seen.add((r, e))
            transfers.append(_Transfer(dest=r, expert=e, source=q))
    return sources, transfers


def _slot_tensors(layer, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors with one row per local slot: the experts' parameters, then their optimizer state
    (AdamW's exp_avg, exp_avg_sq, ...; a per-parameter ``step`` is the same for every slot and stays)."""
    tensors = []
    for p in layer.experts.parameters():
        tensors.append(p.data)
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == p.shape[0]:
                tensors.append(value)
    return tensors


def _check_same_slot_tensors(layers, optimizer: torch.optim.Optimizer | None, ctx: ParallelContext) -> None:
    """Every rank must send the same tensors a slot (the weights, and optimizer state on all ranks or
    on none): otherwise the rows exchanged would not line up. One small collective, raised on every
    rank alike."""
    if ctx.ep_group is None or ctx.ep_size == 1:
        return
    mine = torch.tensor([len(_slot_tensors(layer, optimizer)) for layer in layers], device=ctx.device)
    every = [torch.empty_like(mine) for _ in range(ctx.ep_size)]
    dist.all_gather(every, mine, group=ctx.ep_group)
    per_rank = [t.tolist() for t in every]
    if any(counts != per_rank[0] for counts in per_rank):
        raise ValueError(f"optimizer: expected optimizer state for the experts on every rank of the EP group or on "
                         f"none; tensors a slot per layer, by rank: {per_rank}")


@torch.no_grad()
def switch_placement(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     new_placements: Sequence[ExpertPlacement], ctx: ParallelContext) -> list[int]:
    """Switches the model's MoE layers to ``new_placements`` (one per MoE layer, in model order)
    between steps: each rank's new slots get their logical expert's weights and optimizer state,
    and routes pick replicas of the new placement from then on. Training then continues exactly as
    a run that started on the new placement with the same weights and optimizer state.

    Each rank keeps what it already holds (a slot whose expert was on the same rank copies
    locally); an expert arriving on a rank that did not hold it travels once, as raw bytes of its
    weights and optimizer state rows, in one ``all_to_all_single`` per layer over the EP group.
    These are the transfers ``topology.migration(old_plan, new_plan)`` counts
    (``Migration.experts_moved_L``), and its ``moved_LP`` marks the slots that receive them.

    Cost: per moved expert, its weights plus its per-slot optimizer state (AdamW: exp_avg and
    exp_avg_sq, so 3x the weights' bytes), sent once; nothing else travels. (The simplest scheme,
    an all-gather of every logical expert's tensors, would move ``E`` experts' worth to every rank.)
    Memory: a second copy of one layer's local slot tensors while it is rebuilt.

    The physical size ``P`` must stay the dispatcher's. Every rank must hold optimizer state for
    its experts, or none (checked; ``train.average_gradients`` gives every expert a gradient, so
    after the first step all do); a per-parameter ``step`` is shared by all slots and stays. Gradients left
    on the experts (of the old slots) are dropped. Collective over the EP group. Returns the
    experts moved per layer.
    """
    layers = _moe_layers(model)
    if len(new_placements) != len(layers):
        raise ValueError(f"new_placements: expected one placement per MoE layer ({len(layers)}), "
                         f"got {len(new_placements)}")
    for i, (layer, new) in enumerate(zip(layers, new_placements)):
        layer.check_placement(new, name=f"new_placements[{i}]")
    _check_same_slot_tensors(layers, optimizer, ctx)
    moved = []
    for layer, new in zip(layers, new_placements):
        old = layer.placement or ExpertPlacement.identity(layer.cfg.num_experts, new.ep_size)
        sources, transfers = _transfers(old, new)
        moved.append(len(transfers))
        me, S = layer.ep_rank, new.slots_per_rank
        for p in layer.experts.parameters():
            p.grad = None
        tensors = _slot_tensors(layer, optimizer)
        received = _exchange(tensors, old, transfers, me, ctx)
        arrived = {t.expert: row for t, row in zip([t for t in transfers if t.dest == me], received)}
        new_rows = []
        for slot in range(me * S, (me + 1) * S):
            q = sources[slot]
            if old.rank_of_slot(q) == me:
                new_rows.append([t[q - me * S].clone() for t in tensors])
            else:
                new_rows.append(_unpack(arrived[int(new.phy2log_P[slot])], tensors))
        for j, t in enumerate(tensors):
            t.copy_(torch.stack([row[j] for row in new_rows]))
        layer.set_placement(new)
    return moved


def _row_bytes(tensors: list[torch.Tensor], row: int) -> torch.Tensor:
    return torch.cat([t[row].contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unpack(row_B: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in tensors:
        n = t[0].numel() * t.element_size()
        out.append(row_B[start:start + n].view(t.dtype).view(t.shape[1:]).clone())
        start += n
    return out


def _exchange(tensors: list[torch.Tensor], old: ExpertPlacement, transfers: list[_Transfer], me: int,
              ctx: ParallelContext) -> list[torch.Tensor]:
    """Sends this rank's outgoing expert rows (grouped by destination rank) and returns the rows
    arriving here, in the order of ``transfers``. The counts follow from the placements: no count
    exchange."""
    if not transfers:
        return []
    W, S = old.ep_size, old.slots_per_rank
    row_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
    device = tensors[0].device
    outgoing = sorted((t for t in transfers if old.rank_of_slot(t.source) == me), key=lambda t: t.dest)
    incoming = [t for t in transfers if t.dest == me]
    send_splits = [sum(t.dest == r for t in outgoing) * row_bytes for r in range(W)]
    recv_splits = [sum(old.rank_of_slot(t.source) == r for t in incoming) * row_bytes for r in range(W)]
    send_B = (torch.cat([_row_bytes(tensors, t.source - me * S) for t in outgoing]) if outgoing
              else torch.empty(0, dtype=torch.uint8, device=device))
    recv_B = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    if ctx.ep_group is None or ctx.ep_size == 1:
        raise ValueError(f"switch_placement: transfers between ranks need an EP group, got none for {W} EP ranks")
    dist.all_to_all_single(recv_B, send_B, recv_splits, send_splits, group=ctx.ep_group)
    # Rows arrive grouped by source rank (in each source's order: by destination, then transfer order).
    by_source: dict[int, list[torch.Tensor]] = {}
    offset = 0
    for r in range(W):
        n = recv_splits[r] // row_bytes
        by_source[r] = [recv_B[offset + k * row_bytes: offset + (k + 1) * row_bytes] for k in range(n)]
        offset += recv_splits[r]
    return [by_source[old.rank_of_slot(t.source)].pop(0) for t in incoming]
