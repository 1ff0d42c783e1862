"""Where a worker's output goes. A process started by a launcher (torchrun, ``ep-runtime train``,
Ray: ``LOCAL_RANK`` is set) writes everything (its log lines at every level, warnings, tracebacks,
and what native code prints) to its rank's file, ``OUT/NAME/logs/rank_<r>.log``; the terminal gets
rank 0's lines at the run's ``--log-level``, and the launcher's one line when the job fails. A
process outside a launcher logs to the terminal only."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO

from .config import TrainConfig
from .failures import restart_count
from .parallel import node_rank


def log_dir(train: TrainConfig) -> Path:
    return Path(train.out_dir) / train.name / "logs"


def log_path(train: TrainConfig, rank: int) -> Path:
    return log_dir(train) / f"rank_{rank}.log"


def setup_worker_logging(train: TrainConfig) -> TextIO:
    """Sets this process's logging up (above); returns the terminal's stream (for a progress
    bar)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    where = f"node {node_rank()} rank {rank}/{world} local {os.environ.get('LOCAL_RANK', '0')}"
    form = logging.Formatter(f"%(asctime)s [{where}] %(message)s", datefmt="%H:%M:%S")
    terminal = sys.stderr
    handlers = []
    if "LOCAL_RANK" in os.environ:
        terminal = _send_output_to(log_path(train, rank))
        handlers.append(_handler(sys.stderr, logging.DEBUG, form))  # fd 2 is the rank's file now
    if rank == 0 or not handlers:
        level = train.log_level.upper() if rank == 0 else logging.WARNING
        handlers.append(_handler(terminal, level, form))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    logging.getLogger("ep_runtime").setLevel(logging.DEBUG)  # the handlers choose
    return terminal


def _send_output_to(path: Path) -> TextIO:
    """Points this process's stdout and stderr (the file descriptors, so that native code's output
    follows) at ``path``, appended, with a line opening this attempt; returns a stream on the
    terminal they had."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    with open(path, "a") as f:
        f.write(f"---- attempt {restart_count() + 1} (pid {os.getpid()}) ----\n")
        f.flush()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    return terminal


def _handler(stream: TextIO, level, form: logging.Formatter) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setLevel(level)
    handler.setFormatter(form)
    return handler
