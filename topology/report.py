"""``ep-runtime plan``: plan a placement from a topology and a load file, judge it on held-out
routes, print it, compare, draw it.

    ep-runtime plan --topology cluster.yaml --load load.json [--held-out next.json] [--png placement.png] [--compare]
    python -m topology.report --topology topology/examples/h100-4x8.yaml --load load.json --compare

The load file is JSON: ``load`` ([layers][experts]), optional ``expert_groups``, ``topk``,
``topk_groups``, ``num_physical_experts``, and .pt files of [layers, tokens, topk] routes relative to
the JSON: ``routes`` (the tokens the load counts) and ``held_out_routes`` (other tokens);
``python -m topology.synthetic`` writes one. Every figure of the report is measured on routes the
plan was not built from, the first of: ``--held-out``'s routes (e.g. the next window of a training
run), the file's ``held_out_routes``, the second half of its ``routes`` (the plan then uses the
first half's counts), else routes drawn from the load itself (said to be not held out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .cluster import Topology
from .planner import POLICIES, Plan, plan
from .traffic import Traffic, TrafficModel

__all__ = ["compare", "draw", "judging_routes", "main"]

COMPARED = ("locality", "eplb_global", "eplb_hierarchical", "greedy", "none")


def _read_load(path: str) -> dict:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # a routes .pt given for the load JSON, say
        raise ValueError(f"{path}: expected a load JSON, got a file that is not JSON text ({exc})") from exc
    if isinstance(doc, list):
        doc = {"load": doc}
    if not isinstance(doc, dict) or "load" not in doc:
        raise ValueError(f"{path}: expected an object with a 'load' key ([layers][experts])")
    doc["load"] = torch.tensor(doc["load"], dtype=torch.float64)
    if doc["load"].dim() == 1:
        doc["load"] = doc["load"].unsqueeze(0)
    for key in ("routes", "held_out_routes"):
        if doc.get(key):
            doc[key] = torch.load(p.parent / doc[key]).long()
    return doc


def judging_routes(doc: dict, held_out: dict | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(load to plan from, routes to judge on, where those routes come from) for a load file and an
    optional second one (``--held-out``); see the module docstring for the order."""
    from .synthetic import draw_routes, route_load

    load_LE = doc["load"]
    if held_out is not None and held_out.get("routes") is not None:
        return load_LE, held_out["routes"], "held out: the routes of --held-out"
    if doc.get("held_out_routes") is not None:
        return load_LE, doc["held_out_routes"], "held out: the file's held_out_routes"
    routes = doc.get("routes")
    if routes is not None and routes.shape[1] >= 2:
        half = routes.shape[1] // 2
        return (route_load(routes[:, :half], load_LE.shape[1]), routes[:, half:],
                f"held out: the second half of the file's routes (the plan counts the first {half} tokens)")
    groups = doc.get("expert_groups")
    topk_groups = doc.get("topk_groups") or (max(1, groups // 2) if groups else None)
    E = load_LE.shape[1]
    topk = min(int(doc.get("topk", 8)), E if groups is None else topk_groups * (E // groups))
    drawn = draw_routes(load_LE + 1e-9 * load_LE.sum(-1, keepdim=True).clamp(min=1) / E, 4096, topk,
                        expert_groups=groups, topk_groups=topk_groups, seed=1)
    return load_LE, drawn, "NOT held out: 4096 tokens a layer drawn from the planned load (give routes)"


def compare(load_LE: torch.Tensor, topology: Topology, num_physical: int, expert_groups: int | None,
            routes_LTK: torch.Tensor, *, tokens_per_gpu: int, token_bytes: int,
            policies: tuple[str, ...] = COMPARED) -> dict[str, tuple[Plan, Traffic, float] | str]:
    """Plans with each policy and judges it on ``routes_LTK``: (plan, the routes' traffic and
    balance, seconds spent planning, the expected-traffic estimate included), or a string saying why the policy does not apply. ``none`` runs
    with P = E (it does not replicate)."""
    out: dict[str, tuple[Plan, Traffic, float] | str] = {}
    E = load_LE.shape[1]
    for name in policies:
        physical = E if name == "none" else num_physical
        if name == "none" and E % topology.num_gpus:
            out[name] = f"needs experts ({E}) divisible by GPUs ({topology.num_gpus})"
            continue
        if name == "eplb_hierarchical" and (expert_groups is None or expert_groups % topology.num_nodes):
            out[name] = f"needs expert groups ({expert_groups}) divisible by nodes ({topology.num_nodes})"
            continue
        start = time.perf_counter()  # as a job plans: placement and the expected-traffic estimate
        p = plan(load_LE, topology, physical, expert_groups, name,
                 traffic=TrafficModel(tokens_per_gpu=tokens_per_gpu, token_bytes=token_bytes))
        seconds = time.perf_counter() - start
        out[name] = (p, p.evaluate(routes_LTK, tokens_per_gpu=tokens_per_gpu, token_bytes=token_bytes), seconds)
    return out


def _table(results: dict[str, tuple[Plan, Traffic, float] | str]) -> str:
    head = (f"{'policy':<18} {'P':>5} {'balance':>8} {'worst':>8} {'fitted':>8} {'remote nodes':>13} "
            f"{'intra copies':>13} {'inter GB':>9} {'intra GB':>10} {'plan s':>7}")
    lines = [head, "-" * len(head)]
    for name, result in results.items():
        if isinstance(result, str):
            lines.append(f"{name:<18} {'-':>5}  ({result})")
            continue
        p, tr, seconds = result
        lines.append(
            f"{name:<18} {p.num_physical_experts:>5} {tr.balance:>8.4f} {float(tr.balance_L.max()):>8.4f} "
            f"{p.balance:>8.4f} {tr.remote_nodes_per_token:>13.3f} {tr.intra_node_copies_per_token:>13.3f} "
            f"{tr.inter_node_bytes / 1e9:>9.2f} {tr.intra_node_bytes / 1e9:>10.2f} {seconds:>7.3f}")
    lines.append("judged on the routes above: balance = mean over layers of max/mean routes a GPU received (worst: "
                 "the worst layer); fitted = the same on the load planned for; remote nodes = inter-node (RDMA) "
                 "transfers per token; GB = dispatch bytes per step over inter-/intra-node links, all layers")
    return "\n".join(lines)


def _placement_text(p: Plan, layer: int, max_gpus: int = 64) -> str:
    """One line per GPU: its experts (xN = replicas of the expert in the layer) and its load."""
    t = p.topology
    per = p.experts_per_gpu
    mean = float(p.gpu_load_LG[layer].mean()) or 1.0
    size = p.num_experts // (p.expert_groups or p.num_experts)
    lines = [f"layer {layer} placement ({p.policy}); expert e[group], load relative to the mean GPU:"]
    for g in range(min(t.num_gpus, max_gpus)):
        experts = p.phy2log_LP[layer, g * per:(g + 1) * per].tolist()
        cells = " ".join(f"{e}[{e // size}]" + (f"x{int(p.replica_counts_LE[layer, e])}"
                                                   if p.replica_counts_LE[layer, e] > 1 else "") for e in experts)
        lines.append(f"  node {t.node_of_gpu[g]:>3} gpu {g:>4}  load {float(p.gpu_load_LG[layer, g]) / mean:6.3f}  {cells}")
    if t.num_gpus > max_gpus:
        lines.append(f"  ... {t.num_gpus - max_gpus} more GPUs")
    return "\n".join(lines)


def draw(judged: list[tuple[Plan, Traffic]], layer: int, path: str) -> None:
    """Stacked per-GPU load bars (the load planned for) for one layer, one panel per plan, coloured by
    expert group; titles give the balance and traffic judged on held-out routes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [p for p, _ in judged]
    fig, axes = plt.subplots(len(plans), 1, figsize=(min(30, max(8, plans[0].topology.num_gpus * 0.28)), 2.6 * len(plans)),
                             squeeze=False)
    for ax, (p, held_out) in zip(axes[:, 0], judged):
        t = p.topology
        per = p.experts_per_gpu
        groups = p.expert_groups or 1
        size = p.num_experts // groups
        cmap = plt.get_cmap("tab10" if groups <= 10 else "tab20")
        mean = float(p.gpu_load_LG[layer].mean()) or 1.0
        weight_P = (p.load_LE[layer] / p.replica_counts_LE[layer])[p.phy2log_LP[layer]] / mean
        for g in range(t.num_gpus):
            bottom = 0.0
            for e, w in zip(p.phy2log_LP[layer, g * per:(g + 1) * per].tolist(),
                            weight_P[g * per:(g + 1) * per].tolist()):
                replicated = p.replica_counts_LE[layer, e] > 1
                ax.bar(g, w, bottom=bottom, color=cmap((e // size) % cmap.N), edgecolor="black" if replicated else "white",
                       linewidth=0.8 if replicated else 0.3, width=0.85)
                bottom += w
        for n in range(1, t.num_nodes):
            ax.axvline(n * t.gpus_per_node - 0.5, color="grey", linestyle=":", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_title(f"{p.policy}, layer {layer}, held out: max/mean {float(held_out.balance_L[layer]):.3f}, "
                     f"{float(held_out.remote_nodes_per_token_L[layer]):.2f} remote nodes/token (fitted max/mean "
                     f"{float(p.balance_L[layer]):.3f})", fontsize=9)
        ax.set_ylabel("load / mean")
        ax.set_xlim(-0.6, t.num_gpus - 0.4)
    axes[-1, 0].set_xlabel("GPU (dotted lines: node boundaries; colour: expert group; black edge: replicated expert)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _read_arg(flag: str, path: str, read):
    """``read(path)``, or the program's exit naming the flag and what is wrong with the file."""
    import yaml

    try:
        return read(path)
    except (OSError, ValueError, KeyError, yaml.YAMLError) as error:  # json.JSONDecodeError is a ValueError
        raise SystemExit(f"ep-runtime plan: {flag} {path}: {type(error).__name__}: {error}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ep-runtime plan", description="Plan expert placement for a cluster.")
    ap.add_argument("--topology", required=True, help="cluster description (.yaml/.yml/.json)")
    ap.add_argument("--load", required=True, help="load JSON ({'load': [[...]], ...}); see topology.synthetic")
    ap.add_argument("--held-out", help="a load JSON whose routes judge the plan (e.g. the next window of a run)")
    ap.add_argument("--physical", type=int, help="physical experts per layer, a multiple of the GPUs (default: the "
                    "file's, else the experts rounded up to whole GPUs plus one replica slot a GPU)")
    ap.add_argument("--groups", type=int, help="expert groups of group-limited routing (default: the file's)")
    ap.add_argument("--policy", default="locality", choices=sorted(POLICIES))
    ap.add_argument("--compare", action="store_true", help="also plan with the baselines and print them side by side")
    ap.add_argument("--png", help="draw the placement of --layer here")
    ap.add_argument("--layer", type=int, default=0, help="layer to print and draw")
    ap.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens per GPU per step, for bytes")
    ap.add_argument("--token-bytes", type=int, default=7168 * 2, help="bytes per dispatched token")
    ap.add_argument("--json", help="write the plan (phy2log, counts, held-out balance and traffic) here")
    args = ap.parse_args(argv)

    topology = _read_arg("--topology", args.topology, Topology.from_file)
    doc = _read_arg("--load", args.load, _read_load)
    held_out = _read_arg("--held-out", args.held_out, _read_load) if args.held_out else None
    L, E = doc["load"].shape
    groups = args.groups if args.groups is not None else doc.get("expert_groups")
    gpus = topology.num_gpus
    # default: the logical experts rounded up to whole GPUs, plus one replica slot a GPU
    physical = args.physical or doc.get("num_physical_experts") or -(-E // gpus) * gpus + gpus
    if physical % gpus or physical < E:
        raise SystemExit(f"--physical: expected a multiple of the {gpus} GPUs and at least the {E} experts, "
                         f"got {physical}")
    if not 0 <= args.layer < L:
        raise SystemExit(f"--layer: expected 0..{L - 1}, got {args.layer}")
    print(topology.describe())
    try:
        load_LE, routes_LTK, source = judging_routes(doc, held_out)
        print(f"load: {L} layers x {E} experts from {args.load}; judged on {routes_LTK.shape[1]} tokens a layer, "
              f"{source}")
        results = compare(load_LE, topology, physical, groups, routes_LTK, tokens_per_gpu=args.tokens_per_gpu,
                          token_bytes=args.token_bytes,
                          policies=tuple(dict.fromkeys((args.policy,) + (COMPARED if args.compare else ()))))
    except ValueError as error:  # the planner's checks name what is wrong (the load's values, the groups)
        raise SystemExit(f"ep-runtime plan: {error}") from None
    if isinstance(results[args.policy], str):
        raise SystemExit(f"--policy {args.policy}: {results[args.policy]}")
    main_plan, judged, seconds = results[args.policy]
    print(main_plan.summary())
    print(f"  judged on the routes above ({source.split(':')[0]}): balance {judged.balance:.4f} (worst layer "
          f"{float(judged.balance_L.max()):.4f}), {judged.remote_nodes_per_token:.3f} remote nodes and "
          f"{judged.intra_node_copies_per_token:.3f} intra-node copies per token; planned in {seconds:.3f} s")
    print(_placement_text(main_plan, args.layer))
    if args.compare:
        print()
        print(_table(results))
    if args.png:
        others = ("eplb_global", "eplb_hierarchical") if args.compare else ()
        drawn = [(main_plan, judged)] + [results[n][:2] for n in others
                                         if n != args.policy and not isinstance(results[n], str)]
        draw(drawn, args.layer, args.png)
        print(f"wrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "policy": main_plan.policy, "phy2log": main_plan.phy2log_LP.tolist(),
            "replica_counts": main_plan.replica_counts_LE.tolist(), "judged_on": source,
            "balance_per_layer": judged.balance_L.tolist(), "fitted_balance_per_layer": main_plan.balance_L.tolist(),
            "remote_nodes_per_token": judged.remote_nodes_per_token,
            "inter_node_bytes_per_step": judged.inter_node_bytes,
            "intra_node_bytes_per_step": judged.intra_node_bytes, "plan_seconds": seconds,
            "topology": topology.to_dict()}))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
