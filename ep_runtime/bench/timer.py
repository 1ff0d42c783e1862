"""How the benchmarks time a call.

``EventTimer``: one call in milliseconds (the multi-rank benchmarks time each iteration with it).
``capture_graphs``: calls captured as CUDA graphs, for timing their replays (no host in them).
``Timer``: the median of many calls in microseconds, for single-device kernel benchmarks.

On CUDA both bracket the call with CUDA events; ``Timer`` reads a large buffer before each run
(512 MiB in ``bench kernels``, ten times an H100's 50 MiB L2: the op's inputs start in device
memory; a read, not a write, so no dirty lines are written back inside the timed region) and
takes the median over the runs (up to ``iters``, fewer for slow calls: about ``budget_s`` per
measurement). Before a timed call the GPU spins for about a millisecond (``HEAD_START_CYCLES``,
``torch.cuda._sleep``), so the host has enqueued the events and the call before the GPU reaches
them: a host that falls behind (a stall of a few hundred microseconds in a wrapper's Python) would
otherwise show as device time, and single entries of a full run came out 1.5-3x slow without it.
On the CPU they use host timers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

HEAD_START_CYCLES = 2_000_000  # ~1 ms of GPU spin before a timed call (at ~1.8 GHz)


class EventTimer:
    """Milliseconds of ``fn()``: CUDA events on GPU (synchronised), ``perf_counter`` on CPU.

    ``head_start``: the GPU spins ~1 ms before the start event, so the host has queued ``fn``'s
    launches when the GPU reaches them and the time is the GPU's alone (a CUDA graph's replay in the
    steady state, where the host runs ahead); without it the time includes the host's launches.
    ``align`` (with ``head_start``), an on-stream collective after the spin: the ranks' GPUs start
    the timed call together, so a rank's time does not include waiting for a peer whose host left
    the last host barrier later (unaligned, every 128-token step on two H100s, P2P copy and NCCL
    included, took ~30 us whatever its bytes; aligned, the 128-token P2P copy took 22 us and the
    transport 13)."""

    def __init__(self, device):
        self.device = device

    def time(self, fn, head_start: bool = False, align=None) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            if head_start:
                torch.cuda._sleep(HEAD_START_CYCLES)
                if align is not None:
                    align()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3


class Timer:
    """Median time of a call on one device, each timed run starting with the op's inputs out of L2
    (see the module doc); ``kernel_us`` times the GPU work alone."""

    def __init__(self, device: torch.device, iters: int, warmup: int, budget_s: float, flush_bytes: int,
                 kernel_calls: int = 0):
        self.device, self.iters, self.warmup, self.budget_s = device, iters, warmup, budget_s
        self.kernel_calls = kernel_calls  # > 0: run_case also takes kernel_us over that many calls
        self.cuda = device.type == "cuda"
        self.flush_MB = torch.empty(flush_bytes // 4, dtype=torch.float32, device=device) if self.cuda else None
        if self.flush_MB is not None:
            self.flush_MB.normal_()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def first_call(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """``(output, seconds)`` of one synchronized call (the first includes any compilation)."""
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start

    def flush(self) -> None:
        if self.flush_MB is not None:
            self.flush_MB.sum()

    def median_us(self, fn: Callable[[], Any]) -> tuple[float, int]:
        """``(median microseconds, runs)``."""
        for _ in range(self.warmup):
            fn()
        _, once = self.first_call(fn)
        runs = max(3, min(self.iters, int(self.budget_s / max(once, 1e-6))))
        if not self.cuda:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            return statistics.median(times), runs
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            torch.cuda._sleep(HEAD_START_CYCLES)  # see the module doc: the host gets ahead of the GPU
            self.flush()
            start.record()
            fn()
            end.record()
        self.sync()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events), runs

    def kernel_us(self, fn: Callable[[], Any], calls: int = 50) -> float:
        """Median GPU time of the work ``fn`` launches (CUPTI: kernels, memsets and copies summed per
        call), the L2 flushed before each call. The flush's own events are told apart by position:
        a profile of the flush alone says how many lead each call's."""
        from torch.profiler import ProfilerActivity, profile

        def device_events(prof) -> list:
            return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                          key=lambda e: e.time_range.start)

        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as flush_only:
            self.flush()
            self.sync()
        flush_events = len(device_events(flush_only))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                self.flush()
                fn()
            self.sync()
        events = device_events(prof)
        per_call, rest = divmod(len(events), calls)
        if rest or per_call <= flush_events:
            raise RuntimeError(f"kernel_us: {len(events)} GPU events in {calls} calls, {flush_events} of each "
                               "the flush's: the call does not launch the same work every time")
        per_call_us = [sum(e.device_time for e in events[i * per_call + flush_events:(i + 1) * per_call])
                       for i in range(calls)]
        return round(statistics.median(per_call_us), 3)  # CUPTI's resolution: 1 ns (a sum's float noise off)

    def copy_kernel_us(self, nbytes: int) -> float:
        """:meth:`kernel_us` of a device-to-device copy moving ``nbytes`` (half read, half written)."""
        src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        return self.kernel_us(lambda: dst.copy_(src), self.kernel_calls)


def copy_bandwidth(timer: Timer, nbytes: int) -> dict:
    """Device-to-device ``copy_`` of ``nbytes``: bytes read + written over the median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).random_()
    dst = torch.empty_like(src)
    time_us, runs = timer.median_us(lambda: dst.copy_(src))
    return {"bytes": 2 * nbytes, "time_us": time_us, "gbps": 2 * nbytes / time_us / 1e3, "runs": runs}


def capture_graphs(*steps: Callable[[], Any]) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per step (each warmed up once on the capture stream first). Steps that
    hand each other tensors (a dispatch's output to a combine) are captured in order, so their
    replays, in the same order, do too."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in steps:
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for step in steps:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graphs.append(graph)
    return graphs
