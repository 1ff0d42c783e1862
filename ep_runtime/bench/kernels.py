"""``ep-runtime bench kernels``: every routing / permute / quant / reduce / transpose op against its
peers at DeepSeek-V3's shapes, and the mHC / Engram ops (norm_fn, split + Sinkhorn, pre-apply,
post, the fused pre, the Engram gate, and their backward; the Engram n-gram hash) at
DeepSeek-V4-like ones, in one run.

    ep-runtime bench kernels                          # on a GPU: every op at every shape, with its peers
    ep-runtime bench kernels --shapes small --kernel-time
    ep-runtime bench kernels --device cpu --quick     # the references on the CPU: a smoke test

For each shape and op: the op's public function (``kernels.<family>.<op>``: the TileLang kernel on
Hopper, the reference elsewhere) is checked once against the reference on fresh inputs (a new seed
each run unless --seed), then timed, then its peers on the same inputs: the reference in eager
PyTorch, torch.compile of the reference, and tile-kernels where it has the op. A peer that fails
to import, compile or run is recorded as an error string.

Timing (CUDA): warm-up calls, then each timed call follows a read of a 512 MiB buffer (the op's
inputs start in device memory) and a ~1 ms GPU spin (the host enqueues the call before the GPU
reaches it), bracketed by CUDA events; the median over the runs (up to --iters, fewer for slow
calls: about 0.3 s per measurement). The copy ceiling is a copy_ of a 1 GiB buffer timed the same
way in the same run; GB/s everywhere counts bytes read plus bytes written.

Bytes are the op's minimal traffic (each input byte read once, each output byte written once; for
gathers only the rows that are read), listed per op in bytes_note; the same count divides every
implementation's time, so a peer that moves more bytes shows a lower GB/s.

Fused ops (router + counts, expand + per-token cast, SwiGLU + per-token cast, weighted reduce with
FP8 dequantization) are also timed as the unfused sequence of our own ops; the fusion bar compares
the speedup with the ratio of bytes the fusion saves.

--kernel-time adds each call's GPU work alone (CUPTI through torch.profiler: its kernels, memsets
and copies summed, L2 flushed before each call, the median of 50 calls) for ours, the peers and
the unfused sequences, and judges the peer ratio and the fusion bar by that time too. At 128
tokens the timer's launch and events cost 3.5-4 us of a 6 us measurement, paid once per
measurement whether the call launches one kernel or two, which hides what a fusion saves; the GPU
time leaves out the gap between an unfused sequence's kernels, so it favours the sequence.

On the CPU (--device cpu) only the references run (the public ops pick them there), with host
timers and no peers; --quick there uses a tiny shape: a smoke test of the program.

Writes one JSON report (rewritten after each op, "complete" once every shape ran) to --out: a
.json file, or a folder to write kernels-<device>-<date>.json in (default runs/bench).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import kernels_engram, kernels_mhc, kernels_permute, kernels_quant, kernels_reduce, kernels_routing
from .kernels_cases import MHC_OPS, SHAPES, Case, Inputs, StreamInputs, load_tile_kernels
from .kernels_report import print_table, summarize_bars
from .kernels_run import CompileBudget, run_case
from .record import device_name, git, head_commit, slug, version
from .timer import Timer, copy_bandwidth

DEFAULT_OUT = "runs/bench"

# Every op's case builder, family by family.
CASE_BUILDERS: dict[str, Callable[..., Case]] = {
    **kernels_routing.CASES, **kernels_permute.CASES, **kernels_quant.CASES, **kernels_reduce.CASES,
    **kernels_mhc.CASES, **kernels_engram.CASES,
}


def build_cases(inp: Inputs | StreamInputs, names: list[str], with_peers: bool) -> list[Case]:
    """The cases for ``names`` that take ``inp`` (the mHC/Engram ops take ``StreamInputs``)."""
    streams = isinstance(inp, StreamInputs)
    tk = load_tile_kernels() if with_peers else None
    return [builder(inp, tk) for name, builder in CASE_BUILDERS.items() if name in names and (name in MHC_OPS) == streams]


def report_path(out: str, device: str) -> Path:
    """Where the report goes: ``out`` itself if it names a .json file, else a file in that folder."""
    path = Path(out)
    if path.suffix == ".json" and not path.is_dir():
        return path
    return path / f"kernels-{slug(device)}-{datetime.date.today().isoformat()}.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ep-runtime bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=("large", "small", "v4", "all", "tiny"), default=None,
                   help="large (16384 tokens), small (128 tokens), v4 (the mHC/Engram ops at 8192 tokens, 4 "
                        "streams, hidden 4096 and 7168), all (the three; the default on CUDA), tiny (the CPU "
                        "smoke shape; the default with --device cpu --quick)")
    p.add_argument("--ops", default=None, help=f"comma-separated subset of: {', '.join(CASE_BUILDERS)}")
    p.add_argument("--iters", type=int, default=50, help="timed runs per measurement at most (default 50)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default 3)")
    p.add_argument("--skip-peers", action="store_true", help="time our ops only")
    p.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile peer")
    p.add_argument("--compile-budget", type=float, default=100.0, metavar="S",
                   help="seconds of torch.compile (compiling and timing) for the whole run; later ops "
                        "record the peer as skipped (default 100)")
    p.add_argument("--kernel-time", action="store_true",
                   help="also time each call's GPU work alone (CUPTI; for latency-bound shapes, where the "
                        "timer's launch and events are most of the time) and judge the ratio and fusion bars "
                        "by it too (CUDA only)")
    p.add_argument("--warm-cache", action="store_true",
                   help="let TileLang reuse its on-disk kernel cache (default: off, so first calls show "
                        "compile times)")
    p.add_argument("--quick", action="store_true", help="few runs per measurement (on the CPU: the tiny shape)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: new each run)")
    p.add_argument("--commit", default=None,
                   help="commit to record when git cannot tell (a copy of the tree without .git)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="PATH",
                   help=f"a .json file, or a folder to write kernels-<device>-<date>.json in (default {DEFAULT_OUT})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    on_cuda = device.type == "cuda"
    shapes = args.shapes or ("all" if on_cuda or not args.quick else "tiny")
    shape_names = {"all": ["large", "small", "v4-d4096", "v4-d7168"], "v4": ["v4-d4096", "v4-d7168"]}.get(shapes,
                                                                                                        [shapes])
    names = list(CASE_BUILDERS) if args.ops is None else [n.strip() for n in args.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASE_BUILDERS]
    if unknown:
        raise SystemExit(f"ep-runtime bench kernels: --ops: unknown {unknown}; expected some of {list(CASE_BUILDERS)}")
    with_peers = on_cuda and not args.skip_peers  # on the CPU the op is the reference: nothing to compare
    iters, warmup = (min(args.iters, 10), 1) if args.quick else (args.iters, args.warmup)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000

    from kernels.select import use_tilelang

    impl = "tilelang" if use_tilelang(device) else "reference"
    if impl == "tilelang" and not args.warm_cache:
        import tilelang

        tilelang.disable_cache()  # the in-process cache still serves the second shape
    budget_s = 0.1 if args.quick else 0.3
    kernel_calls = 50 if on_cuda and args.kernel_time else 0
    timer = Timer(device, iters, warmup, budget_s, flush_bytes=(512 << 20) if on_cuda else 0, kernel_calls=kernel_calls)
    copy = copy_bandwidth(timer, (1 << 30) if on_cuda else (64 << 20))

    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety
        def tqdm(items, **_):
            return items

    budget = None if args.skip_compile else CompileBudget(args.compile_budget)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "kernels",
        "complete": False,  # true once every shape ran (the file is rewritten after each op)
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device_name(device),
        "device_type": device.type,
        "commit": args.commit or head_commit(),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if head_commit() else None,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "tilelang": version("tilelang"),
            "tile_kernels": version("tile_kernels") if with_peers else "not loaded (no peers)",
        },
        "settings": {"iters": iters, "warmup": warmup, "budget_s_per_measurement": budget_s, "seed": seed,
                     "l2_flush_bytes": (512 << 20) if on_cuda else 0, "peers": with_peers,
                     "torch_compile": with_peers and not args.skip_compile, "quick": args.quick,
                     "tilelang_disk_cache": args.warm_cache, "kernels": impl, "kernel_time_calls": kernel_calls},
        "copy": copy,
        "shapes": {name: dataclasses.asdict(SHAPES[name]) for name in shape_names},
        "results": [],
    }
    out = report_path(args.out, report["device"])
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        report["bars"] = summarize_bars(report["results"]) if on_cuda else {}  # GPU targets: meaningless on a CPU
        report["wall_s"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        if shape_name == "tiny":
            makers = [Inputs, StreamInputs]
        else:
            makers = [StreamInputs if shape_name.startswith("v4") else Inputs]
        cases = [case for make in makers for case in build_cases(make(shape, device, seed), names, with_peers)]
        for case in tqdm(cases, desc=f"{shape_name} ({shape.tokens} tokens)", file=sys.stderr):
            result = run_case(case, timer, copy["gbps"], with_peers=with_peers, compile_budget=budget, impl=impl)
            report["results"].append({"shape": shape_name, **result})
            write()
        del cases
    report["complete"] = True
    write()
    print_table(report)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
