"""One way to start workers under either launcher: ``start_workers(fn, *args, launcher=...)`` runs
``fn(*args)`` in every worker process and returns each rank's return value by rank. The CLI's
``train`` and the benchmarks that start processes go through it (``ep_runtime.bench.StartWorkers``
is its type, so the runtime can be handed it without importing the launchers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LAUNCHERS = ("local", "ray")


def start_workers(fn: Callable[..., Any], *args: Any, launcher: str = "local", num_workers: int | None = None,
                  max_restarts: int = 0, address: str | None = None, gpus_per_worker: float | None = None,
                  cpus_per_worker: float | None = None) -> dict[int, Any]:
    """``local``: ``num_workers`` processes on this machine (default: one per GPU, else 2);
    ``ray``: Ray actors on the cluster at ``address`` (``RayConfig`` documents the defaults).
    Failures raise the launcher's own error: torch's ``ChildFailedError`` (local) or
    ``launch.ray.WorkerFailed``."""
    if launcher == "local":
        ray_only = [name for name, value in (("address", address), ("gpus_per_worker", gpus_per_worker),
                                             ("cpus_per_worker", cpus_per_worker)) if value is not None]
        if ray_only:
            raise ValueError(f"{', '.join(ray_only)}: only with launcher='ray'")
        from .local import launch_local

        if num_workers is None:
            import torch

            num_workers = torch.cuda.device_count() or 2
        return launch_local(fn, *args, nproc=num_workers, max_restarts=max_restarts)
    if launcher == "ray":
        from .ray import RayConfig, launch_ray

        config = RayConfig(address=address, num_workers=num_workers, gpus_per_worker=gpus_per_worker,
                           max_restarts=max_restarts,
                           **({} if cpus_per_worker is None else {"cpus_per_worker": cpus_per_worker}))
        return launch_ray(fn, *args, config=config)
    raise ValueError(f"launcher: expected one of {LAUNCHERS}, got {launcher!r}")
