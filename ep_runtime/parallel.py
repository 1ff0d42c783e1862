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
reports (``report_failure``), so a rank whose collective broke can name the rank that caused it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
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


class Activity:
    """What this process is waiting on other ranks for, if anything: ``with ctx.activity("the
    pipeline recv from rank 0"):`` around a wait. Failure reports name it, and ``FailureWatch``
    ends a process that has waited in one longer than the job's timeout (a wait no collective
    timeout covers: a host blocked in NCCL's first send to a peer, or in a CUDA sync behind one)."""

    def __init__(self):
        self.what: str | None = None
        self.since = 0.0

    @contextlib.contextmanager
    def __call__(self, what: str):
        outer = self.what, self.since
        self.what, self.since = what, time.monotonic()
        try:
            yield
        finally:
            self.what, self.since = outer

    def waiting(self) -> tuple[str, float] | None:
        """``(what, seconds so far)`` of the innermost wait in progress, None outside any."""
        what = self.what
        return None if what is None else (what, time.monotonic() - self.since)


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


# ---------------------------------------------------------------------------------------------
# Failure reports: the rank whose error came first takes the blame, a rank whose collective broke
# says whose fault it was, and a rank that is stuck does not outlive the job.


class RankFailed(RuntimeError):
    """Training failed on this rank. ``culprits`` are the ranks this rank holds responsible: itself
    when the error started here (``primary``), else the ranks that reported an error of their own,
    or those that never reported at all (withheld, hung or dead)."""

    def __init__(self, message: str, *, rank: int, culprits: tuple[int, ...], primary: bool):
        super().__init__(message)
        self.rank, self.culprits, self.primary = rank, culprits, primary

    def __reduce__(self):  # survives pickling (Ray sends it to the driver)
        return _rank_failed, (str(self), self.rank, self.culprits, self.primary)


def _rank_failed(message, rank, culprits, primary):
    return RankFailed(message, rank=rank, culprits=culprits, primary=primary)


def restart_count() -> int:
    """How many times the launcher has restarted this job (torchrun and the Ray launcher set it)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_communication_error(exc: BaseException) -> bool:
    """A collective or the store failed (timed out, or a peer went away): a consequence, usually,
    of another rank's failure. gloo raises plain RuntimeErrors naming its source files."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in ("/gloo/", "NCCL", "Connection closed by peer"))


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _report_key(name: object) -> str:
    """Store keys of this attempt's failure reports (a restarted torchrun job keeps its store)."""
    return f"ep_runtime/attempt_{restart_count()}/failed/{name}"


def report_failure(ctx: ParallelContext, exc: BaseException, *, step: int, grace_s: float) -> RankFailed:
    """Records this rank's failure in the job's store and returns the error to raise, naming the
    rank responsible. An error of this rank's own is reported at once. A communication error
    waits up to ``grace_s`` for the other ranks' reports, then names the ranks that reported an
    error of their own or, if none did, the ranks that never reported (withheld, hung or dead)."""
    comm = is_communication_error(exc)
    mine = {"where": ctx.where, "step": step, "error": _summary(exc), "comm": comm}
    waiting = ctx.activity.waiting()
    if not comm:
        if ctx.store is not None:
            with contextlib.suppress(Exception):  # a courtesy to the other ranks; the error stands anyway
                ctx.store.set(_report_key(ctx.rank), json.dumps(mine))
                ctx.store.add(_report_key("count"), 1)
        return RankFailed(f"{ctx.where} failed at step {step}: {mine['error']}", rank=ctx.rank,
                          culprits=(ctx.rank,), primary=True)
    during = f" after {waiting[1]:.0f} s in {waiting[0]}" if waiting else ""
    message = f"{ctx.where} stopped at step {step}{during}: a collective failed ({mine['error']})"
    if ctx.store is None:
        return RankFailed(message, rank=ctx.rank, culprits=(), primary=False)
    try:
        ctx.store.set(_report_key(ctx.rank), json.dumps(mine))
        reported = ctx.store.add(_report_key("count"), 1)
        deadline = time.monotonic() + grace_s
        while reported < ctx.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
            reported = ctx.store.add(_report_key("count"), 0)
        reports = {r: json.loads(ctx.store.get(_report_key(r))) for r in range(ctx.world_size)
                   if ctx.store.check([_report_key(r)])}
    except Exception as store_exc:  # noqa: BLE001 - the store's host may be the process that died
        return RankFailed(f"{message}; the job's store is unreachable too ({_summary(store_exc)}), so which rank "
                          "failed first is unknown here: see the launcher's report", rank=ctx.rank, culprits=(),
                          primary=False)
    own_errors = {r: rep for r, rep in reports.items() if not rep["comm"]}
    silent = tuple(r for r in range(ctx.world_size) if r not in reports)
    if own_errors:
        causes = "; ".join(f"{rep['where']} failed at step {rep['step']}: {rep['error']}"
                           for rep in own_errors.values())
        return RankFailed(f"{message}, because {causes}", rank=ctx.rank, culprits=tuple(own_errors), primary=False)
    if silent:
        names = ", ".join(f"rank {r}" for r in silent)
        return RankFailed(f"{message}: {names} never reported within {grace_s:.0f} s (withheld, hung or dead)",
                          rank=ctx.rank, culprits=silent, primary=False)
    return RankFailed(f"{message}; every rank reported a communication error", rank=ctx.rank, culprits=(),
                      primary=False)


class FailureWatch:
    """While active (a context manager), a thread ends this process if it has waited on other ranks
    (``ctx.activity``) longer than ``timeout_s``, reporting that wait as its failure; or if another
    rank has reported a failure and this one has neither finished nor reported within ``grace_s``,
    or the job's store has been unreachable that long: a withheld or stuck rank does not outlive
    its job (a launcher only ends the processes of its own node). Polls its own store connection
    every ``poll_s``; does nothing in a single-process job. ``step()`` is the step in progress."""

    def __init__(self, ctx: ParallelContext, *, grace_s: float, timeout_s: float, step=lambda: 0,
                 poll_s: float = 1.0):
        self.ctx, self.grace_s, self.timeout_s, self.step, self.poll_s = ctx, grace_s, timeout_s, step, poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ep_runtime-failure-watch", daemon=True)

    def __enter__(self) -> FailureWatch:  # noqa: PYI034
        if self.ctx.store is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        if self._thread.is_alive():  # its store connection must go before the interpreter does
            self._thread.join()

    def _watch(self) -> None:
        since = None  # when trouble was first seen
        store = None
        while not self._done.wait(self.poll_s):
            try:
                store = store or dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                               is_master=False, timeout=datetime.timedelta(seconds=10))
                self._end_if_stuck(store)
                if store.check([_report_key(self.ctx.rank)]) or store.add(_report_key("count"), 0) == 0:
                    since = None
                    continue
                trouble = "; ".join(json.loads(store.get(_report_key(r)))["where"] + " reported a failure"
                                    for r in range(self.ctx.world_size) if store.check([_report_key(r)]))
            except Exception as exc:  # noqa: BLE001 - the store's host has gone: the job is over
                trouble, store = f"the job's store is unreachable ({_summary(exc)})", None
            since = since or time.monotonic()
            if time.monotonic() - since >= self.grace_s and not self._done.is_set():
                log.error("%s: ending this process, which neither finished nor failed within %.0f s of this: %s",
                          self.ctx.where, self.grace_s, trouble)
                logging.shutdown()
                os._exit(1)

    def _end_if_stuck(self, store: dist.Store) -> None:
        """Ends this process, reported as the job's failure, once its current wait passed the timeout."""
        waiting = self.ctx.activity.waiting()
        if waiting is None or waiting[1] < self.timeout_s or self._done.is_set():
            return
        step, error = self.step(), f"waited {waiting[1]:.0f} s in {waiting[0]}"
        failure = RankFailed(f"{self.ctx.where} {error} at step {step}", rank=self.ctx.rank, culprits=(self.ctx.rank,),
                             primary=True)
        with contextlib.suppress(Exception):  # the store's host may be the peer it waits for
            store.set(_report_key(self.ctx.rank), json.dumps({"where": self.ctx.where, "step": step, "error": error,
                                                               "comm": False}))
            store.add(_report_key("count"), 1)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # the launcher's report names this failure
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(failure)
        log.error("%s", failure)
        logging.shutdown()
        os._exit(1)
