"""Benchmarks: programs, not tests. Each module with a ``main(argv)`` is run as
``ep-runtime bench <module name with - for _>``; each prints a table and writes JSON under
``runs/`` (or ``--out``).

The ones that start processes take them from the caller: ``main(argv, start=...)`` with a
:class:`StartWorkers` (the CLI hands them ``launch.start.start_workers``), since the runtime
does not import the launchers. Under torchrun (``WORLD_SIZE`` set) they run as one of its ranks
and need none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class StartWorkers(Protocol):
    """Runs ``fn(*args)`` in every worker process and returns each rank's return value by rank;
    ``launcher`` is ``"local"`` (processes on this machine) or ``"ray"`` (actors on the Ray
    cluster at ``address``); ``num_workers`` None picks one per GPU, else 2."""

    def __call__(self, fn: Callable[..., Any], *args: Any, launcher: str = "local", num_workers: int | None = None,
                 address: str | None = None, gpus_per_worker: float | None = None) -> dict[int, Any]: ...


def need_start(start: StartWorkers | None, name: str) -> StartWorkers:
    """``start``, or the error that says how to run the benchmark ``name`` without one."""
    if start is None:
        raise SystemExit(f"ep-runtime bench {name}: run it as `ep-runtime bench {name}` (which starts its workers) "
                         "or as a rank of a torchrun job")
    return start
