"""Re-planning from measured load while moving few expert weights.

:func:`replan` starts from the current placement, re-weighs its replicas with the new load, and
improves the busiest GPU one move at a time until the layer is within ``tolerance`` of what a
from-scratch ``locality`` plan achieves (max/mean GPU load). Two kinds of move:

* **swap** two replicas between the busiest GPU and another one (up to two weight copies);
* **re-purpose** a replica on the busiest GPU: one of an expert with spare replicas becomes a new
  replica of another expert (one copy; replica counts change, so every GPU holding either expert
  sees its load change, and the move is judged on the whole layer).

A move's cost is the change in expert weights that travel, counted against the *original* placement:
one per (GPU, expert) the GPU did not hold before; moving an expert back where it was is free. Each step takes, if some move brings the busiest GPU to the
target, the cheapest such move; otherwise the move with the best load reduction per copy. Ties lean
towards keeping experts on their group's home node (the node holding most of the group now). The
moves only touch the busiest GPU, so they can stall (an expert turned hot whose spare replicas sit
on cold GPUs); such a layer takes the from-scratch plan's layer.

Shape suffixes: L layers, E experts, P physical experts, G GPUs, X candidate replicas.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .cluster import Topology
from .planner import (
    DEFAULT_EXPERT_BYTES,
    Plan,
    _check_load,
    migration,
    plan,
    plan_from_phy2log,
)
from .traffic import DEFAULT_TRAFFIC, TrafficModel

__all__ = ["replan"]

_LOCALITY_WEIGHT = 1.0  # how much sending load off its home node counts against a move


def replan(
    current: Plan,
    new_load: torch.Tensor,
    topology: Topology | None = None,
    *,
    tolerance: float = 0.02,
    expert_bytes: int = DEFAULT_EXPERT_BYTES,
    traffic: TrafficModel | None = DEFAULT_TRAFFIC,
) -> Plan:
    """A plan for ``new_load`` close to ``current``: each layer's balance within ``tolerance`` of a
    from-scratch plan's. A layer whose moves stop short of that (no move left improves it) takes
    the from-scratch plan's layer instead, at the cost of more weight copies.

    Args:
        current: the plan in use.
        new_load: [L, E] measured load, same layers and experts as ``current``.
        topology: the cluster (default ``current.topology``); must have the same GPUs and nodes.
        tolerance: allowed relative excess of max/mean GPU load over the from-scratch plan's.
        expert_bytes: bytes of one expert's weights, for the migration report.
        traffic: traffic estimate of the new plan (None skips it).

    Returns:
        The new :class:`Plan`; ``plan.migration`` says which slots copy weights from where.
    """
    if not isinstance(current, Plan):
        raise TypeError(f"current: expected a topology.Plan, got {type(current).__name__}")
    load_LE = _check_load(new_load, "new_load")
    if load_LE.shape != current.load_LE.shape:
        raise ValueError(f"new_load: expected shape {tuple(current.load_LE.shape)} like the current plan, got "
                         f"{tuple(load_LE.shape)}")
    topology = current.topology if topology is None else topology
    if not isinstance(topology, Topology):
        raise TypeError(f"topology: expected a topology.Topology, got {type(topology).__name__}")
    if topology.node_of_gpu != current.topology.node_of_gpu:
        raise ValueError(f"topology: expected the current plan's {current.topology.num_nodes} nodes x "
                         f"{current.topology.gpus_per_node} GPUs, got {topology.num_nodes} x {topology.gpus_per_node}")
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
        raise ValueError(f"tolerance: expected a number in [0, 1), got {tolerance!r}")
    reference = plan(load_LE, topology, current.num_physical_experts, current.expert_groups, "locality",
                     traffic=None)
    G, N = topology.num_gpus, topology.num_nodes
    target_L = reference.balance_L * (1 + tolerance) * load_LE.sum(-1) / G
    node_of_gpu_G = np.array(topology.node_of_gpu)
    phy2log_LP = current.phy2log_LP.clone()
    for layer in range(current.num_layers):
        home_E = _home_of_experts(current.phy2log_LP[layer].numpy(), current.expert_groups, node_of_gpu_G,
                                  current.experts_per_gpu, current.num_experts, N)
        moved_P = _replan_layer(current.phy2log_LP[layer].numpy(), load_LE[layer].numpy(), float(target_L[layer]),
                                home_E, node_of_gpu_G, G, N)
        if _max_gpu_load(moved_P, load_LE[layer].numpy(), G) > target_L[layer] * (1 + 1e-9):
            moved_P = reference.phy2log_LP[layer].numpy()  # the moves got stuck (a hot expert short of
            # replicas whose spares sit on cold GPUs): the from-scratch layer, which moves more weights
        phy2log_LP[layer] = torch.from_numpy(moved_P)
    new = plan_from_phy2log(phy2log_LP, load_LE, topology, policy=f"replan({current.policy})",
                            expert_groups=current.expert_groups, traffic=traffic)
    return replace(new, migration=migration(current, new, expert_bytes=expert_bytes))


def _max_gpu_load(phy2log_P: np.ndarray, load_E: np.ndarray, G: int) -> float:
    """The busiest GPU's load: each replica takes an equal share of its expert's."""
    count_E = np.bincount(phy2log_P, minlength=len(load_E))
    share_P = load_E[phy2log_P] / count_E[phy2log_P]
    return float(np.bincount(np.arange(len(phy2log_P)) // (len(phy2log_P) // G), weights=share_P, minlength=G).max())


def _home_of_experts(phy2log_P: np.ndarray, expert_groups: int | None, node_of_gpu_G: np.ndarray,
                     per_gpu: int, E: int, N: int) -> np.ndarray:
    """Node holding the most replicas of each expert's group (lowest node on ties)."""
    size = E // (expert_groups or E)
    node_P = node_of_gpu_G[np.arange(len(phy2log_P)) // per_gpu]
    held_CN = np.zeros((E // size, N))
    np.add.at(held_CN, (phy2log_P // size, node_P), 1)
    return held_CN.argmax(1)[np.arange(E) // size]


def _replan_layer(phy2log_P: np.ndarray, load_E: np.ndarray, target: float, home_E: np.ndarray,
                  node_of_gpu_G: np.ndarray, G: int, N: int) -> np.ndarray:
    P, E = len(phy2log_P), len(load_E)
    per_gpu = P // G
    phy = phy2log_P.copy()
    gpu_P = np.arange(P) // per_gpu
    count_E = np.bincount(phy, minlength=E).astype(np.float64)
    held_EG = np.zeros((E, G))
    np.add.at(held_EG, (phy, gpu_P), 1)
    original_EG = held_EG.copy()

    def gpu_loads() -> np.ndarray:
        return np.bincount(gpu_P, weights=load_E[phy] / count_E[phy], minlength=G)

    def copies_to(e: np.ndarray, g: np.ndarray) -> np.ndarray:
        """+1 where placing e on g makes its weights travel (g holds no copy of e, and held none)."""
        return ((held_EG[e, g] == 0) & (original_EG[e, g] == 0)).astype(np.float64)

    def copies_from(e: np.ndarray, g: np.ndarray) -> np.ndarray:
        """-1 where removing e from g takes away the only copy that travelled there."""
        return -((held_EG[e, g] == 1) & (original_EG[e, g] == 0)).astype(np.float64)

    def off_home(e: np.ndarray, g: np.ndarray) -> np.ndarray:
        return ((node_of_gpu_G[g] != home_E[e]) & (count_E[e] < N)).astype(np.float64)

    load_G = gpu_loads()
    for _ in range(4 * P):
        hi = int(load_G.argmax())
        top = load_G[hi]
        if top <= target * (1 + 1e-12):
            break
        weight_E = load_E / count_E
        a = np.nonzero(gpu_P == hi)[0]
        b = np.nonzero(gpu_P != hi)[0]
        ea, eb, gb = phy[a], phy[b], gpu_P[b]
        candidates = []
        # Swaps: a (on hi) <-> b (on gb).
        shift_AB = weight_E[ea][:, None] - weight_E[eb][None, :]
        new_max_AB = np.maximum(top - shift_AB, load_G[gb][None, :] + shift_AB)
        cost_AB = (copies_from(ea, hi)[:, None] + copies_to(ea[:, None], gb[None, :])
                   + copies_from(eb, gb)[None, :] + copies_to(eb, np.full_like(eb, hi))[None, :])
        off_AB = (weight_E[ea][:, None] * (off_home(ea[:, None], gb[None, :]) - off_home(ea, hi)[:, None])
                  + weight_E[eb][None, :] * (off_home(eb, hi)[None, :] - off_home(eb, gb)[None, :]))
        candidates.append(("swap", top - new_max_AB, cost_AB, off_AB / top, new_max_AB))
        # Re-purpose: replica x (on hi, its expert has spare replicas) becomes one of expert f.
        x = a[count_E[ea] >= 2]
        if len(x):
            ex = phy[x]
            delta_XG = held_EG[ex] * (load_E[ex] / (count_E[ex] - 1) - load_E[ex] / count_E[ex])[:, None]
            delta_XG[:, hi] = ((held_EG[ex, hi] - 1) * load_E[ex] / (count_E[ex] - 1)
                               - held_EG[ex, hi] * load_E[ex] / count_E[ex])
            delta_EG = held_EG * (load_E / (count_E + 1) - load_E / count_E)[:, None]
            delta_EG[:, hi] += load_E / (count_E + 1)
            new_max_XE = (load_G + delta_XG[:, None, :] + delta_EG[None, :, :]).max(-1)
            new_max_XE[np.arange(len(x)), ex] = np.inf
            all_E = np.arange(E)
            cost_XE = copies_from(ex, np.full_like(ex, hi))[:, None] + copies_to(all_E, np.full(E, hi))[None, :]
            off_XE = ((load_E / (count_E + 1) * off_home(all_E, np.full(E, hi)))[None, :]
                      - (weight_E[ex] * off_home(ex, np.full_like(ex, hi)))[:, None])
            candidates.append(("repurpose", top - new_max_XE, cost_XE, off_XE / top, new_max_XE))
        best = None
        for kind, gain, cost, off, new_max in candidates:
            useful = gain > 1e-12 * top
            if not useful.any():
                continue
            reaches = useful & (new_max <= target)
            if reaches.any():
                score = np.where(reaches, -1e6 * cost - 1e3 * _LOCALITY_WEIGHT * off + gain / top, -np.inf)
                rank = (1, score.max())
            else:
                score = np.where(useful, gain / top / np.maximum(cost, 1e-3) - 0.1 * _LOCALITY_WEIGHT * off,
                                 -np.inf)
                rank = (0, score.max())
            i, j = np.unravel_index(int(score.argmax()), score.shape)
            if best is None or rank > best[0]:
                best = (rank, kind, i, j)
        if best is None:
            break
        _, kind, i, j = best
        if kind == "swap":
            pa, pb = a[i], b[j]
            e1, e2, g2 = phy[pa], phy[pb], gpu_P[pb]
            held_EG[e1, hi] -= 1
            held_EG[e2, g2] -= 1
            phy[pa], phy[pb] = e2, e1
            held_EG[e2, hi] += 1
            held_EG[e1, g2] += 1
        else:
            px = x[i]
            e1 = phy[px]
            held_EG[e1, hi] -= 1
            count_E[e1] -= 1
            phy[px] = j
            held_EG[j, hi] += 1
            count_E[j] += 1
        load_G = gpu_loads()
    return phy
