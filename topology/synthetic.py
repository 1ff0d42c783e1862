"""Synthetic expert loads and routes for demos, tests and the planner's benchmark.

Expert popularity follows a Zipf law: the expert of popularity rank ``r`` (1-based) is chosen with
weight ``r ** -s``; which expert gets which rank is a random permutation per layer. Routes are drawn
the way a DeepSeek-V3 router picks experts with group-limited routing: every token scores every
expert (``log popularity + Gumbel noise``, so that plain top-k would sample without replacement in
proportion to popularity), scores each group by the sum of its two best experts, keeps the
``topk_groups`` best groups and takes the ``topk`` best experts inside them.

Shape suffixes: L layers, E logical experts, T tokens, K routes per token (top-k).
"""

from __future__ import annotations

import torch

__all__ = ["draw_routes", "main", "route_load", "write_load_file", "zipf_popularity"]


def zipf_popularity(num_layers: int, num_experts: int, s: float, *, seed: int = 0) -> torch.Tensor:
    """Zipf(s) popularity of each expert, a random permutation of ranks per layer.

    Returns popularity_LE (float64, each row sums to 1).
    """
    if num_layers < 1 or num_experts < 1:
        raise ValueError(f"num_layers and num_experts: expected >= 1, got {num_layers}, {num_experts}")
    if not s >= 0:
        raise ValueError(f"s: expected a Zipf exponent >= 0, got {s!r}")
    g = torch.Generator().manual_seed(seed)
    weight_E = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -float(s)
    perm_LE = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_layers)])
    popularity_LE = weight_E[perm_LE]
    return popularity_LE / popularity_LE.sum(-1, keepdim=True)


def draw_routes(
    popularity_LE: torch.Tensor,
    num_tokens: int,
    topk: int,
    *,
    expert_groups: int | None = None,
    topk_groups: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Draws group-limited top-k routes from per-expert popularity.

    Args:
        popularity_LE: [L, E] positive weights (need not sum to 1).
        num_tokens: T, tokens drawn per layer.
        topk: K, experts per token.
        expert_groups: number of expert groups (None: plain top-k over all experts).
        topk_groups: groups a token may use (required with ``expert_groups``).
        seed: the draw is a pure function of the arguments.

    Returns:
        topk_idx_LTK: [L, T, K] int64 logical expert ids, distinct within a token.
    """
    L, E = popularity_LE.shape
    g = torch.Generator().manual_seed(seed)
    u_LTE = torch.rand(L, num_tokens, E, generator=g).clamp_(1e-7, 1 - 1e-7)
    score_LTE = popularity_LE.float().clamp(min=1e-30).log().unsqueeze(1) - u_LTE.log_().neg_().log_()
    if expert_groups is not None:
        if E % expert_groups:
            raise ValueError(f"expert_groups: expected a divisor of {E} experts, got {expert_groups}")
        if topk_groups is None or not 1 <= topk_groups <= expert_groups:
            raise ValueError(f"topk_groups: expected 1..{expert_groups}, got {topk_groups}")
        score_LTGM = score_LTE.view(L, num_tokens, expert_groups, E // expert_groups)
        group_score_LTG = score_LTGM.topk(min(2, E // expert_groups), dim=-1).values.sum(-1)
        keep_LTg = group_score_LTG.topk(topk_groups, dim=-1).indices
        size = E // expert_groups
        kept_LTgM = score_LTGM.gather(2, keep_LTg.unsqueeze(-1).expand(L, num_tokens, topk_groups, size))
        pick_LTK = kept_LTgM.view(L, num_tokens, -1).topk(topk, dim=-1).indices  # among the kept groups' experts
        return keep_LTg.gather(2, pick_LTK // size) * size + pick_LTK % size
    return score_LTE.topk(topk, dim=-1).indices


def route_load(topk_idx_LTK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per logical expert: load_LE (float64) counted from topk_idx_LTK; -1 entries are ignored."""
    L = topk_idx_LTK.shape[0]
    idx_LN = topk_idx_LTK.reshape(L, -1)
    valid_LN = idx_LN >= 0
    load_LE = torch.zeros(L, num_experts, dtype=torch.float64)
    load_LE.scatter_add_(1, idx_LN.clamp(min=0), valid_LN.double())
    return load_LE


def write_load_file(path: str, *, layers: int, experts: int, s: float, expert_groups: int | None, topk: int,
                    topk_groups: int | None, tokens: int, seed: int = 0, routes_path: str | None = None,
                    held_out_path: str | None = None) -> dict:
    """Draws routes, writes their per-expert load as JSON (and the routes as a .pt file when asked);
    ``held_out_path``: also a second, independent sample of as many tokens from the same popularity,
    the routes ``ep-runtime plan`` judges the plan on.

    The JSON holds ``load`` ([layers][experts] routed tokens), ``expert_groups``, ``topk``,
    ``topk_groups``, ``tokens`` and, when written, ``routes`` and ``held_out_routes`` (.pt paths
    relative to the JSON).
    """
    import json
    import os
    from pathlib import Path

    popularity_LE = zipf_popularity(layers, experts, s, seed=seed)
    doc = {"expert_groups": expert_groups, "topk": topk, "topk_groups": topk_groups, "tokens": tokens, "zipf_s": s,
           "seed": seed}
    for key, out, draw_seed in (("routes", routes_path, seed + 1), ("held_out_routes", held_out_path, seed + 2)):
        if key == "routes" or out is not None:
            topk_idx_LTK = draw_routes(popularity_LE, tokens, topk, expert_groups=expert_groups,
                                       topk_groups=topk_groups, seed=draw_seed)
        if key == "routes":
            doc["load"] = route_load(topk_idx_LTK, experts).tolist()
        if out is not None:
            torch.save(topk_idx_LTK.to(torch.int16 if experts < 2**15 else torch.int32), out)
            doc[key] = os.path.relpath(out, start=os.path.dirname(os.path.abspath(path)))
    Path(path).write_text(json.dumps(doc))
    return doc


def main(argv: list[str] | None = None) -> int:
    """``python -m topology.synthetic --out load.json``: a Zipf load file for ``ep-runtime plan``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m topology.synthetic", description=main.__doc__)
    ap.add_argument("--out", required=True, help="load JSON to write")
    ap.add_argument("--routes", help="also write the drawn routes here (.pt), for an exact traffic count")
    ap.add_argument("--held-out", help="also write a second, independent sample of routes here (.pt): the tokens "
                    "ep-runtime plan judges the plan on")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s of expert popularity")
    ap.add_argument("--groups", type=int, default=8, help="expert groups (0: no group-limited routing)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--topk-groups", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens drawn per layer")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    groups = args.groups or None
    write_load_file(args.out, layers=args.layers, experts=args.experts, s=args.zipf, expert_groups=groups,
                    topk=args.topk, topk_groups=args.topk_groups if groups else None, tokens=args.tokens,
                    seed=args.seed, routes_path=args.routes, held_out_path=args.held_out)
    print(f"wrote {args.out}: {args.layers} layers x {args.experts} experts, Zipf s={args.zipf}, "
          f"groups={groups}, top-{args.topk}" + (f", routes in {args.routes}" if args.routes else "")
          + (f", held-out routes in {args.held_out}" if args.held_out else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
