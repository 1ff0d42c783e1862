"""Paired rounds of an op against its fastest peer on one GPU, for entries that a single ``ep-runtime
bench kernels`` run calls a tie: each round times ours, then every ``--variants`` variant of it
(``bench/scripts/sweep.py``'s), then the peer (``bench kernels``' timer, median of its iterations),
``--rounds`` times in one process, after one check of each against the reference. The peer is
tile-kernels where it has the op, else (or with ``--peer torch_compile``) ``torch.compile`` of the
reference. It reports every round's
ratio (peer / ours: >= 1 means ours is not slower), their median and how many rounds each side won.
The order turns by one each round (round r starts with contender r), so no contender always runs
first or right after another: a fixed order would put the same bias into every round.

    python3 bench/scripts/paired.py --ops mhc_pre_apply,engram_gate_backward --out $OUT/paired.json
    python3 bench/scripts/paired.py --ops per_block_cast,per_channel_cast --shapes large,small --out ...
    python3 bench/scripts/paired.py --ops batched_transpose --shapes small --variants --control --out ...
    python3 bench/scripts/paired.py --ops per_channel_cast --shapes small --variants --kernel-time --out ...
    python3 bench/scripts/paired.py --ops cast_back,swiglu --shapes large --peer torch_compile --control --out ...
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ep_runtime.bench import kernels as bench
from sweep import variants


def _peer(case: bench.Case, prefer: str = "tile_kernels"):
    """``(name, thunk)``: tile-kernels' peer if the op has one (and ``prefer`` says so), else
    ``torch.compile`` of the reference."""
    for name, thunk in case.peers.items():
        if prefer == "tile_kernels" and name.startswith("tile_kernels"):
            return name, thunk
    compiled = torch.compile(case.reference, dynamic=False)
    return "torch_compile", lambda: compiled(*case.args)


def paired_rounds(case: bench.Case, timer: bench.Timer, rounds: int, others: dict, kernel_time: bool = False,
                  prefer: str = "tile_kernels") -> dict:
    """Ours, each of ``others`` ({label: thunk}, variants of ours) and the peer (:func:`_peer`), timed
    in turn each round (by the timer, or with ``kernel_time`` by the GPU time of the work each launches)."""
    want = case.reference(*case.args)
    peer_name, peer = _peer(case, prefer)
    contenders = {"ours": case.ours, **others}
    checks = {label: bench.check(thunk(), want, case.exact, case.within) for label, thunk in contenders.items()}
    checks[peer_name] = bench.agreement(peer(), want)
    del want
    order = [*contenders.items(), (peer_name, peer)]
    times = {label: [] for label, _ in order}
    for r in range(rounds):
        for label, thunk in order[r % len(order):] + order[:r % len(order)]:
            times[label].append(timer.kernel_us(thunk) if kernel_time else timer.median_us(thunk)[0])
    result = {"peer": peer_name, "checks": checks, "times_us": times, "by_contender": {}}
    for label in contenders:
        ratios = [p / o for o, p in zip(times[label], times[peer_name])]
        result["by_contender"][label] = {"ratios": ratios, "median_ratio": statistics.median(ratios),
                                         "won": sum(r >= 1 for r in ratios), "median_us": statistics.median(times[label])}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="mhc_pre_apply,engram_gate_backward")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--shapes", default="v4-d4096,v4-d7168", help="bench kernels' shape names, comma-separated")
    p.add_argument("--variants", action="store_true", help="also time sweep.py's variants of each op every round")
    p.add_argument("--control", action="store_true",
                   help="also time ours a second time as its own contender: the spread of a true tie")
    p.add_argument("--kernel-time", action="store_true",
                   help="compare the kernels' own GPU time (CUPTI, bench kernels' --kernel-time) instead of the timer's")
    p.add_argument("--peer", choices=["tile_kernels", "torch_compile"], default="tile_kernels",
                   help="the peer: tile-kernels where it has the op (default), or torch.compile of the reference")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device, seed, timer = bench.tuning_setup(a.iters)
    print(f"{bench.device_name(device)}  seed {seed}", flush=True)
    rows = []
    for op in a.ops.split(","):
        for shape_name in a.shapes.split(","):
            inputs = bench.StreamInputs if op in bench.MHC_OPS else bench.Inputs
            inp = inputs(bench.SHAPES[shape_name], device, seed)
            (case,) = bench.build_cases(inp, [op], with_peers=True)
            others = {**({"ours again": case.ours} if a.control else {}), **(variants(op, inp, case) if a.variants else {})}
            r = paired_rounds(case, timer, a.rounds, others, a.kernel_time, a.peer)
            peer_us = statistics.median(r["times_us"][r["peer"]])
            for label, c in r["by_contender"].items():
                print(f"{shape_name:9s} {op:22s} {label:34s} median ratio {c['median_ratio']:.4f}  won {c['won']}/{a.rounds}  "
                      f"{c['median_us']:.2f} us  {r['peer']} {peer_us:.2f} us  {r['checks'][label]}", flush=True)
            rows.append({"shape": shape_name, "op": op, **r})
    with open(a.out, "w") as f:
        json.dump({"device": bench.device_name(device), "seed": seed, "rounds": a.rounds, "kernel_time": a.kernel_time,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
