"""Paired rounds of an op against its tile-kernels peer on one GPU, for entries that a single
``ep-runtime bench kernels`` run calls a tie: each round times ours and then the peer (``bench
kernels``' timer, median of its iterations), ``--rounds`` times in one process, after one check of
ours against the reference. It reports every round's ratio (peer / ours: >= 1 means ours is not
slower), their median and how many rounds each side won.

    python3 bench/scripts/paired.py --ops mhc_pre_apply,engram_gate_backward --out $OUT/paired.json
    python3 bench/scripts/paired.py --ops per_block_cast,per_channel_cast --shapes large,small --out ...
"""

from __future__ import annotations

import argparse
import json
import statistics

from ep_runtime.bench import kernels as bench


def paired_rounds(case: bench.Case, timer: bench.Timer, rounds: int) -> dict:
    got = case.ours()
    check = bench.check(got, case.reference(*case.args), case.exact, case.within)
    del got
    (peer,) = (thunk for name, thunk in case.peers.items() if name.startswith("tile_kernels"))
    ours_us, peer_us = [], []
    for _ in range(rounds):
        ours_us.append(timer.median_us(case.ours)[0])
        peer_us.append(timer.median_us(peer)[0])
    ratios = [p / o for o, p in zip(ours_us, peer_us)]
    return {"check": check, "ours_us": ours_us, "tile_kernels_us": peer_us, "ratios": ratios,
            "median_ratio": statistics.median(ratios), "ours_won": sum(r >= 1 for r in ratios)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="mhc_pre_apply,engram_gate_backward")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--shapes", default="v4-d4096,v4-d7168", help="bench kernels' shape names, comma-separated")
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
            r = paired_rounds(case, timer, a.rounds)
            print(f"{shape_name:9s} {op:24s} median ratio {r['median_ratio']:.4f}  ours won {r['ours_won']}/{a.rounds}  "
                  f"ours {statistics.median(r['ours_us']):.1f} us  tile-kernels {statistics.median(r['tile_kernels_us']):.1f} us"
                  f"  {r['check']}", flush=True)
            rows.append({"shape": shape_name, "op": op, **r})
    with open(a.out, "w") as f:
        json.dump({"device": bench.device_name(device), "seed": seed, "rounds": a.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
