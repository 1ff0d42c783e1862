"""Process groups, created in one place.

The ranks form a ``DeviceMesh`` of shape ``(dp, ep)`` with named dims: ``ep`` ranks (contiguous, so
an EP group stays inside a node when it fits) share one set of experts, and ``dp`` counts the
replicas of that set. EP borrows from data parallelism: every rank reads its own data, dense
parameters are averaged over all ranks, expert parameters over the ``dp`` replicas.

A job without the torch.distributed environment (no ``WORLD_SIZE``) runs as one process that holds
every expert, with no process group at all.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits. Groups are None in a single-process job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    ep_rank: int
    ep_size: int
    ep_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None  # the replicas of this rank's experts
    mesh: DeviceMesh | None

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))


def default_device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def single_process(device: torch.device | None = None) -> ParallelContext:
    """One process holding every expert (the reference the EP tests compare against)."""
    device = device or default_device(0)
    return ParallelContext(rank=0, world_size=1, local_rank=0, device=device, ep_rank=0, ep_size=1,
                           ep_group=None, dp_group=None, mesh=None)


def init_parallel(cfg: ParallelConfig) -> ParallelContext:
    """Joins the job described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    if "WORLD_SIZE" not in os.environ:
        return single_process()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ep = cfg.ep or world
    if world % ep:
        raise ValueError(f"parallel.ep: expected a divisor of the world size {world}, got {ep}")
    device = default_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    ctx = ParallelContext(rank=rank, world_size=world, local_rank=local_rank, device=device,
                          ep_rank=mesh.get_local_rank("ep"), ep_size=ep, ep_group=mesh.get_group("ep"),
                          dp_group=mesh.get_group("dp"), mesh=mesh)
    log.info("rank %d/%d (node %d, local %d) on %s: ep %d/%d", rank, world, ctx.node_rank, local_rank,
             device, ctx.ep_rank, ep)
    return ctx
