"""Local launcher: ``nproc`` worker processes on this machine through torchrun's elastic agent
(standalone c10d rendezvous on loopback), the same environment ``torchrun --standalone`` gives.
A rank that raises ends the job with torch's ``ChildFailedError`` naming the rank and its error;
with ``max_restarts`` the agent restarts all workers instead (``TORCHELASTIC_RESTART_COUNT``
counts the restarts), up to that many times.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def launch_local(fn: Callable[..., Any], *args: Any, nproc: int, max_restarts: int = 0) -> dict[int, Any]:
    """Runs ``fn(*args)`` in ``nproc`` processes; returns each rank's return value by rank."""
    if nproc < 1:
        raise ValueError(f"nproc: expected >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts: expected >= 0, got {max_restarts}")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="spawn")
    return elastic_launch(config, entrypoint=fn)(*args)
