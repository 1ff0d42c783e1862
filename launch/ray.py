"""Ray launcher: one actor per worker in a placement group, torchrun's environment set up by the
driver, the same worker function as every other launcher.

    from launch.ray import RayConfig, launch_ray
    from ep_runtime.train import worker
    results = launch_ray(worker, job_config, config=RayConfig(address="auto", num_workers=16,
                                                               gpus_per_worker=1, max_restarts=2))

- Placement: ``num_workers`` bundles of ``{CPU: cpus_per_worker, GPU: gpus_per_worker}`` placed
  with the ``PACK`` strategy (as few nodes as possible), ranks numbered node by node, so that
  contiguous EP groups stay inside a node (an NVLink domain) when they fit.
- Rendezvous: the driver hosts the job's ``TCPStore`` (``MASTER_ADDR``/``MASTER_PORT`` with
  ``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun's agent does) and gives each actor ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (its node),
  ``GROUP_WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT``. A GPU worker sees every GPU of its
  node's workers (``CUDA_VISIBLE_DEVICES``, so NCCL's peer-to-peer paths stay open) and
  ``LOCAL_RANK`` is the index of its own.
  The driver's ``EP_*`` variables (``EP_KERNELS``, ``EP_RUNTIME_*``) are passed on too, as
  torchrun's workers inherit them.
- Logs: rank 0's lines stream to the driver (Ray's ``log_to_driver``); every rank's whole output
  goes to its log file under the run folder (``ep_runtime.run_log``).
- Failures: the first failed worker ends the attempt. The driver takes the report that names the
  rank responsible (a worker's own error, a worker process that died, or a survivor's
  ``RankFailed`` naming the ranks that never answered), kills every actor and raises
  ``WorkerFailed``, or, with restarts left, starts all workers again in a new placement group
  (``TORCHELASTIC_RESTART_COUNT`` + 1: ``ep_runtime.train.worker`` then resumes from its newest
  checkpoint).

Every node needs ep-runtime importable (``pip install -e .``, or the checkout on ``PYTHONPATH``
when starting Ray there); checkpoints of a restarted job must be readable where each rank lands
(a shared filesystem, or the same placement).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("launch.ray")

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    address: str | None = None  # "auto", "HOST:PORT", or None: RAY_ADDRESS, else a new local Ray instance
    num_workers: int | None = None  # None: one per GPU of the cluster for GPU workers, else 2
    gpus_per_worker: float | None = None  # 0: CPU workers (gloo); 1: one GPU each; None: 1 if the cluster has GPUs
    cpus_per_worker: float = 1.0
    max_restarts: int = 0  # restarts of the whole job after a worker failure (0: fail fast)
    strategy: str = "PACK"
    start_timeout_s: float = 300.0  # for the placement group to be placed
    grace_s: float = 60.0  # after a failure that names no rank, how long to wait for one that does

    def __post_init__(self):
        def require(ok, name, expected, got):
            if not ok:
                raise ValueError(f"ray.{name}: expected {expected}, got {got!r}")

        require(self.num_workers is None or self.num_workers >= 1, "num_workers", ">= 1", self.num_workers)
        require(self.gpus_per_worker is None or 0 <= self.gpus_per_worker <= 1, "gpus_per_worker",
                "in [0, 1] (one GPU per process)", self.gpus_per_worker)
        require(self.cpus_per_worker >= 0, "cpus_per_worker", ">= 0", self.cpus_per_worker)
        require(self.max_restarts >= 0, "max_restarts", ">= 0", self.max_restarts)
        require(self.strategy in STRATEGIES, "strategy", f"one of {STRATEGIES}", self.strategy)
        require(self.start_timeout_s > 0, "start_timeout_s", "> 0", self.start_timeout_s)
        require(self.grace_s >= 0, "grace_s", ">= 0", self.grace_s)


class WorkerFailed(RuntimeError):
    """The job failed. ``ranks``: the ranks held responsible (empty if none could be named);
    ``reports``: every failed rank's report, by rank."""

    def __init__(self, message: str, *, ranks: tuple[int, ...], reports: dict[int, str]):
        super().__init__(message)
        self.ranks, self.reports = ranks, reports


class _Worker:
    """The actor: reports where it runs, then runs the worker function in torchrun's environment."""

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def run(self, env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
        os.environ.update(env)
        return fn(*args)


@dataclass(frozen=True)
class _Report:
    rank: int
    message: str
    culprits: tuple[int, ...]
    primary: bool  # the error started on this rank

    @property
    def conclusive(self) -> bool:
        return self.primary or bool(self.culprits)


def launch_ray(fn: Callable[..., Any], *args: Any, config: RayConfig) -> dict[int, Any]:
    """Runs ``fn(*args)`` in ``config.num_workers`` Ray actors; returns each rank's return value
    by rank. Raises ``WorkerFailed`` when a worker fails and no restarts are left."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=config.address, log_to_driver=True)
    try:
        cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
        gpus = config.gpus_per_worker if config.gpus_per_worker is not None else float(cluster_gpus > 0)
        workers = config.num_workers or (int(cluster_gpus // gpus) if gpus else 2)
        config = dataclasses.replace(config, gpus_per_worker=gpus, num_workers=workers)
        if started_here and config.address is None and not os.environ.get("RAY_ADDRESS"):
            check_fits(config, ray.cluster_resources())  # a new local Ray never grows: fail now, not in 300 s
        for attempt in range(config.max_restarts + 1):
            try:
                return _attempt(fn, args, config, attempt)
            except WorkerFailed as failure:
                if attempt == config.max_restarts:
                    raise
                log.warning("%s; restarting all %d workers (restart %d of %d): they resume from the newest "
                            "checkpoint", failure, config.num_workers, attempt + 1, config.max_restarts)
        raise AssertionError("unreachable")
    finally:
        if started_here:
            ray.shutdown()


def check_fits(config: RayConfig, resources: dict) -> None:
    """``WorkerFailed`` when the cluster's resources, in all, are fewer than the workers ask for."""
    wanted = {"CPU": config.num_workers * config.cpus_per_worker,
              "GPU": config.num_workers * (config.gpus_per_worker or 0)}
    short = [f"{wanted[r]:g} {r}s (it has {resources.get(r, 0):g})" for r in wanted
             if wanted[r] > resources.get(r, 0)]
    if short:
        raise WorkerFailed(f"ray: {config.num_workers} workers need {' and '.join(short)}: the local Ray started for "
                           "this job cannot hold them (fewer --num-workers, or --address of a larger cluster)",
                           ranks=(), reports={})


def _attempt(fn, args, config: RayConfig, attempt: int) -> dict[int, Any]:
    import ray
    import torch.distributed as dist
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": config.cpus_per_worker}
    if config.gpus_per_worker:
        bundle["GPU"] = config.gpus_per_worker
    pg = placement_group([bundle] * config.num_workers, strategy=config.strategy)
    actors = []
    try:
        log.info("ray: placing %d workers of %s (%s), waiting up to %.0f s", config.num_workers, bundle,
                 config.strategy, config.start_timeout_s)
        ready, _ = ray.wait([pg.ready()], timeout=config.start_timeout_s)
        if not ready:
            raise WorkerFailed(f"ray: {config.num_workers} workers of {bundle} could not be placed ({config.strategy}) "
                               f"within {config.start_timeout_s:.0f} s; cluster resources: "
                               f"{ray.cluster_resources()}", ranks=(), reports={})
        actor_cls = ray.remote(_Worker)
        for i in range(config.num_workers):
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
            actors.append(actor_cls.options(num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker,
                                            scheduling_strategy=strategy).remote())
        wheres = ray.get([a.where.remote() for a in actors], timeout=config.start_timeout_s)
        store = dist.TCPStore(ray.util.get_node_ip_address(), 0, config.num_workers, True,
                              datetime.timedelta(seconds=config.start_timeout_s), wait_for_workers=False)
        envs, ranks = _environments(wheres, config, store.port, attempt)
        futures = {a.run.remote(envs[i], fn, *args): ranks[i] for i, a in enumerate(actors)}
        nodes = sorted({e["GROUP_RANK"] for e in envs}, key=int)
        log.info("ray: %d workers on %d node(s), attempt %d; ranks by node: %s", config.num_workers, len(nodes),
                 attempt, {n: [ranks[i] for i, e in enumerate(envs) if e["GROUP_RANK"] == n] for n in nodes})
        return _collect(futures, envs_by_rank={ranks[i]: envs[i] for i in range(len(envs))}, config=config,
                        attempt=attempt)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)


def _environments(wheres: list[dict], config: RayConfig, port: int, attempt: int):
    """torchrun's environment for each actor (in bundle order) and its rank: nodes in the order of
    their first bundle, ranks node by node."""
    import ray

    node_order = list(dict.fromkeys(w["node_id"] for w in wheres))
    order = sorted(range(len(wheres)), key=lambda i: (node_order.index(wheres[i]["node_id"]), i))
    ranks = [0] * len(wheres)
    for rank, i in enumerate(order):
        ranks[i] = rank
    envs = []
    for i, w in enumerate(wheres):
        same_node = [j for j in order if wheres[j]["node_id"] == w["node_id"]]
        env = {name: value for name, value in os.environ.items() if name.startswith("EP_")}
        env |= {"MASTER_ADDR": ray.util.get_node_ip_address(), "MASTER_PORT": str(port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": str(ranks[i]), "WORLD_SIZE": str(len(wheres)),
               "LOCAL_RANK": str(same_node.index(i)), "LOCAL_WORLD_SIZE": str(len(same_node)),
               "GROUP_RANK": str(node_order.index(w["node_id"])), "GROUP_WORLD_SIZE": str(len(node_order)),
               "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts)}
        if config.gpus_per_worker and w["gpus"]:
            node_gpus = list(dict.fromkeys(g for j in same_node for g in wheres[j]["gpus"]))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            env["LOCAL_RANK"] = str(node_gpus.index(w["gpus"][0]))
        envs.append(env)
    return envs, ranks


def _collect(futures: dict, *, envs_by_rank: dict[int, dict], config: RayConfig, attempt: int) -> dict[int, Any]:
    """Waits for every worker; on the first failure, for a report that names the rank responsible."""
    import ray

    results: dict[int, Any] = {}
    reports: dict[int, _Report] = {}
    pending = list(futures)
    deadline = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break  # grace is over
        rank = futures[done[0]]
        try:
            results[rank] = ray.get(done[0])
        except Exception as err:  # noqa: BLE001 - every failure is reported, by rank
            reports[rank] = _report(rank, err, envs_by_rank[rank])
            if reports[rank].conclusive:
                done = ray.wait(pending, num_returns=len(pending), timeout=0.5)[0] if pending else []
                for ref in done:  # failures at the same moment
                    other = futures[ref]
                    try:
                        ray.get(ref)
                    except Exception as other_err:  # noqa: BLE001
                        reports[other] = _report(other, other_err, envs_by_rank[other])
                break
            if deadline is None:
                deadline = time.monotonic() + config.grace_s
    if not reports:
        return dict(sorted(results.items()))
    ordered = sorted(reports.values(), key=lambda r: (not r.primary, not r.culprits, r.rank))
    blamed = tuple(dict.fromkeys(c for r in ordered if r.conclusive for c in r.culprits))
    lines = [f"ray job failed (attempt {attempt}): {ordered[0].message}"]
    lines += [f"  also {r.message}" for r in ordered[1:]]
    raise WorkerFailed("\n".join(lines), ranks=blamed, reports={r.rank: r.message for r in ordered})


def _report(rank: int, err: BaseException, env: dict[str, str]) -> _Report:
    import ray.exceptions

    from ep_runtime.failures import RankFailed, is_communication_error

    where = f"rank {rank} (node {env['GROUP_RANK']}, local {env['LOCAL_RANK']})"
    if isinstance(err, ray.exceptions.RayActorError):
        first = (str(err).strip().splitlines() or [""])[0]
        return _Report(rank, f"{where}: its worker process died ({type(err).__name__}: {first})", (rank,), True)
    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
    if isinstance(cause, RankFailed):
        return _Report(rank, str(cause), tuple(cause.culprits), cause.primary)
    first = (str(cause).strip().splitlines() or [""])[0]
    primary = not is_communication_error(cause)
    return _Report(rank, f"{where} failed: {type(cause).__name__}: {first}", (rank,) if primary else (), primary)
