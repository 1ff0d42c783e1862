"""Online re-planning inside training: measured expert loads feed ``topology.replan`` every N steps,
the plan is made in a background thread, and experts move between EP ranks at a step boundary.

Every ``train.replan_every`` steps the :class:`Rebalancer` takes the expert loads of the steps since
the last plan (``train.global_expert_load``: all-reduced, so the same on every rank) and starts
``topology.replan`` from the layers' current placements in a thread; the training goes on with the
next step meanwhile. After that step (a fixed step on every rank, so the collectives meet) it waits
for the plan, which is then ready on every rank alike (the planner is deterministic), and
``replicas.switch_placement`` moves the experts whose slot changed, with their AdamW state, over
the EP group; the job keeps running. A plan that moves nothing costs no collective. A plan that
takes longer than that step (DeepSeek-V3's 58 layers on 32 x 8 GPUs: about 3 s on one core) makes
the step's end wait for it; the thread shares the interpreter's lock with the training loop, which
mostly waits on the device and on collectives (they release it).

Planning sees the EP group as a topology: its ranks on the nodes they run on. Pipelined jobs are
refused: each stage would plan only its own layers, untested.

Shape suffixes: L MoE layers, E logical experts, P physical slots, W EP ranks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from topology import Plan, Topology, plan_from_phy2log, replan

from .parallel import ParallelContext
from .placement import ExpertPlacement, placements_from_plan
from .replicas import switch_placement

__all__ = ["Rebalancer", "rank_load_imbalance"]

log = logging.getLogger("ep_runtime.rebalance")


def current_phy2log(layers: list[nn.Module], ep_size: int) -> torch.Tensor:
    """[L, P] the layers' placements (expert ``e`` in slot ``e`` for a layer without one)."""
    return torch.stack([(m.placement or ExpertPlacement.identity(m.cfg.num_experts, ep_size)).phy2log_P
                        for m in layers])


def rank_load_imbalance(layers: list[nn.Module], load_LE: torch.Tensor, ep_size: int) -> float:
    """Max/mean routes an EP rank receives under the layers' placements (a replica serving
    ``1 / count`` of its expert's), the worst layer; 1.0 for a step without routes."""
    phy2log_LP = current_phy2log(layers, ep_size)
    load_LE = load_LE.detach().to("cpu", torch.float64)
    count_LE = torch.zeros_like(load_LE).scatter_add_(1, phy2log_LP, torch.ones_like(phy2log_LP, dtype=torch.float64))
    share_LP = load_LE.gather(1, phy2log_LP) / count_LE.gather(1, phy2log_LP)
    rank_LW = share_LP.view(len(layers), ep_size, -1).sum(-1)
    mean_L = rank_LW.mean(-1)
    return float(torch.where(mean_L > 0, rank_LW.max(-1).values / mean_L.clamp(min=1e-300), 1.0).max())


@dataclass
class _Pending:
    """A plan being made: it is applied after step ``apply_at``."""

    apply_at: int
    thread: threading.Thread
    result: dict


class Rebalancer:
    """Re-plans the model's MoE layers every ``every`` steps from their measured load and moves the
    experts (see the module docstring). Call :meth:`after_step` once a step, after the optimizer
    step, with that step's ``[L, E]`` global expert load.

    Args:
        model: the model; its ``moe_layers`` are re-planned.
        optimizer: the optimizer whose per-expert state moves with the experts.
        ctx: the job's parallel context (the EP group moves the experts).
        every: steps between plans (>= 1).
        max_moved: the most slots of a layer (a fraction) one re-plan may move (``topology.replan``).
        expert_groups: the router's expert groups (``model.moe.router.num_groups``), kept on nodes.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, *, every: int,
                 max_moved: float, expert_groups: int = 1):
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"train.replan_every: expected an int >= 1 to re-plan, got {every!r}")
        if ctx.pp_size > 1:
            raise ValueError(f"train.replan_every: expected a job without pipeline stages (parallel.pp 1) to re-plan "
                             f"online, got parallel.pp {ctx.pp_size}")
        if not model.moe_layers:
            raise ValueError("train.replan_every: expected a model with MoE layers to re-plan, got none")
        self.model, self.optimizer, self.ctx = model, optimizer, ctx
        self.every, self.max_moved = every, max_moved
        self.expert_groups = expert_groups if expert_groups > 1 else None
        self.layers = list(model.moe_layers)
        self.topology = _ep_topology(ctx)
        self.window_LE = torch.zeros(len(self.layers), self.layers[0].cfg.num_experts, dtype=torch.float64)
        self.pending: _Pending | None = None

    def after_step(self, step: int, load_LE: torch.Tensor) -> list[int] | None:
        """Adds the step's load to the window; applies a plan that is due (returns the experts moved
        per layer, else None) and starts the next plan every ``every`` steps."""
        self.window_LE += load_LE.detach().to("cpu", torch.float64)
        moved = None
        if self.pending is not None and step >= self.pending.apply_at:
            moved = self._apply(self.pending)
            self.pending = None
        if step % self.every == 0 and self.pending is None:
            self.pending = self._start(step, self.window_LE.clone())
            self.window_LE.zero_()
        return moved

    def close(self) -> None:
        """Waits for a plan still being made (and drops it)."""
        if self.pending is not None:
            self.pending.thread.join()
            self.pending = None

    def _start(self, step: int, load_LE: torch.Tensor) -> _Pending:
        current = plan_from_phy2log(current_phy2log(self.layers, self.ctx.ep_size), load_LE, self.topology,
                                    expert_groups=self.expert_groups, traffic=None)
        result: dict = {}

        def work() -> None:
            try:
                result["plan"] = replan(current, load_LE, traffic=None, max_moved=self.max_moved)
            except BaseException as exc:  # re-raised on the training thread
                result["error"] = exc

        thread = threading.Thread(target=work, name=f"replan-step-{step}", daemon=True)
        thread.start()
        return _Pending(apply_at=step + 1, thread=thread, result=result)

    def _apply(self, pending: _Pending) -> list[int]:
        pending.thread.join()
        if "error" in pending.result:
            raise RuntimeError("train.replan_every: the background re-plan failed") from pending.result["error"]
        new: Plan = pending.result["plan"]
        moved_L = new.migration.moved_LP.sum(-1)
        if not bool(moved_L.any()):
            return [0] * len(self.layers)
        moved = switch_placement(self.model, self.optimizer, placements_from_plan(new), self.ctx)
        log.info("re-planned the experts after step %d: %d experts moved (per MoE layer %s); %s",
                 pending.apply_at, sum(moved), moved, new.replan_check.describe())
        return moved


def _ep_topology(ctx: ParallelContext) -> Topology:
    """The EP group as a topology: its ranks on their nodes (one all-gather)."""
    W = ctx.ep_size
    node_W = [ctx.node_rank] * W
    if ctx.ep_group is not None and W > 1:
        every = [torch.zeros(1, dtype=torch.int64, device=ctx.device) for _ in range(W)]
        dist.all_gather(every, torch.tensor([ctx.node_rank], device=ctx.device), group=ctx.ep_group)
        node_W = [int(t) for t in every]
    names = sorted(set(node_W))
    node_of_rank = tuple(names.index(n) for n in node_W)
    N = len(names)
    if any(node_of_rank.count(n) != W // N for n in range(N)) or W % N:
        raise ValueError(f"train.replan_every: expected the same number of EP ranks on every node, got nodes "
                         f"{node_W} for the EP ranks")
    base = Topology.uniform(N, W // N, gpu=ctx.device.type)
    return Topology(num_nodes=N, gpus_per_node=W // N, intra_node=base.intra_node, inter_node=base.inter_node,
                    node_of_gpu=node_of_rank, gpu=base.gpu, name=f"EP group {N}x{W // N}")
