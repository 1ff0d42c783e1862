"""The ``bench kernels`` report: its bars (copy bandwidth, the fastest peer, fusion) and the table
it prints."""

from __future__ import annotations

from typing import Any

from .kernels_cases import MHC_OPS

# Within 3% of the fastest peer is parity: closer than run-to-run noise calls a winner.
PEER_PARITY = 0.97
PEER_BAR = f"ratio_vs_fastest_peer_ge_{PEER_PARITY}"


def summarize_bars(results: list[dict]) -> dict:
    """The bars: memory-bound ops at >= 90% of the copy bandwidth at the large shape (the mHC and
    Engram ops at the v4 shapes), ours at parity with the fastest peer or faster at every shape
    (``PEER_PARITY``), the fusion gain; with ``--kernel-time`` the last two again by the GPU time alone."""
    bars: dict[str, Any] = {"memory_bound_ge_90pct_of_copy": {}, PEER_BAR: {}, "fusion": {}}
    by_kernel_time: dict[str, dict] = {f"{PEER_BAR}_by_kernel_time": {}, "fusion_by_kernel_time": {}}
    for r in results:
        key = f"{r['shape']}/{r['op']}"
        if "time_us" not in r:
            continue
        if r["memory_bound"] and (r["shape"] == "large" or (r["op"] in MHC_OPS and r["shape"].startswith("v4"))):
            bars["memory_bound_ge_90pct_of_copy"][key] = r["pct_of_copy"] >= 90
        if "ratio_vs_fastest_peer" in r:
            bars[PEER_BAR][key] = r["ratio_vs_fastest_peer"] >= PEER_PARITY
        if "bar_ok" in r.get("fusion", {}):
            bars["fusion"][key] = r["fusion"]["bar_ok"]
        if "ratio_vs_fastest_peer_by_kernel_time" in r:
            by_kernel_time[f"{PEER_BAR}_by_kernel_time"][key] = (
                r["ratio_vs_fastest_peer_by_kernel_time"] >= PEER_PARITY)
        if "bar_ok" in r.get("fusion", {}).get("kernel_time", {}):
            by_kernel_time["fusion_by_kernel_time"][key] = r["fusion"]["kernel_time"]["bar_ok"]
    bars.update((name, bar) for name, bar in by_kernel_time.items() if bar)
    tk_gate = [r for r in results if r["op"] == "topk_route" and r["shape"] == "large" and "time_us" in r]
    if tk_gate and "time_us" in tk_gate[0]["peers"].get("tile_kernels.topk_gate", {}):
        bars["router_faster_than_tile_kernels_topk_gate"] = (
            tk_gate[0]["time_us"] < tk_gate[0]["peers"]["tile_kernels.topk_gate"]["time_us"]
        )
    return bars


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_table(report: dict) -> None:
    copy = report["copy"]
    print(f"\n{report['device']}  commit {report['commit'] or '?'}  copy {copy['gbps']:.0f} GB/s "
          f"({copy['bytes'] / 2**30:.0f} GiB read+write in {copy['time_us']:.0f} us)")
    head = (f"{'shape':6} {'op':27} {'impl':9} {'check':6} {'us':>9} {'GB/s':>7} {'%copy':>6} {'eager us':>9} "
            f"{'compile us':>10} {'tile-k us':>9} {'vs best':>7} {'1st call s':>10}")
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        if "error" in r:
            print(f"{r['shape']:6} {r['op']:27} {r['impl']:9} ERROR  {r['error']}")
            continue
        peers = r.get("peers", {})
        tk = [p["time_us"] for n, p in peers.items() if n.startswith("tile_kernels") and "time_us" in p
              and not p.get("partial")]
        chk = r["check"]
        status = "exact" if chk.get("exact") else ("close" if chk.get("ok") else "FAIL")
        print(f"{r['shape']:6} {r['op']:27} {r['impl']:9} {status:6} {r['time_us']:9.1f} {r['gbps']:7.0f} "
              f"{r['pct_of_copy']:6.1f} {_fmt(peers.get('torch_eager', {}).get('time_us'), '9.1f'):>9} "
              f"{_fmt(peers.get('torch_compile', {}).get('time_us'), '10.1f'):>10} "
              f"{_fmt(min(tk) if tk else None, '9.1f'):>9} {_fmt(r.get('ratio_vs_fastest_peer'), '7.2f'):>7} "
              f"{r['first_call_s']:10.2f}")
    errors = [(r["shape"], r["op"], n, p["error"]) for r in report["results"] for n, p in r.get("peers", {}).items()
              if "error" in p]
    for shape, op, name, error in errors:
        print(f"  peer error {shape}/{op}/{name}: {error}")
    fused = [r for r in report["results"] if "speedup" in r.get("fusion", {})]

    def verdict(ok: bool) -> str:
        return ("ok" if ok else "MISSED") if report["bars"] else "-"

    if fused:
        print("\nfused vs the unfused sequence of our ops (bar: speedup gain >= 70% of the bytes gain)")
        for r in fused:
            f = r["fusion"]
            for timing, g in (("timer", f), ("GPU time", f.get("kernel_time", {}))):
                if "speedup" in g:
                    print(f"  {r['shape']:6} {r['op']:27} {timing:8} speedup {g['speedup']:.2f}x  bytes ratio "
                          f"{f['bytes_ratio']:.2f}x  speedup/bytes {g['speedup_over_bytes_ratio']:.2f}  gain/bytes gain "
                          f"{_fmt(g['gain_over_bytes_gain'], '.2f')}  {verdict(g['bar_ok'])}  "
                          f"({f['unfused']})")
            copy = f.get("kernel_time", {}).get("copy")
            if copy:
                print(f"  {r['shape']:6} {r['op']:27} copies of the same bytes: {copy['fused_us']:.2f} / "
                      f"{copy['unfused_us']:.2f} us, speedup {copy['speedup']:.2f}x, gain/bytes gain "
                      f"{_fmt(copy['gain_over_bytes_gain'], '.2f')}  {verdict(copy['bar_ok'])}")
    gpu_timed = [r for r in report["results"] if "kernel_us" in r]
    if gpu_timed:
        print("\nGPU time alone (--kernel-time: CUPTI, kernels + memsets + copies per call)")
        for r in gpu_timed:
            print(f"  {r['shape']:6} {r['op']:27} ours {r['kernel_us']:8.2f} us  fastest peer "
                  f"{_fmt(r.get('fastest_peer_kernel_us'), '8.2f'):>8} us  vs best "
                  f"{_fmt(r.get('ratio_vs_fastest_peer_by_kernel_time'), '.3f')}")
    if not report["bars"]:
        print("bars: not judged here (they are GPU targets; the CPU runs the references)")
    for name, value in report["bars"].items():
        if isinstance(value, dict):
            missed = [k for k, ok in value.items() if not ok]
            print(f"bar {name}: {len(value) - len(missed)}/{len(value)} met" + (f"; missed: {', '.join(missed)}" if missed else ""))
        else:
            print(f"bar {name}: {value}")
