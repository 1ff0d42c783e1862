"""How a job's ranks fail together: the rank whose error came first takes the blame, a rank whose
collective broke says whose fault it was, a rank that waits on others longer than the job's timeout
ends the job naming the wait, and a rank that is stuck does not outlive the job.

Reports travel through the job's key-value store (``ParallelContext.store``). The Ray launcher
(``launch/ray.py``) reads its errors to name the rank responsible; it imports nothing else of the
runtime.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RankInJob(Protocol):
    """What failure reports need of a rank (``parallel.ParallelContext`` has it)."""

    rank: int
    world_size: int
    store: dist.Store | None
    activity: Activity

    @property
    def where(self) -> str: ...


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




class DeviceWaits:
    """Waits on peers that run on the device (the nvlink backend's in-kernel barriers,
    ``kernels.signal_kernel``): each spins at most ``timeout_s`` (the job's ``--timeout``), then
    writes the peer it waited for into a word of pinned host memory and traps. This process's
    words, each with what its waits are, so that its failure names the wait rather than the CUDA
    error the trap leaves behind; reading a word makes no CUDA call, so a thread can while the
    main one is blocked on the device."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self._words: list[tuple[torch.Tensor, Callable[[int], str]]] = []

    def word(self, what: Callable[[int], str]) -> torch.Tensor:
        """A zeroed int32 ``[2]`` for a kernel's report ``[1 + peer, epoch]`` (pinned where CUDA
        is); ``what(peer)`` names the wait, e.g. ``rank 0's signal in the nvlink barrier``."""
        word = torch.zeros(2, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        self._words.append((word, what))
        return word

    def gave_up(self) -> str | None:
        """``waited 45 s on the device for ...``, for the first wait that gave up; None if none has."""
        for word, what in self._words:
            peer = int(word[0])
            if peer:
                return f"waited {self.timeout_s:.0f} s on the device for {what(peer - 1)}"
        return None


DEVICE_WAITS = DeviceWaits()  # this process's; parallel.init_parallel sets the job's timeout


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


def report_failure(ctx: RankInJob, exc: BaseException, *, step: int, grace_s: float) -> RankFailed:
    """Records this rank's failure in the job's store and returns the error to raise, naming the
    rank responsible. An error of this rank's own is reported at once. A communication error
    waits up to ``grace_s`` for the other ranks' reports, then names the ranks that reported an
    error of their own or, if none did, the ranks that never reported (withheld, hung or dead)."""
    device_wait = DEVICE_WAITS.gave_up()  # the CUDA error is its trap's: name the wait instead
    comm = is_communication_error(exc) and device_wait is None
    mine = {"where": ctx.where, "step": step, "error": device_wait or _summary(exc), "comm": comm}
    waiting = ctx.activity.waiting()
    if not comm:
        if ctx.store is not None:
            with contextlib.suppress(Exception):  # a courtesy to the other ranks; the error stands anyway
                ctx.store.set(_report_key(ctx.rank), json.dumps(mine))
                ctx.store.add(_report_key("count"), 1)
        failed = f"{device_wait} at step {step}" if device_wait else f"failed at step {step}: {mine['error']}"
        return RankFailed(f"{ctx.where} {failed}", rank=ctx.rank, culprits=(ctx.rank,), primary=True)
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
        return RankFailed(f"{ctx.where} stopped at step {step}{during}, because {causes}", rank=ctx.rank,
                          culprits=tuple(own_errors), primary=False)
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

    def __init__(self, ctx: RankInJob, *, grace_s: float, timeout_s: float, step=lambda: 0,
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
        """Ends this process, reported as the job's failure, once its current wait passed the timeout
        or a wait on the device gave up."""
        waiting = self.ctx.activity.waiting()
        if waiting is not None and waiting[1] >= self.timeout_s:
            error = f"waited {waiting[1]:.0f} s in {waiting[0]}"
        else:
            error = DEVICE_WAITS.gave_up()
        if error is None or self._done.is_set():
            return
        step = self.step()
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
