"""Re-planning under a drifting load, judged on tokens the plans were not built from.

:func:`drift_run` follows a router whose expert popularity drifts every step (each expert's
popularity times ``exp(rate * z)``, z standard normal: a random walk of about ``rate`` per step).
Every step draws a window of routes; :func:`topology.replan` turns the plan in use into one for that
window's load, and a fresh ``locality`` plan is made from the same load; both are judged on the
next window (drawn after the popularity drifted once more), which neither saw.
``python -m topology.bench`` prints it for DeepSeek-V3's router; the tests run a small one.

Shape suffixes: L layers, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cluster import Topology
from .planner import plan
from .replanner import replan
from .synthetic import draw_routes, route_load, zipf_popularity

__all__ = ["DriftStep", "drift_run"]


@dataclass(frozen=True, kw_only=True)
class DriftStep:
    """One re-plan of :func:`drift_run`, judged on the next window.

    Fields:
        step: 1-based.
        balance, fresh_balance: held-out max/mean routes a GPU received (mean over layers), re-plan / fresh.
        remote, fresh_remote: held-out remote nodes per token, re-plan / fresh.
        moved, fresh_moved: fraction of the slots receiving weights from another GPU, re-plan / fresh.
        within: the re-plan's own check (``ReplanCheck.within``) on the window it saw.
    """

    step: int
    balance: float
    fresh_balance: float
    remote: float
    fresh_remote: float
    moved: float
    fresh_moved: float
    within: bool


def drift_run(topology: Topology, *, steps: int, rate: float = 0.1, layers: int = 4, experts: int = 256,
              physical: int = 288, groups: int = 8, topk: int = 8, topk_groups: int = 4, tokens: int = 16384,
              zipf: float = 1.0, seed: int = 0, **replan_args) -> list[DriftStep]:
    """Runs ``steps`` re-plans under a drifting load (see the module docstring); ``replan_args`` go
    to :func:`topology.replan` (its traffic estimate is skipped)."""
    g = torch.Generator().manual_seed(seed)
    popularity_LE = zipf_popularity(layers, experts, zipf, seed=seed)

    def window(k: int) -> torch.Tensor:
        return draw_routes(popularity_LE, tokens, topk, expert_groups=groups, topk_groups=topk_groups,
                           seed=seed * 100_003 + k)

    routes = window(0)
    current = plan(route_load(routes, experts), topology, physical, groups, traffic=None)
    out = []
    for step in range(1, steps + 1):
        load_LE = route_load(routes, experts)
        new = replan(current, load_LE, traffic=None, **replan_args)
        fresh = plan(load_LE, topology, physical, groups, traffic=None)
        popularity_LE = popularity_LE * torch.exp(rate * torch.randn(layers, experts, generator=g,
                                                                     dtype=torch.float64))
        routes = window(step)  # the next window: held out for both plans, the next re-plan's load
        ours, theirs = new.evaluate(routes), fresh.evaluate(routes)
        check = new.replan_check
        out.append(DriftStep(step=step, balance=ours.balance, fresh_balance=theirs.balance,
                             remote=ours.remote_nodes_per_token, fresh_remote=theirs.remote_nodes_per_token,
                             moved=float(check.moved_slots_L.double().mean()) / physical,
                             fresh_moved=float(check.fresh_moved_slots_L.double().mean()) / physical,
                             within=check.within))
        current = new
    return out
