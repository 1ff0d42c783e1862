"""Checkpoints in torch.distributed.checkpoint (DCP) format, keyed by what each tensor is in the
whole model rather than where it sits, so a job of another world size, EP size or pipeline depth
loads them (experts resharded).

    <out_dir>/<name>/ckpt/step_<n>/.metadata, __<rank>_<i>.distcp    DCP's files
    <out_dir>/<name>/ckpt/step_<n>/complete.json                       the completion marker, written last

Keys: ``model/<key>`` for weights and buffers, ``optim/<key>/<state>`` for the optimizer's state of
each (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``), where ``<key>`` is

* a dense parameter's or buffer's name in the whole model (router biases included): a pipeline
  stage keeps the whole model's names, so a block is keyed by its global layer index,
  ``blocks.<layer>.attn.qkv.weight``. Every rank of a stage holds them; DCP writes each once;
* ``<experts>.w13_EDI2[<e>]``: logical expert ``e``'s slice of its layer's ``[E_local, ...]``
  parameter, whichever rank and slot holds it (replicas are identical: one is written). A loading
  rank reads the experts its own placement puts in its slots;
* ``<table>.weight_LE[rows <lo>:<hi>]``: an Engram table shard by its global rows; a loading rank
  reads the saved shards that overlap its rows;
* and ``rng/cpu`` (``rng/cuda`` on GPUs): the generators' state. A step draws nothing from them
  (the data is a pure function of the step and the sequence's index, ``data.MarkovText.batch``),
  so they are the same on every rank.

Saving does not stall the step: ``Checkpointer.save`` copies the state into host memory (all the
step waits for; buffers pinned on GPUs, made at the first save and kept: one host copy of the
rank's state for the run), then a background thread runs DCP's ``save`` over a gloo group of its
own (its collectives never meet the training's), each rank hashes the files it wrote, and rank 0 writes
``complete.json`` with every file's size and its pieces' sha256 (``checkpoint_verify``), logs a line, and
deletes all but the newest ``KEEP`` complete steps. The next save, a load and the end of training
wait for the thread.

Loading: rank 0 picks the newest valid step (skipping, with a line naming the file at fault, any
partial, truncated or corrupt one), every rank checks the model config it was saved with, puts
each MoE layer back on its saved placement when the EP size is the one it was saved at (else the
layer keeps its default placement), and reads its tensors straight into the live ones. Every
rank must be able to read the folder (a shared filesystem across nodes).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .checkpoint_verify import (MARKER, digests, fresh_run_refusal, newest_valid, prune, step_dir, steps_on_disk,
                                write_marker)
from .engram import ShardedTable
from .experts import GroupedExperts
from .moe import MoELayer
from .parallel import ParallelContext

log = logging.getLogger("ep_runtime.checkpoint")

KEEP = 2  # complete steps kept on disk; older ones are deleted once a save is complete
# Model options a resumed job may change: how tokens travel and what is recomputed, not the tensors
# or the function they compute. Every other ``model.*`` option must be the one saved.
# ``model.moe.fp8_dispatch`` is how checkpoints written before ``dispatch_format`` name it.
RUNTIME_OPTIONS = frozenset({"model.moe.dispatcher", "model.moe.max_tokens_per_rank", "model.moe.dispatch_format",
                             "model.moe.fp8_dispatch", "model.moe.fp8_combine", "model.mhc.recompute"})
_ROWS = re.compile(r"\[rows (\d+):(\d+)\]$")


@dataclass(frozen=True)
class _Piece:
    """One saved tensor: its ``key``, the live parameter or buffer it is part of, and which part:
    the whole, one logical expert (the local ``slots`` holding it; the first is saved), or the
    ``rows`` ``[lo, hi)`` of a table that the shard's first ``hi - lo`` rows hold."""

    key: str
    tensor: torch.Tensor
    slots: tuple[int, ...] = ()
    rows: tuple[int, int] | None = None

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full``, a tensor shaped like ``tensor`` (the parameter or a moment)."""
        if self.slots:
            return full[self.slots[0]]
        if self.rows:
            return full[: self.rows[1] - self.rows[0]]
        return full


def _pieces(model: nn.Module) -> list[_Piece]:
    """Every tensor this rank saves or loads, keyed as the module docstring says."""
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            owner.update({id(p): module for p in module.parameters(recurse=False)})
        elif isinstance(module, ShardedTable):
            owner[id(module.weight_LE)] = module
    pieces = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        module = owner.get(id(tensor))
        if isinstance(module, GroupedExperts):
            ids = module.logical_ids
            for e in dict.fromkeys(ids):  # each logical expert once, in slot order
                pieces.append(_Piece(f"{name}[{e}]", tensor, slots=tuple(s for s, x in enumerate(ids) if x == e)))
        elif isinstance(module, ShardedTable):
            lo, hi = module.first_row, min(module.first_row + module.rows_per_rank, module.num_rows)
            if hi > lo:  # a shard wholly past the table holds padding only
                pieces.append(_Piece(f"{name}[rows {lo}:{hi}]", tensor, rows=(lo, hi)))
        else:
            pieces.append(_Piece(name, tensor))
    return pieces


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
              staging: dict[str, torch.Tensor]) -> dict:
    """The state to save, copied into host memory (training may change the live tensors at once).
    The host buffers are ``staging``'s, made (pinned, on GPUs) at the first save and reused: filling
    fresh host memory ran at 0.6 GB/s, its pages' first touch (on the CPU machine; v3-layer's first
    save at EP 4 stalled 23-33 s for 20 GB a rank on H200s)."""
    live = {}
    for piece in _pieces(model):
        live[f"model/{piece.key}"] = piece.of(piece.tensor)
        for name, value in optimizer.state.get(piece.tensor, {}).items():
            if torch.is_tensor(value):
                whole = value.shape == piece.tensor.shape  # a moment; else a scalar such as the step
                live[f"optim/{piece.key}/{name}"] = piece.of(value) if whole else value
    for key in set(staging) - set(live):  # experts this rank no longer holds (a re-plan moved them)
        del staging[key]
    state = {}
    for key, tensor in live.items():
        host = staging.get(key)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = staging[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=device.type == "cuda")
        state[key] = host.copy_(tensor.detach(), non_blocking=True)
    state["rng/cpu"] = torch.get_rng_state()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
        state["rng/cuda"] = torch.cuda.get_rng_state(device)
    return state


def _placements(model: nn.Module) -> dict:
    """Each MoE layer's run-time placement by its name in the whole model (those that have one)."""
    return {name: {"phy2log": m.placement.phy2log_P.tolist(), "ep_size": m.placement.ep_size,
                   "node_of_rank": m.placement.node_of_rank}
            for name, m in model.named_modules() if isinstance(m, MoELayer) and m.placement is not None}


def _config_fields(model: nn.Module) -> dict:
    """The model's config (``model.cfg``, a dataclass) as dotted names, as JSON gives them back:
    ``{"model.moe.num_experts": 8, ...}``."""
    def flat(prefix: str, value) -> dict:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(f"{prefix}.{key}", item).items()}
        return {prefix: value}

    config = getattr(model, "cfg", None)
    return json.loads(json.dumps(flat("model", asdict(config)))) if config is not None else {}


def existing_checkpoints(directory: Path, *, overwrite: bool) -> None:
    """What a fresh run (no ``--resume``) does with a folder that holds checkpoints: raises
    FileExistsError, or with ``overwrite`` deletes them. Call on one rank, then meet the others."""
    refusal = fresh_run_refusal(directory)
    if refusal is None:
        return
    if not overwrite:
        raise FileExistsError(refusal)
    steps = steps_on_disk(directory)
    log.warning("--overwrite: deleting the checkpoints of steps %s under %s", ", ".join(map(str, steps)), directory)
    for step in steps:
        shutil.rmtree(step_dir(directory, step))


class Checkpointer:
    """Saves and loads one run's checkpoints under ``directory`` (see the module docstring).
    Collective to make (it makes the gloo group of the background saves), as are ``save``,
    ``latest`` and ``load``: every rank calls them at the same step."""

    def __init__(self, directory: Path, ctx: ParallelContext):
        self.directory, self.ctx = Path(directory), ctx
        self.group = dist.new_group(backend="gloo") if ctx.distributed else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: dict[str, torch.Tensor] = {}  # host copies of the state, reused by every save

    def save(self, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Copies the state to CPU and returns; a background thread writes and verifies it."""
        self.wait()
        start = time.perf_counter()
        state = _snapshot(model, optimizer, self.ctx.device, self._staging)
        marker = {"step": step, "model_config": _config_fields(model), "placements": _placements(model),
                  "saved_with": {"world_size": self.ctx.world_size, "ep_size": self.ctx.ep_size,
                                 "pp_size": self.ctx.pp_size}}
        log.info("checkpoint step %d: copied to CPU in %.3f s, writing %s in the background", step,
                 time.perf_counter() - start, step_dir(self.directory, step))
        self._thread = threading.Thread(target=self._background, args=(step, state, marker), daemon=True,
                                        name=f"checkpoint step {step}")
        self._thread.start()

    def wait(self) -> None:
        """Waits for the save in progress; raises if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint under {self.directory}: the background save failed: {error}") from error

    def _background(self, step: int, state: dict, marker: dict) -> None:
        try:
            self._write(step, state, marker)
        except BaseException as error:  # raised by the next wait(), on the training thread
            self._error = error

    def _write(self, step: int, state: dict, marker: dict) -> None:
        start, rank = time.perf_counter(), self.ctx.rank
        folder = step_dir(self.directory, step)
        if rank == 0 and folder.exists():  # a partial or stale save of this step (the others wait in save)
            shutil.rmtree(folder)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), process_group=self.group,
                 no_dist=self.group is None)
        mine = (digests(sorted(folder.glob(f"__{rank}_*.distcp"))), marker["placements"])
        every = [mine]
        if self.group is not None:
            every = [None] * self.ctx.world_size
            dist.all_gather_object(every, mine, group=self.group)
        if rank != 0:
            return
        files = digests([folder / ".metadata"])
        for rank_files, placements in every:
            files.update(rank_files)
            marker["placements"].update(placements)  # each pipeline stage has its own layers
        write_marker(folder, {**marker, "files": files})
        prune(self.directory, KEEP)
        size = sum(f["bytes"] for f in files.values())
        log.info("checkpoint step %d: saved %s (%d files, %.1f MB, sha256 in %s) in %.2f s in the background",
                 step, folder, len(files), size / 1e6, MARKER, time.perf_counter() - start)

    def latest(self) -> tuple[int, dict] | None:
        """``(step, marker)`` of the newest valid checkpoint, None if there is none. Rank 0 checks
        (logging each one it skips) and tells the others."""
        self.wait()
        found = newest_valid(self.directory) if self.ctx.rank == 0 else None
        if self.group is not None:
            box = [found]
            dist.broadcast_object_list(box, src=0, group=self.group)
            found = box[0]
        return found

    def load(self, step: int, marker: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Restores ``step`` (``marker``: its ``complete.json``, from ``latest``) into ``model``, a
        fresh ``optimizer`` over its parameters and the generators."""
        from .placement import ExpertPlacement

        self.wait()
        folder = step_dir(self.directory, step)
        saved_config, config = marker.get("model_config", {}), _config_fields(model)
        differ = "; ".join(f"{name} saved {saved_config[name]!r}, this job {config.get(name)!r}"
                           for name in sorted(set(saved_config) | set(config))
                           if saved_config.get(name) != config.get(name) and name not in RUNTIME_OPTIONS)
        if differ:
            raise ValueError(f"checkpoint {folder}: {differ}: resume with the model options it was saved with")
        for name, layer in model.named_modules():
            saved = marker.get("placements", {}).get(name)
            if saved is None or not isinstance(layer, MoELayer):
                continue
            if saved["ep_size"] == layer.ep_size and len(saved["phy2log"]) == layer.dispatcher.num_experts:
                nodes = tuple(saved["node_of_rank"]) if saved["node_of_rank"] is not None else None
                layer.set_placement(ExpertPlacement(phy2log_P=torch.tensor(saved["phy2log"]), ep_size=layer.ep_size,
                                                    num_experts=layer.cfg.num_experts, node_of_rank=nodes))
            else:
                log.info("checkpoint %s: %s was placed for EP %d, this job runs EP %d: its experts take the "
                         "default placement", folder, name, saved["ep_size"], layer.ep_size)
        start = time.perf_counter()
        metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        # DCP reads straight into the live tensors (an expert's first slot; moments made first),
        # not through host copies: a fresh host tensor fills at 0.6 GB/s (see ``_snapshot``).
        # Through host tensors: an Engram shard's rows from the saved shards that overlap them, and
        # scalars such as AdamW's step.
        state, replicas, scalars, shard_rows = {}, [], [], []
        for piece in _pieces(model):
            for key, rows in _saved_parts(piece, metadata, folder):
                saved_shape = metadata[f"model/{key}"].size
                for full in [f"model/{key}"] + sorted(k for k in metadata if k.startswith(f"optim/{key}/")):
                    meta, name = metadata[full], full.rsplit("/", 1)[1]
                    if full.startswith("model/"):
                        live = piece.tensor
                    elif meta.size == saved_shape:  # a moment
                        moments = optimizer.state[piece.tensor]
                        if name not in moments:
                            moments[name] = torch.zeros_like(piece.tensor)
                        live = moments[name]
                    else:
                        state[full] = torch.empty(meta.size, dtype=meta.properties.dtype)
                        scalars.append((piece.tensor, name, full))
                        continue
                    if rows is not None:
                        state[full] = torch.empty(meta.size, dtype=meta.properties.dtype)
                        shard_rows.append((piece, rows, live, full))
                    else:
                        state[full] = piece.of(live).detach()
                        if len(piece.slots) > 1:
                            replicas.append((live, piece.slots))
        for key in ("rng/cpu", "rng/cuda") if self.ctx.device.type == "cuda" else ("rng/cpu",):
            if key in metadata:
                state[key] = torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
        with torch.no_grad():
            dcp.load(state, storage_reader=dcp.FileSystemReader(folder), process_group=self.group,
                     no_dist=self.group is None)
            for live, slots in replicas:  # the other slots of a replicated expert
                for slot in slots[1:]:
                    live[slot].copy_(live[slots[0]])
            on_device = {p: group.get("fused") or group.get("capturable")
                         for group in optimizer.param_groups for p in group["params"]}
            for param, name, full in scalars:  # where the optimizer keeps them: fused AdamW on the device
                scalar = state[full]
                optimizer.state[param][name] = scalar.to(param.device) if on_device[param] else scalar
            for piece, rows, live, full in shard_rows:
                _place_rows(piece, rows, live, state[full])
        torch.set_rng_state(state["rng/cpu"])
        if "rng/cuda" in state:
            torch.cuda.set_rng_state(state["rng/cuda"], self.ctx.device)
        log.info("checkpoint step %d: loaded in %.2f s", step, time.perf_counter() - start)


def _saved_parts(piece: _Piece, metadata: dict, folder: Path) -> list[tuple[str, tuple[int, int] | None]]:
    """The saved keys ``piece`` loads from: itself, or for table rows every saved shard that
    overlaps them (with that shard's rows). Raises ValueError naming what is missing."""
    if piece.rows is None:
        if f"model/{piece.key}" not in metadata:
            raise ValueError(f"checkpoint {folder}: holds no {piece.key}: resume with the model options it was "
                             "saved with")
        return [(piece.key, None)]
    base, (lo, hi) = _ROWS.sub("", piece.key), piece.rows
    parts, covered = [], 0
    for key in metadata:
        match = _ROWS.search(key) if key.startswith(f"model/{base}[rows ") else None
        if match and int(match.group(1)) < hi and int(match.group(2)) > lo:
            parts.append((key[len("model/"):], (int(match.group(1)), int(match.group(2)))))
            covered += min(hi, parts[-1][1][1]) - max(lo, parts[-1][1][0])
    if covered != hi - lo:
        raise ValueError(f"checkpoint {folder}: its shards of {base} cover {covered} of rows {lo}:{hi}")
    return parts


def _place_rows(piece: _Piece, rows: tuple[int, int], target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copies the rows a saved shard (``loaded``, rows ``[lo, hi)`` of the table) shares with this
    rank's into ``target`` (the shard or its moment)."""
    lo, hi = max(piece.rows[0], rows[0]), min(piece.rows[1], rows[1])
    target[lo - piece.rows[0]: hi - piece.rows[0]].copy_(loaded[lo - rows[0]: hi - rows[0]])
