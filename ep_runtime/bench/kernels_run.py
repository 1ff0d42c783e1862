"""Running one ``bench kernels`` case: ours checked against the reference, then timed; the peers
timed on the same inputs (each failure recorded, never raised); fused ops against the unfused
sequence of our own ops (the fusion bar); with ``--kernel-time`` the GPU time of each too."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from .kernels_cases import MEMORY_BOUND, Case
from .kernels_check import agreement, check
from .timer import Timer


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def _rate(time_us: float, nbytes: int, copy_gbps: float) -> dict:
    gbps = nbytes / time_us / 1e3 if time_us > 0 else 0.0
    return {"time_us": time_us, "gbps": gbps, "pct_of_copy": 100 * gbps / copy_gbps}


@dataclasses.dataclass
class CompileBudget:
    """Seconds of ``torch.compile`` left for the run (cold Inductor compiles cost seconds each)."""

    seconds: float


def fusion_gain(fused_us: float, unfused_us: float, bytes_ratio: float) -> dict:
    """The fusion bar: the speedup's gain over the unfused sequence at least 70% of the bytes' gain."""
    speedup = unfused_us / fused_us
    gain = (speedup - 1) / (bytes_ratio - 1) if bytes_ratio > 1 else None
    return {"speedup": speedup, "speedup_over_bytes_ratio": speedup / bytes_ratio, "gain_over_bytes_gain": gain,
            "bar_ok": gain is not None and gain >= 0.7}


def copy_fusion(timer: Timer, fused_bytes: int, unfused_bytes: int) -> dict:
    """What the fusion bar asks of a kernel at the copy's speed at this size: device-to-device
    copies moving the fused op's bytes and the unfused sequence's, their GPU times, and the bar
    judged on them. Where a launch's fixed cost dominates (a small batch), a bytes ratio is no time
    ratio, and a miss here says so rather than that a kernel falls short."""
    fused_us, unfused_us = timer.copy_kernel_us(fused_bytes), timer.copy_kernel_us(unfused_bytes)
    return {"fused_us": fused_us, "unfused_us": unfused_us,
            **fusion_gain(fused_us, unfused_us, unfused_bytes / fused_bytes)}


def _fastest_peer(peers: dict, key: str) -> float | None:
    timed = [p[key] for p in peers.values() if key in p and not p.get("partial")]
    return min(timed) if timed else None


def _kernel_time(timer: Timer, thunk: Callable[[], Any]) -> dict:
    """``{"kernel_us": ...}`` with ``--kernel-time``, ``{"kernel_error": ...}`` where CUPTI could not
    tell the call's work apart (the timer's result stands), ``{}`` without."""
    if not timer.kernel_calls:
        return {}
    try:
        return {"kernel_us": timer.kernel_us(thunk, timer.kernel_calls)}
    except Exception as error:
        return {"kernel_error": _error(error)}


def run_case(
    case: Case, timer: Timer, copy_gbps: float, *, with_peers: bool, compile_budget: CompileBudget | None, impl: str
) -> dict:
    """Check, time and compare one case; never raises for a peer's failure."""
    result: dict[str, Any] = {"op": case.op, "impl": impl, "bytes": case.bytes, "bytes_note": case.bytes_note,
                              "memory_bound": case.op in MEMORY_BOUND}
    try:
        got, result["first_call_s"] = timer.first_call(case.ours)
        want = case.reference(*case.args)
        result["check"] = check(got, want, case.exact, case.within)
        del got
        time_us, result["runs"] = timer.median_us(case.ours)
        result.update(_rate(time_us, case.bytes, copy_gbps), **_kernel_time(timer, case.ours))
    except Exception as error:  # ours failing is a result too: report it, go on with the others
        result["error"] = _error(error)
        return result

    peers: dict[str, dict] = {}
    if with_peers:
        peers["torch_eager"] = _run_peer(lambda: case.reference(*case.args), timer, case, copy_gbps, want)
        if compile_budget is not None and case.compile_peer:
            peers["torch_compile"] = _run_compiled(case, timer, copy_gbps, want, compile_budget)
        for name, thunk in case.peers.items():
            peers[name] = _run_peer(thunk, timer, case, copy_gbps, want)
            peers[name]["partial"] = name in case.partial_peers
    result["peers"] = peers
    fastest = _fastest_peer(peers, "time_us")
    if fastest is not None:
        result["fastest_peer_us"], result["ratio_vs_fastest_peer"] = fastest, fastest / result["time_us"]
    fastest = _fastest_peer(peers, "kernel_us")
    if fastest is not None and "kernel_us" in result:
        result["fastest_peer_kernel_us"] = fastest
        result["ratio_vs_fastest_peer_by_kernel_time"] = fastest / result["kernel_us"]

    if case.unfused is not None:
        try:
            unfused_us, _ = timer.median_us(case.unfused)
            bytes_ratio = case.unfused_bytes / case.bytes
            result["fusion"] = {"unfused": case.unfused_note, "unfused_time_us": unfused_us,
                                "unfused_bytes": case.unfused_bytes, "bytes_ratio": bytes_ratio,
                                **fusion_gain(result["time_us"], unfused_us, bytes_ratio)}
            unfused_kernel = _kernel_time(timer, case.unfused)
            if "kernel_us" in unfused_kernel and "kernel_us" in result:
                result["fusion"]["kernel_time"] = {"unfused_kernel_us": unfused_kernel["kernel_us"],
                                                   **fusion_gain(result["kernel_us"], unfused_kernel["kernel_us"],
                                                                 bytes_ratio),
                                                   "copy": copy_fusion(timer, case.bytes, case.unfused_bytes)}
            elif unfused_kernel:
                result["fusion"]["kernel_time"] = unfused_kernel
        except Exception as error:
            result["fusion"] = {"unfused": case.unfused_note, "error": _error(error)}
    return result


def _run_peer(thunk: Callable[[], Any], timer: Timer, case: Case, copy_gbps: float, want: Any) -> dict:
    try:
        out, first = timer.first_call(thunk)
        agree = agreement(out, want)
        del out
        time_us, runs = timer.median_us(thunk)
        return {**_rate(time_us, case.bytes, copy_gbps), "first_call_s": first, "runs": runs, "agreement": agree,
                **_kernel_time(timer, thunk)}
    except Exception as error:
        return {"error": _error(error)}


def _run_compiled(case: Case, timer: Timer, copy_gbps: float, want: Any, budget: CompileBudget) -> dict:
    if budget.seconds <= 0:
        return {"error": "skipped: the run's torch.compile budget (--compile-budget) is spent"}
    start = time.perf_counter()
    try:
        compiled = torch.compile(case.reference, dynamic=False)
        result = _run_peer(lambda: compiled(*case.args), timer, case, copy_gbps, want)
    except Exception as error:
        result = {"error": _error(error)}
    finally:
        budget.seconds -= time.perf_counter() - start
    if "first_call_s" in result:
        result["compile_s"] = result["first_call_s"]
    return result
