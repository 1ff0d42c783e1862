"""Process groups, created in one place.

The ranks form a ``DeviceMesh`` of shape ``(dp, ep)`` with named dims: ``ep`` ranks (contiguous, so
an EP group stays inside a node when it fits) share one set of experts, and ``dp`` counts the
replicas of that set. EP borrows from data parallelism: every rank reads its own data, dense
parameters are averaged over all ranks, expert parameters over the ``dp`` replicas.

With pipeline parallelism (``parallel.pp > 1``) the mesh is ``(pp, dp, ep)``: stage ``s`` is ranks
``[s * world / pp, (s + 1) * world / pp)``, each stage a ``(dp, ep)`` mesh of its own (EP groups,
``dp`` replicas and a ``stage_group`` of all its ranks), and the ``pp`` group links the ranks of
one ``(dp, ep)`` position across stages (``ep_runtime/pipeline.md``).

A job without the torch.distributed environment (no ``WORLD_SIZE``) runs as one process that holds
every expert, with no process group at all.

The job's key-value store (a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``) is created here too: hosted
by the launcher when it says so (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun's agent, the Ray
launcher's driver), else by rank 0. Besides bootstrapping the process groups it carries failure
reports (``failures.report_failure``), so a rank whose collective broke can name the rank that caused it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelConfig
from .failures import DEVICE_WAITS, Activity, restart_count

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
    store: dist.Store | None = None  # the job's key-value store (failure reports)
    pp_rank: int = 0  # this rank's pipeline stage
    pp_size: int = 1
    pp_group: dist.ProcessGroup | None = None  # this (dp, ep) position in every stage; None: pp == 1
    stage_group: dist.ProcessGroup | None = None  # every rank of this stage; None: the whole job
    # An EP group spanning nodes: this rank's node within it, and its rail (the ranks of its local
    # index on every node). None while the EP group fits in one node.
    ep_node_group: dist.ProcessGroup | None = None
    ep_rail_group: dist.ProcessGroup | None = None
    activity: Activity = dataclasses.field(default_factory=lambda: Activity(), compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def node_rank(self) -> int:
        return node_rank()

    @property
    def where(self) -> str:
        """``rank 3 (node 1, local 1, pp 0, ep 1)``: how logs and errors name this process."""
        return f"rank {self.rank} (node {self.node_rank}, local {self.local_rank}, pp {self.pp_rank}, ep {self.ep_rank})"


def node_rank() -> int:
    """This process's node: ``GROUP_RANK`` as torchrun and the Ray launcher set it."""
    return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))


def default_device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def single_process(device: torch.device | None = None) -> ParallelContext:
    """One process holding every expert (the reference the EP tests compare against)."""
    device = device or default_device(0)
    return ParallelContext(rank=0, world_size=1, local_rank=0, device=device, ep_rank=0, ep_size=1,
                           ep_group=None, dp_group=None, mesh=None)


def init_parallel(cfg: ParallelConfig) -> ParallelContext:
    """Joins the job described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).
    Without it this is a one-process job, which holds every expert: asking it for more than one
    EP rank or pipeline stage is an error, not a silent EP 1."""
    if "WORLD_SIZE" not in os.environ:
        for name, size in (("parallel.ep", cfg.ep), ("parallel.pp", cfg.pp)):
            if size is not None and size > 1:
                raise ValueError(f"{name}: expected 1 in a process outside a distributed job (no WORLD_SIZE in the "
                                 f"environment), got {size}; start it with torchrun or ep-runtime train")
        return single_process()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    pp = cfg.pp
    if world % pp:
        raise ValueError(f"parallel.pp: expected a divisor of the world size {world}, got {pp}")
    ep = cfg.ep or world // pp
    if (world // pp) % ep:
        raise ValueError(f"parallel.ep: expected a divisor of the ranks per stage {world // pp}, got {ep}")
    device = default_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    DEVICE_WAITS.timeout_s = cfg.timeout_s  # a kernel waits on peers no longer than a collective
    store = None
    if not dist.is_initialized():
        store = job_store(rank, world, timeout)
        # A restarted torchrun job keeps its agent's store: each attempt bootstraps under its own
        # prefix, or ranks may read the addresses the previous attempt's ranks published.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore(f"ep_runtime/attempt_{restart_count()}/pg", store),
                                rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    pipeline = {}
    if pp == 1:
        mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    else:
        mesh = init_device_mesh(device.type, (pp, world // pp // ep, ep), mesh_dim_names=("pp", "dp", "ep"))
        per_stage = world // pp
        stage_groups = [dist.new_group(list(range(s * per_stage, (s + 1) * per_stage))) for s in range(pp)]
        pipeline = dict(pp_rank=mesh.get_local_rank("pp"), pp_size=pp, pp_group=mesh.get_group("pp"),
                        stage_group=stage_groups[rank // per_stage])
    ctx = ParallelContext(rank=rank, world_size=world, local_rank=local_rank, device=device,
                          ep_rank=mesh.get_local_rank("ep"), ep_size=ep, ep_group=mesh.get_group("ep"),
                          dp_group=mesh.get_group("dp"), mesh=mesh, store=store, **pipeline,
                          **ep_node_groups(mesh, ep, cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    log.info("%s of %d on %s: pp %d/%d, ep %d/%d, collective timeout %.0f s", ctx.where, world, device,
             ctx.pp_rank, pp, ctx.ep_rank, ep, cfg.timeout_s)
    return ctx


def ep_node_groups(mesh: DeviceMesh, ep: int, ranks_per_node: int) -> dict:
    """``ep_node_group`` and ``ep_rail_group`` of this rank (see ``ParallelContext``) when its EP
    group spans nodes of ``ranks_per_node`` ranks; none otherwise. Every rank creates every group
    (``new_group`` is collective)."""
    if ep <= ranks_per_node:
        return {}
    if ep % ranks_per_node:
        raise ValueError(f"parallel.ranks_per_node: expected a divisor of the EP size {ep}, got {ranks_per_node}")
    me = dist.get_rank()
    groups = {}
    for ep_ranks in mesh.mesh.reshape(-1, ep).tolist():
        nodes = [ep_ranks[i:i + ranks_per_node] for i in range(0, ep, ranks_per_node)]
        rails = [ep_ranks[i::ranks_per_node] for i in range(ranks_per_node)]
        for kind, members in [("ep_node_group", n) for n in nodes] + [("ep_rail_group", r) for r in rails]:
            group = dist.new_group(members)
            if me in members:
                groups[kind] = group
    return groups


def job_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's store at ``MASTER_ADDR:MASTER_PORT``: a client of the launcher's store when
    ``TORCHELASTIC_USE_AGENT_STORE=True``, else hosted by rank 0 (what ``env://`` does)."""
    hosted_by_launcher = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=rank == 0 and not hosted_by_launcher, timeout=timeout)


def lane_context(ctx: ParallelContext) -> ParallelContext:
    """``ctx`` with its EP groups (``ep_group``, ``ep_node_group``, ``ep_rail_group``) replaced by
    new groups of the same ranks: a second lane's (``ep_runtime.lanes``), whose collectives then
    never match the first lane's. Collective: every rank calls it (each makes every rank's groups,
    in one order)."""
    names = ("ep_group", "ep_node_group", "ep_rail_group")
    mine = [tuple(dist.get_process_group_ranks(g)) if (g := getattr(ctx, n)) is not None else None for n in names]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    made = {ranks: dist.new_group(list(ranks)) for ranks in sorted({r for per in everyone for r in per if r})}
    return dataclasses.replace(ctx, **{n: made[r] if r else None for n, r in zip(names, mine)})


def block_group(size: int) -> dist.ProcessGroup | None:
    """The group of ranks ``[k * size, (k + 1) * size)`` holding this rank: the job cut into blocks
    of ``size`` that run side by side (EP groups smaller than the job, for benchmarks). Every rank
    calls this; None for ``size == 1`` and for ranks past the last whole block (they wait).

    Blocks rather than one group of ``[0, size)`` with the others idle: the whole machine is busy,
    as in an EP x DP job, and every rank makes the same symmetric-memory calls (still one set of
    ranks per process: ``dispatch.symmetric.CudaHeap``)."""
    if size == 1:
        return None
    me, mine = dist.get_rank(), None
    for start in range(0, dist.get_world_size() - size + 1, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= me < start + size:
            mine = group
    return mine
