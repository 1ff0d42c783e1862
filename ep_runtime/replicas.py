"""Collectives over a model's MoE layers that keep replicated experts identical and move experts
between ranks (``ep_runtime.placement`` says where they live).

* Gradients: ``sync_replica_gradients`` gives every slot the sum of its logical expert's slots'
  gradients over the EP group (one all-reduce per step, of the replicated experts only).
* Switching: ``switch_placement`` moves expert weights and their optimizer state so that every new
  slot holds its logical expert's tensors. Only what arrives on a rank that did not hold the expert
  travels (one all-to-all per layer, the same transfers ``topology.migration`` counts).

Every rank walks the layers in ``model.modules()`` order, so the collectives meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from topology.planner import migration_sources

from .moe import MoELayer
from .parallel import ParallelContext
from .placement import ExpertPlacement

__all__ = ["switch_placement", "sync_replica_gradients"]


def _moe_layers(model: nn.Module) -> list[MoELayer]:
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
    its experts, or none (checked; ``gradients.average_gradients`` gives every expert a gradient, so
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
