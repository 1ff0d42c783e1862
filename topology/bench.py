"""The planner's bars, measured: ``python -m topology.bench [--seeds 5] [--drift-steps 100] [--out results.json]``.

Setup: 256 experts in 8 groups, 4 nodes x 8 H100 (``examples/h100-4x8.yaml``), 288 physical experts
(32 extra slots), Zipf(s) popularity for s in {0.8, 1.0, 1.2}, routes drawn with group-limited top-8
(top-4 groups). Every plan is built from one sample of routes and judged on a second, held-out
sample from the same router (``Plan.evaluate``):

1. balance: held-out max/mean GPU load of ``locality`` within 1% of EPLB global's;
2. traffic: held-out remote nodes per token of ``locality`` no higher than EPLB hierarchical's;
3. drift (:func:`topology.drift.drift_run`): popularity drifting 10% a step for ``--drift-steps``
   steps, a ``replan`` every step from the step's window, judged with a fresh plan of the same window
   on the next window: balance within 0.5% and remote nodes per token within 2% of the fresh plan's,
   at most 8% of the slots moved per re-plan (every step's figures, and their means per fifth);
4. time: planning DeepSeek-V3's 58 MoE layers x 256 experts on 32 nodes x 8 GPUs
   (``examples/h100-32x8.yaml``, 512 slots), the default traffic estimate included, under 0.5 s on
   one thread (median of ``--repeats``; pin the process to one core, e.g. ``taskset -c 0``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from .cluster import Topology
from .drift import drift_run
from .planner import plan
from .synthetic import draw_routes, route_load, zipf_popularity

EXPERTS, GROUPS, TOPK, TOPK_GROUPS, PHYSICAL = 256, 8, 8, 4, 288
EXAMPLES = Path(__file__).resolve().parent / "examples"
POLICIES = ("locality", "eplb_global", "eplb_hierarchical")


def _held_out(s: float, seed: int, layers: int, tokens: int, topology: Topology) -> dict:
    popularity = zipf_popularity(layers, EXPERTS, s, seed=seed)
    fit, held_out = (draw_routes(popularity, tokens, TOPK, expert_groups=GROUPS, topk_groups=TOPK_GROUPS,
                                 seed=seed * 1000 + k) for k in (1, 2))
    load = route_load(fit, EXPERTS)
    row = {}
    for name in POLICIES:
        p = plan(load, topology, PHYSICAL, GROUPS, name, traffic=None)
        judged = p.evaluate(held_out)
        row.update({f"{name}_balance": judged.balance, f"{name}_remote": judged.remote_nodes_per_token,
                    f"{name}_fitted_balance": p.balance})
    return row


def _timing(repeats: int) -> dict:
    topology = Topology.from_file(EXAMPLES / "h100-32x8.yaml")
    popularity = zipf_popularity(58, EXPERTS, 1.0, seed=0)
    load = route_load(draw_routes(popularity, 4096, TOPK, expert_groups=GROUPS, topk_groups=TOPK_GROUPS), EXPERTS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for what, traffic in (("placement", None), ("with_traffic", "default")):
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            if traffic is None:
                plan(load, topology, 512, GROUPS, traffic=None)
            else:
                plan(load, topology, 512, GROUPS)
            seconds.append(time.perf_counter() - start)
        out[f"{what}_median_s"] = statistics.median(seconds)
        out[f"{what}_all_s"] = seconds
    torch.set_num_threads(threads)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m topology.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="layers per seed (each its own Zipf permutation)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens drawn per layer and sample")
    ap.add_argument("--drift-steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7, help="timed plans of the 32 x 8 case")
    ap.add_argument("--out", help="write the rows and summary as JSON here")
    args = ap.parse_args(argv)
    topology = Topology.from_file(EXAMPLES / "h100-4x8.yaml")
    print(f"{topology.describe()}; {EXPERTS} experts in {GROUPS} groups, {PHYSICAL} physical, top-{TOPK} of "
          f"top-{TOPK_GROUPS} groups; planned from {args.tokens} tokens a layer, judged on {args.tokens} other ones")
    rows, summary, ok_all = [], {}, True
    for s in (0.8, 1.0, 1.2):
        sub = [dict(_held_out(s, seed, args.layers, args.tokens, topology), s=s, seed=seed) for seed in range(args.seeds)]
        rows += sub
        mean = {k: sum(r[k] for r in sub) / len(sub) for k in sub[0] if k not in ("s", "seed")}
        bal_ok = all(r["locality_balance"] <= 1.01 * r["eplb_global_balance"] for r in sub)
        remote_ok = all(r["locality_remote"] <= r["eplb_hierarchical_remote"] for r in sub)
        ok_all &= bal_ok and remote_ok
        summary[str(s)] = dict(mean, balance_bar=bal_ok, remote_bar=remote_ok)
        print(f"s={s}: held-out balance locality {mean['locality_balance']:.4f} vs EPLB global "
              f"{mean['eplb_global_balance']:.4f} (hier. {mean['eplb_hierarchical_balance']:.4f}) "
              f"[{'ok' if bal_ok else 'MISSED'}]; remote nodes/token {mean['locality_remote']:.3f} vs hier. "
              f"{mean['eplb_hierarchical_remote']:.3f} (global {mean['eplb_global_remote']:.3f}) "
              f"[{'ok' if remote_ok else 'MISSED'}]; fitted balance {mean['locality_fitted_balance']:.4f}")
    drift = []
    if args.drift_steps:
        drift = [vars(step) for step in drift_run(topology, steps=args.drift_steps, tokens=args.tokens,
                                                  layers=args.layers)]
        fifth = max(1, len(drift) // 5)
        print(f"drift, 10% a step, a re-plan every step judged on the next window (means per {fifth} steps):")
        for i in range(0, len(drift), fifth):
            part = drift[i:i + fifth]

            def m(key, part=part):
                return sum(d[key] for d in part) / len(part)

            print(f"  steps {part[0]['step']:>3}-{part[-1]['step']:>3}: balance {m('balance'):.4f} (fresh "
                  f"{m('fresh_balance'):.4f}), remote nodes/token {m('remote'):.3f} (fresh {m('fresh_remote'):.3f}), "
                  f"moved {100 * m('moved'):.1f}% of the slots (fresh {100 * m('fresh_moved'):.1f}%)")
        worst_balance = max(d["balance"] / d["fresh_balance"] for d in drift) - 1
        mean_balance = sum(d["balance"] / d["fresh_balance"] for d in drift) / len(drift) - 1
        mean_remote = sum(d["remote"] / d["fresh_remote"] for d in drift) / len(drift) - 1
        worst_moved = max(d["moved"] for d in drift)
        drift_ok = mean_balance <= 0.005 and mean_remote <= 0.02 and worst_moved <= 0.08
        ok_all &= drift_ok
        summary["drift"] = dict(mean_balance_excess=mean_balance, worst_balance_excess=worst_balance,
                                mean_remote_excess=mean_remote, worst_moved=worst_moved, bar=drift_ok)
        print(f"  over {len(drift)} steps: balance {100 * mean_balance:+.2f}% (worst step {100 * worst_balance:+.2f}%), "
              f"remote nodes/token {100 * mean_remote:+.2f}% of a fresh plan's, at most {100 * worst_moved:.1f}% "
              f"of the slots moved [{'ok' if drift_ok else 'MISSED'}]")
    timing = _timing(args.repeats)
    time_ok = timing["with_traffic_median_s"] < 0.5
    ok_all &= time_ok
    print(f"time, 58 layers x 256 experts on 32 x 8 GPUs, 512 slots, one thread (median of {args.repeats}): placement "
          f"{timing['placement_median_s']:.3f} s, with the traffic estimate {timing['with_traffic_median_s']:.3f} s "
          f"[{'ok' if time_ok else 'MISSED'}]")
    print("all bars met" if ok_all else "SOME BARS MISSED")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "drift": drift, "summary": summary, "timing": timing,
                                              "all_bars_met": ok_all}, indent=1))
        print(f"wrote {args.out}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
