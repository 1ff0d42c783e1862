"""The planner's bars, measured: ``python -m topology.bench [--seeds 5] [--out results.json]``.

Setup: 256 experts in 8 groups, 4 nodes x 8 H100 (``examples/h100-4x8.yaml``), 288
physical experts (32 extra slots), Zipf(s) popularity for s in {0.8, 1.0, 1.2}, routes drawn with
group-limited top-8 (top-4 groups); load = the routes' per-expert counts. For every (s, seed) it plans
``--layers`` layers with ``locality``, EPLB's global and hierarchical policies and counts traffic on
the same routes, then:

1. balance: max/mean GPU load of ``locality`` within 1% of EPLB global's;
2. traffic: mean remote nodes per token of ``locality`` no higher than EPLB hierarchical's;
3. drift: each expert's load times a uniform random factor in [0.5, 2]; ``replan`` must move at most
   25% of the expert weights a from-scratch plan moves, within 2% of its balance;
4. time: planning 61 layers x 256 experts under 1 s (best of 3, placement only and with traffic).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .cluster import Topology
from .planner import migration, plan
from .replanner import replan
from .synthetic import draw_routes, route_load, zipf_popularity
from .traffic import TrafficModel

EXPERTS, GROUPS, TOPK, TOPK_GROUPS, PHYSICAL = 256, 8, 8, 4, 288
EXAMPLE = Path(__file__).resolve().parent / "examples" / "h100-4x8.yaml"


def _one(s: float, seed: int, layers: int, tokens: int, topology: Topology) -> dict:
    popularity = zipf_popularity(layers, EXPERTS, s, seed=seed)
    routes = draw_routes(popularity, tokens, TOPK, expert_groups=GROUPS, topk_groups=TOPK_GROUPS, seed=seed + 1000)
    load = route_load(routes, EXPERTS)
    model = TrafficModel(routes_LTK=routes)
    plans = {name: plan(load, topology, PHYSICAL, GROUPS, name, traffic=model)
             for name in ("locality", "eplb_global", "eplb_hierarchical")}
    row = {f"{name}_balance": p.balance for name, p in plans.items()}
    row.update({f"{name}_remote": p.traffic.remote_nodes_per_token for name, p in plans.items()})
    # Drift: the load itself moves; routes for the traffic after drift are redrawn from the new popularity.
    factor = 0.5 + 1.5 * torch.rand(layers, EXPERTS, generator=torch.Generator().manual_seed(seed + 2000),
                                    dtype=torch.float64)
    new_load = load * factor
    new_routes = draw_routes(popularity * factor, tokens, TOPK, expert_groups=GROUPS, topk_groups=TOPK_GROUPS,
                             seed=seed + 3000)
    new_model = TrafficModel(routes_LTK=new_routes)
    current = plans["locality"]
    moved = replan(current, new_load, traffic=new_model)
    fresh = plan(new_load, topology, PHYSICAL, GROUPS, traffic=new_model)
    fresh_moves = migration(current, fresh).experts_moved
    row.update(replan_moves=moved.migration.experts_moved, fresh_moves=fresh_moves,
               replan_move_ratio=moved.migration.experts_moved / max(fresh_moves, 1),
               replan_balance=moved.balance, fresh_balance=fresh.balance,
               replan_balance_ratio=float((moved.balance_L / fresh.balance_L).max()),
               replan_remote=moved.traffic.remote_nodes_per_token, fresh_remote=fresh.traffic.remote_nodes_per_token,
               stale_balance=float(plan_balance(current, new_load)))
    return row


def plan_balance(p, load_LE: torch.Tensor) -> float:
    """Mean max/mean GPU load of plan ``p``'s placement under another load."""
    weight = (load_LE / p.replica_counts_LE).gather(1, p.phy2log_LP)
    gpu = weight.view(p.num_layers, p.topology.num_gpus, -1).sum(-1)
    return float((gpu.max(-1).values / gpu.mean(-1)).mean())


def _timing(topology: Topology, repeats: int = 3) -> dict:
    popularity = zipf_popularity(61, EXPERTS, 1.0, seed=0)
    load = route_load(draw_routes(popularity, 1024, TOPK, expert_groups=GROUPS, topk_groups=TOPK_GROUPS), EXPERTS)
    out = {}
    threads = torch.get_num_threads()
    for label, n in (("default_threads", threads), ("one_thread", 1)):
        torch.set_num_threads(n)
        for what, model in (("placement", None), ("with_traffic", TrafficModel())):
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                plan(load, topology, PHYSICAL, GROUPS, traffic=model)
                best = min(best, time.perf_counter() - start)
            out[f"{what}_{label}_s"] = best
    torch.set_num_threads(threads)
    out["threads"] = threads
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m topology.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="layers per seed (each its own Zipf permutation)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens drawn per layer")
    ap.add_argument("--out", help="write the rows and summary as JSON here")
    args = ap.parse_args(argv)
    topology = Topology.from_file(EXAMPLE)
    rows = []
    print(f"{topology.describe()}; {EXPERTS} experts in {GROUPS} groups, {PHYSICAL} physical, top-{TOPK} of "
          f"top-{TOPK_GROUPS} groups, {args.tokens} tokens x {args.layers} layers x {args.seeds} seeds per s")
    head = (f"{'s':>4} {'seed':>4} | {'balance: ours':>13} {'global':>7} {'hier':>7} | {'remote: ours':>12} "
            f"{'global':>7} {'hier':>7} | {'replan moves':>12} {'fresh':>6} {'ratio':>6} {'bal ratio':>9}")
    print(head)
    print("-" * len(head))
    for s in (0.8, 1.0, 1.2):
        for seed in range(args.seeds):
            r = _one(s, seed, args.layers, args.tokens, topology)
            r.update(s=s, seed=seed)
            rows.append(r)
            print(f"{s:>4} {seed:>4} | {r['locality_balance']:>13.4f} {r['eplb_global_balance']:>7.4f} "
                  f"{r['eplb_hierarchical_balance']:>7.4f} | {r['locality_remote']:>12.3f} {r['eplb_global_remote']:>7.3f} "
                  f"{r['eplb_hierarchical_remote']:>7.3f} | {r['replan_moves']:>12} {r['fresh_moves']:>6} "
                  f"{r['replan_move_ratio']:>6.3f} {r['replan_balance_ratio']:>9.4f}")
    print()
    summary = {}
    ok_all = True
    for s in (0.8, 1.0, 1.2):
        sub = [r for r in rows if r["s"] == s]

        def mean(key, sub=sub):
            return sum(r[key] for r in sub) / len(sub)

        bal_ok = all(r["locality_balance"] <= 1.01 * r["eplb_global_balance"] for r in sub)
        remote_ok = all(r["locality_remote"] <= r["eplb_hierarchical_remote"] for r in sub)
        moves_ok = all(r["replan_move_ratio"] <= 0.25 for r in sub)
        drift_bal_ok = all(r["replan_balance_ratio"] <= 1.02 + 1e-9 for r in sub)
        ok_all &= bal_ok and remote_ok and moves_ok and drift_bal_ok
        summary[str(s)] = {k: mean(k) for k in sub[0] if k not in ("s", "seed")}
        summary[str(s)].update(balance_bar=bal_ok, remote_bar=remote_ok, replan_moves_bar=moves_ok,
                               replan_balance_bar=drift_bal_ok)
        print(f"s={s}: balance ours {mean('locality_balance'):.4f} vs global {mean('eplb_global_balance'):.4f} "
              f"(hier {mean('eplb_hierarchical_balance'):.4f}) [{'ok' if bal_ok else 'MISSED'}]; remote nodes/token "
              f"ours {mean('locality_remote'):.3f} vs hier {mean('eplb_hierarchical_remote'):.3f} "
              f"(global {mean('eplb_global_remote'):.3f}) [{'ok' if remote_ok else 'MISSED'}]")
        print(f"       drift: replan moves {mean('replan_moves'):.0f} of a fresh plan's {mean('fresh_moves'):.0f} "
              f"({100 * mean('replan_move_ratio'):.1f}%, worst {100 * max(r['replan_move_ratio'] for r in sub):.1f}%) "
              f"[{'ok' if moves_ok else 'MISSED'}]; balance {mean('replan_balance'):.4f} vs fresh "
              f"{mean('fresh_balance'):.4f}, worst layer ratio {max(r['replan_balance_ratio'] for r in sub):.4f} "
              f"[{'ok' if drift_bal_ok else 'MISSED'}]; stale plan {mean('stale_balance'):.4f}; remote nodes/token "
              f"replan {mean('replan_remote'):.3f} vs fresh {mean('fresh_remote'):.3f}")
    timing = _timing(topology)
    time_ok = timing["placement_default_threads_s"] < 1.0
    ok_all &= time_ok
    print(f"time, 61 layers x 256 experts (best of 3): placement {timing['placement_default_threads_s']:.3f} s "
          f"({timing['threads']} threads), {timing['placement_one_thread_s']:.3f} s (1 thread); with the traffic "
          f"estimate {timing['with_traffic_default_threads_s']:.3f} s / {timing['with_traffic_one_thread_s']:.3f} s "
          f"[{'ok' if time_ok else 'MISSED'}]")
    print("all bars met" if ok_all else "SOME BARS MISSED")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "timing": timing,
                                              "all_bars_met": ok_all}, indent=1))
        print(f"wrote {args.out}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
