"""Checkpoints: one file per rank, loadable by a job of the same world size and EP size.

    <out_dir>/<name>/ckpt/step_<n>/rank_<r>.pt

A rank's file holds the model's config, its model state (the dense parameters every rank has, the
experts this rank holds, the router biases), its optimizer state, the step, the RNG state and the expert placement
it was saved under (world size, EP size and rank; the logical expert in each of its slots and each
MoE layer's run-time placement, which ``load`` restores before the weights). A step is complete when every
rank has its file: resuming picks the newest step that is complete on all ranks (they agree
through one all-gather), so a job killed while saving resumes from the step before, and a job of
another world size, EP size or model is told what differs instead of loading the wrong tensors
(options that leave the tensors as they were, such as the dispatcher, may change).

Each rank writes and deletes only its own files, so the directory need not be shared between
nodes as long as each rank resumes where it saved (a shared filesystem lets it resume anywhere).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .parallel import ParallelContext

KEEP = 2  # complete steps kept on disk; older ones are deleted after a save completes


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which experts this rank holds: as EP rank ``ep_rank`` of ``ep_size`` (in a job of
    ``world_size``), for every MoE layer the logical expert in each local slot
    (``local_experts``) and the layer's run-time placement (``phy2log``: the logical expert of every
    physical slot of the EP group, ``node_of_rank``; None: expert ``e`` in slot ``e``)."""

    world_size: int
    ep_size: int
    ep_rank: int
    num_experts: int
    local_experts: tuple[tuple[int, ...], ...]
    phy2log: tuple[tuple[int, ...] | None, ...]
    node_of_rank: tuple[tuple[int, ...] | None, ...]

    @staticmethod
    def of(model: nn.Module, ctx: ParallelContext) -> Placement:
        layers = model.moe_layers
        placements = [layer.placement for layer in layers]
        return Placement(world_size=ctx.world_size, ep_size=ctx.ep_size, ep_rank=ctx.ep_rank,
                         num_experts=layers[0].cfg.num_experts if layers else 0,
                         local_experts=tuple(tuple(layer.experts.logical_ids) for layer in layers),
                         phy2log=tuple(None if p is None else tuple(p.phy2log_P.tolist()) for p in placements),
                         node_of_rank=tuple(None if p is None else p.node_of_rank for p in placements))

    def describe(self) -> str:
        experts = self.local_experts[0] if self.local_experts else ()
        contiguous = experts == tuple(range(experts[0], experts[0] + len(experts))) if experts else True
        held = f"{experts[0]}..{experts[-1]}" if experts and contiguous else ", ".join(map(str, experts))
        return (f"world size {self.world_size}, EP {self.ep_size} (EP rank {self.ep_rank} holds experts {held} of "
                f"{self.num_experts}{' in its first MoE layer' if len(self.local_experts) > 1 else ''})")

    def same_job(self, other: Placement) -> bool:
        """The same ranks in the same EP groups (the experts may have moved since)."""
        return (self.world_size, self.ep_size, self.ep_rank, self.num_experts, len(self.local_experts)) == (
            other.world_size, other.ep_size, other.ep_rank, other.num_experts, len(other.local_experts))


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step}"


def rank_file(directory: Path, step: int, rank: int) -> Path:
    return step_dir(directory, step) / f"rank_{rank}.pt"


def save(directory: Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
         ctx: ParallelContext) -> Path:
    """Writes this rank's file for ``step`` (atomically: a temporary file renamed), waits for every
    rank's, then deletes this rank's files of all but the newest ``KEEP`` steps. Collective."""
    path = rank_file(directory, step, ctx.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model_config": _config_fields(model), "placement": asdict(Placement.of(model, ctx)),
             "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    if ctx.distributed:
        dist.barrier()  # every rank has this step now: older ones may go
    for old in _own_steps(directory, ctx.rank)[:-KEEP]:
        rank_file(directory, old, ctx.rank).unlink(missing_ok=True)
        _remove_if_empty(step_dir(directory, old))
    return path


def latest_step(directory: Path, ctx: ParallelContext) -> int | None:
    """The newest step with a file on every rank (None if there is none). Collective.

    Raises ValueError if some ranks have checkpoint files and others none: the checkpoint was saved
    by a job of another world size."""
    mine = set(_own_steps(directory, ctx.rank))
    every = [mine]
    if ctx.distributed:
        every = [set() for _ in range(ctx.world_size)]
        dist.all_gather_object(every, mine)
    common = set.intersection(*every)
    if common:
        return max(common)
    with_files = [r for r, steps in enumerate(every) if steps]
    if with_files:
        raise ValueError(f"checkpoint {directory}: ranks {with_files} have checkpoint files but ranks "
                         f"{[r for r in range(ctx.world_size) if r not in with_files]} of this job of "
                         f"{ctx.world_size} have none, so no step is complete: resume with the world size "
                         "it was saved with")
    return None


def load(directory: Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
         ctx: ParallelContext) -> None:
    """Restores this rank's state of ``step``: checks it was saved by the same ranks in the same
    EP groups, puts every MoE layer back on the placement it was saved under, then loads the
    tensors."""
    from .placement import ExpertPlacement

    path = rank_file(directory, step, ctx.rank)
    state = torch.load(path, map_location=ctx.device, weights_only=False)
    saved_config, config = state.get("model_config", {}), _config_fields(model)
    differ = "; ".join(f"{name} saved {saved_config[name]!r}, this job {config.get(name)!r}"
                       for name in saved_config if saved_config[name] != config.get(name))
    saved = Placement(**{k: _tuples(v) for k, v in state["placement"].items()})
    here = Placement.of(model, ctx)
    if not saved.same_job(here):
        sizes_differ = (saved.world_size, saved.ep_size) != (here.world_size, here.ep_size)
        fix = "the world size and EP size" if sizes_differ or not differ else "the model options"
        raise ValueError(f"checkpoint {path}: saved with {saved.describe()}; this job has {here.describe()}"
                         f"{f' ({differ})' if differ else ''}: resume with {fix} it was saved with")
    for layer, phy2log, nodes in zip(model.moe_layers, saved.phy2log, saved.node_of_rank):
        if phy2log is not None:
            layer.set_placement(ExpertPlacement(phy2log_P=torch.tensor(phy2log), num_experts=saved.num_experts,
                                                ep_size=saved.ep_size, node_of_rank=nodes))
    if Placement.of(model, ctx).local_experts != saved.local_experts:
        raise ValueError(f"checkpoint {path}: its MoE layers hold experts {saved.local_experts} on this rank, the "
                         f"model {Placement.of(model, ctx).local_experts}")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:  # torch's message lists every tensor: name the options instead
        first = str(error).splitlines()[0]
        raise ValueError(f"checkpoint {path}: {differ or first}: resume with the model options it was saved "
                         "with") from error
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"].cpu())
    if state["cuda_rng"] is not None and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), ctx.device)


def _config_fields(model: nn.Module) -> dict:
    """The model's config (``model.cfg``, a dataclass) as dotted names: ``{"model.moe.num_experts": 8, ...}``."""
    def flat(prefix: str, value) -> dict:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(f"{prefix}.{key}", item).items()}
        return {prefix: value}

    config = getattr(model, "cfg", None)
    return flat("model", asdict(config)) if config is not None else {}


def _tuples(value):
    """JSON-ish lists from ``asdict`` back to the tuples ``Placement`` holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def clear(directory: Path, ctx: ParallelContext) -> None:
    """Deletes this rank's checkpoint files (a fresh run must never resume from an older run's)."""
    for step in _own_steps(directory, ctx.rank):
        rank_file(directory, step, ctx.rank).unlink(missing_ok=True)
        _remove_if_empty(step_dir(directory, step))


def _own_steps(directory: Path, rank: int) -> list[int]:
    """Steps for which this rank has a file, ascending."""
    if not Path(directory).is_dir():
        return []
    steps = []
    for entry in Path(directory).iterdir():
        match = re.fullmatch(r"step_(\d+)", entry.name)
        if match and (entry / f"rank_{rank}.pt").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # other ranks' files are still there (shared filesystem), or it is gone
        pass
