"""Re-planning from measured load while moving few expert weights.

:func:`replan` starts from the current placement, re-weighs its replicas with the new load, and
improves it one move at a time until each layer is as good as a from-scratch ``locality`` plan of
the new load: its busiest GPU within ``tolerance`` of the fresh plan's, and its load placed against
locality within ``locality_tolerance`` of the fresh plan's. Load against locality: a replica of an
expert with fewer replicas than nodes away from its group's home node (the node holding most of the
group now), or, for an expert with at least one replica per node, a second replica on one node
(each node's tokens should find one at home); each counted at the replica's share of the load.

First, replica counts follow the fresh plan's: spare replicas of experts above their fresh count are
re-purposed into experts below it, placed where a fresh plan puts extra replicas (one per node once
an expert has enough, else beside its other replicas). Then, while the busiest GPU is above the
target, a move lowers it:

* **swap** two replicas between the busiest GPU and another one;
* **re-purpose** a replica of an expert with spare replicas, on any GPU, into one more replica of an
  expert of the busiest GPU (replica counts change, so every GPU holding either expert sees its
  load change, and the move is judged on the whole layer): an expert turned hot gets replicas.

It takes the move that reaches the target with the fewest moved slots (then the least locality
lost), else the best load reduction per moved slot; moves that would take locality past its bar
only when nothing else helps. Once balanced, swaps between nodes that keep every GPU at the target
bring load back home until locality meets its bar. A moved slot is one that receives weights from
another GPU, counted against the *original* placement (moving an expert back is free); each layer
moves at most ``max_moved`` of its slots. A layer that falls short within that keeps its moves (or
takes the fresh plan's layer, when that moves no more), and ``Plan.replan_check`` says by how much
and what a full re-plan would move.

Shape suffixes: L layers, E experts, P physical experts, G GPUs, N nodes, X candidate replicas.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .cluster import Topology
from .planner import (
    DEFAULT_EXPERT_BYTES,
    Plan,
    ReplanCheck,
    _check_load,
    migration,
    plan,
    plan_from_phy2log,
)
from .traffic import DEFAULT_TRAFFIC, TrafficModel

__all__ = ["replan"]


def replan(
    current: Plan,
    new_load: torch.Tensor,
    topology: Topology | None = None,
    *,
    tolerance: float = 0.003,
    locality_tolerance: float = 0.01,
    max_moved: float = 0.08,
    expert_bytes: int = DEFAULT_EXPERT_BYTES,
    traffic: TrafficModel | None = DEFAULT_TRAFFIC,
) -> Plan:
    """A plan for ``new_load`` close to ``current``, as good as a from-scratch plan: each layer's
    balance within ``tolerance`` of the fresh plan's and its load placed against locality within
    ``locality_tolerance`` of the fresh plan's, moving at most ``max_moved`` of the slots. A layer
    that cannot get there within that keeps its best moves, or takes the fresh plan's layer when
    that moves no more; ``plan.replan_check`` says how far each layer is and what a full re-plan
    would move.

    Args:
        current: the plan in use.
        new_load: [L, E] measured load, same layers and experts as ``current``.
        topology: the cluster (default ``current.topology``); must have the same GPUs and nodes.
        tolerance: allowed relative excess of max/mean GPU load over the fresh plan's.
        locality_tolerance: allowed relative excess of load away from home (see the module
            docstring) over the fresh plan's (plus 0.2% of the layer's load).
        max_moved: the most slots (a fraction of each layer's) that may receive weights from
            another GPU.
        expert_bytes: bytes of one expert's weights, for the migration report.
        traffic: traffic estimate of the new plan and the fresh one, on the same routes (None
            skips it).

    Returns:
        The new :class:`Plan`; ``plan.migration`` says which slots copy weights from where,
        ``plan.replan_check`` compares it with the fresh plan.
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
    for name, value in (("tolerance", tolerance), ("locality_tolerance", locality_tolerance)):
        if not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise ValueError(f"{name}: expected a number in [0, 1), got {value!r}")
    if not (isinstance(max_moved, (int, float)) and 0 <= max_moved <= 1):
        raise ValueError(f"max_moved: expected a fraction in [0, 1], got {max_moved!r}")
    fresh = plan(load_LE, topology, current.num_physical_experts, current.expert_groups, "locality", traffic=None)
    fresh_moved_L = migration(current, fresh).moved_LP.sum(-1)
    G, N, P = topology.num_gpus, topology.num_nodes, current.num_physical_experts
    budget = int(max_moved * P)
    target_L = fresh.balance_L * (1 + tolerance) * load_LE.sum(-1) / G
    node_of_gpu_G = np.array(topology.node_of_gpu)
    node_P = node_of_gpu_G[np.arange(P) // current.experts_per_gpu]
    phy2log_LP = current.phy2log_LP.clone()
    off_L, fresh_off_L = torch.zeros(current.num_layers), torch.zeros(current.num_layers)
    for layer in range(current.num_layers):
        load_E = load_LE[layer].numpy()
        home_E, fresh_home_E = (_home_of_experts(p.phy2log_LP[layer].numpy(), current.expert_groups, node_of_gpu_G,
                                                 current.experts_per_gpu, current.num_experts, N)
                                for p in (current, fresh))
        fresh_off_L[layer] = _off_home(fresh.phy2log_LP[layer].numpy(), load_E, fresh_home_E, node_P, N)
        off_target = float(fresh_off_L[layer]) * (1 + locality_tolerance) + 0.002 * float(load_E.sum())
        old_P = current.phy2log_LP[layer].numpy()
        start_P, used = _match_counts(old_P, load_E, fresh.replica_counts_LE[layer].numpy(), node_of_gpu_G, G, N,
                                      budget)
        moved_P = _replan_layer(old_P, load_E, float(target_L[layer]), off_target,
                                budget, home_E, node_of_gpu_G, G, N, start_P=start_P, used=used)
        off_L[layer] = _off_home(moved_P, load_E, home_E, node_P, N)
        short = (_max_gpu_load(moved_P, load_E, G) > target_L[layer] * (1 + 1e-9)
                 or off_L[layer] > off_target * (1 + 1e-9))
        if short and int(fresh_moved_L[layer]) <= budget:
            moved_P, off_L[layer] = fresh.phy2log_LP[layer].numpy(), fresh_off_L[layer]
        phy2log_LP[layer] = torch.from_numpy(moved_P)
    new = plan_from_phy2log(phy2log_LP, load_LE, topology, policy=f"replan({current.policy})",
                            expert_groups=current.expert_groups, traffic=traffic)
    fresh_traffic = (None if traffic is None else
                     plan_from_phy2log(fresh.phy2log_LP, load_LE, topology, expert_groups=current.expert_groups,
                                       traffic=traffic).traffic)
    moves = migration(current, new, expert_bytes=expert_bytes)
    total_L = load_LE.sum(-1).clamp(min=1e-300)
    check = ReplanCheck(balance_L=new.balance_L, fresh_balance_L=fresh.balance_L, off_home_L=off_L.double() / total_L,
                        fresh_off_home_L=fresh_off_L.double() / total_L,
                        remote_nodes=None if traffic is None else new.traffic.remote_nodes_per_token,
                        fresh_remote_nodes=None if fresh_traffic is None else fresh_traffic.remote_nodes_per_token,
                        moved_slots_L=moves.moved_LP.sum(-1), fresh_moved_slots_L=fresh_moved_L,
                        num_physical_experts=P, tolerance=tolerance, locality_tolerance=locality_tolerance,
                        max_moved=max_moved)
    return replace(new, migration=moves, replan_check=check)


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


def _off_home(phy2log_P: np.ndarray, load_E: np.ndarray, home_E: np.ndarray, node_P: np.ndarray, N: int) -> float:
    """Load placed against locality: a replica of an expert with fewer replicas than nodes off its home
    node, or a second replica of an expert with at least one per node on one node (its share)."""
    E = len(load_E)
    count_E = np.bincount(phy2log_P, minlength=E)
    held_EN = np.zeros((E, N))
    np.add.at(held_EN, (phy2log_P, node_P), 1)
    weight_E = load_E / np.maximum(count_E, 1)
    away_E = np.where(count_E < N, count_E - held_EN[np.arange(E), home_E], np.maximum(held_EN - 1, 0).sum(1))
    return float((weight_E * away_E).sum())


def _replan_layer(phy2log_P: np.ndarray, load_E: np.ndarray, target: float, off_target: float, budget: int,
                  home_E: np.ndarray, node_of_gpu_G: np.ndarray, G: int, N: int, *, start_P: np.ndarray,
                  used: int) -> np.ndarray:
    """Moves of one layer (see the module docstring), at most ``budget`` slots moved."""
    P, E = len(phy2log_P), len(load_E)
    per_gpu = P // G
    phy = start_P.copy()
    gpu_P = np.arange(P) // per_gpu
    node_P = node_of_gpu_G[gpu_P]
    count_E = np.bincount(phy, minlength=E).astype(np.float64)
    held_EN = np.zeros((E, N))
    np.add.at(held_EN, (phy, node_P), 1)
    new_EG = np.zeros((E, G), dtype=bool)  # where an expert would be a moved slot: not there before
    new_EG[:] = True
    new_EG[phy2log_P, gpu_P] = False
    total = float(load_E.sum()) or 1.0

    def moved(e: np.ndarray, g: np.ndarray) -> np.ndarray:
        return new_EG[e, g].astype(np.float64)

    def away(e: np.ndarray, n: np.ndarray, leaving: bool) -> np.ndarray:
        """Locality cost of one replica of e on node n (as it is there now when leaving, else arriving)."""
        spread = count_E[e] >= N
        crowded = held_EN[e, n] >= (2 if leaving else 1)
        return (load_E[e] / count_E[e]) * np.where(spread, crowded, n != home_E[e])

    load_G = np.bincount(gpu_P, weights=load_E[phy] / count_E[phy], minlength=G)
    off = _off_home(phy, load_E, home_E, node_P, N)
    for _ in range(4 * P):
        hi = int(load_G.argmax())
        top = load_G[hi]
        balanced = top <= target * (1 + 1e-12)
        if balanced and off <= off_target * (1 + 1e-9):
            break
        weight_E = load_E / count_E
        if balanced:  # locality repair: swaps across nodes that keep every GPU at the target
            ea, eb = phy[:, None], phy[None, :]
            na, nb = node_P[:, None], node_P[None, :]
            shift = weight_E[ea] - weight_E[eb]
            fits = ((load_G[gpu_P][:, None] - shift <= target) & (load_G[gpu_P][None, :] + shift <= target)
                    & (na != nb) & (ea != eb))
            cost = (moved(ea, gpu_P[None, :]) + moved(eb, gpu_P[:, None]) - moved(ea, gpu_P[:, None])
                    - moved(eb, gpu_P[None, :]))
            gain = (away(ea, na, True) + away(eb, nb, True) - away(ea, nb, False) - away(eb, na, False))
            ok = fits & (gain > 1e-12 * total) & (used + cost <= budget)
            if not ok.any():
                break
            i, j = np.unravel_index(int(np.where(ok, gain / np.maximum(cost, 0.5), -np.inf).argmax()), ok.shape)
            move = ("swap", i, j)
        else:
            move = _balance_move(phy, gpu_P, node_P, hi, top, load_G, weight_E, load_E, count_E, held_EN,
                                 target, off, off_target, budget - used, moved, away, E)
            if move is None:
                break
        used += _apply(move, phy, gpu_P, node_P, count_E, held_EN, new_EG)
        load_G = np.bincount(gpu_P, weights=load_E[phy] / count_E[phy], minlength=G)
        off = _off_home(phy, load_E, home_E, node_P, N)
    return phy


def _match_counts(phy2log_P: np.ndarray, load_E: np.ndarray, fresh_count_E: np.ndarray, node_of_gpu_G: np.ndarray,
                  G: int, N: int, budget: int) -> tuple[np.ndarray, int]:
    """Re-purposes replicas of experts with more than the fresh plan's replica count into experts with
    fewer (the one whose replicas shed the most load first), placed as a fresh plan places extra
    replicas: on a node that lacks the expert once it has a replica per node (every node's tokens then
    find it at home), else beside its other replicas; there on the GPU left least loaded. Replica
    counts that lag the load cost locality step by step (remote nodes per token drift up by 5% in 40
    re-plans when counts only change to balance the busiest GPU). Returns the new placement and its
    moved slots (at most half of ``budget``; the rest is left to balancing)."""
    phy = phy2log_P.copy()
    P, E = len(phy), len(load_E)
    gpu_P = np.arange(P) // (P // G)
    node_P = node_of_gpu_G[gpu_P]
    count_E = np.bincount(phy, minlength=E)
    used = 0
    while used < budget // 2:  # the other half balances: counts of noisy loads could take it all
        need_E = fresh_count_E - count_E
        if not (need_E > 0).any():
            break
        gain_E = np.where(need_E > 0, load_E / count_E - load_E / (count_E + 1), -np.inf)
        f = int(gain_E.argmax())
        spare_P = (count_E[phy] > np.maximum(fresh_count_E[phy], 1)) & (phy != f)
        if not spare_P.any():
            break
        load_G = np.bincount(gpu_P, weights=load_E[phy] / count_E[phy], minlength=G)
        holds_N = np.bincount(node_P[phy == f], minlength=N) > 0
        # As a fresh plan places extra replicas: one per node once there are enough, else beside the others.
        avoid_N = holds_N if count_E[f] + 1 >= N else ~holds_N
        after_P = load_G[gpu_P] - load_E[phy] / count_E[phy] + load_E[f] / (count_E[f] + 1)
        on_gpu_G = np.bincount(gpu_P[phy == f], minlength=G) > 0  # a second replica on one GPU is wasted
        penalty_P = np.where(avoid_N[node_P], 10.0, 0.0) + np.where(on_gpu_G[gpu_P], 1.0, 0.0)
        score_P = np.where(spare_P, after_P + penalty_P * load_E.sum(), np.inf)
        x = int(score_P.argmin())
        count_E[phy[x]] -= 1
        phy[x] = f
        count_E[f] += 1
        used += 1
    return phy, used


def _balance_move(phy, gpu_P, node_P, hi, top, load_G, weight_E, load_E, count_E, held_EN, target, off,
                  off_target, budget_left, moved, away, E):
    """The move that lowers the busiest GPU ``hi``: one that reaches the target with the fewest moved
    slots (then the least locality lost), else the best load reduction per moved slot; moves that
    would take locality past ``off_target`` only when no other move helps. None when none helps."""
    a = np.nonzero(gpu_P == hi)[0]
    b = np.nonzero(gpu_P != hi)[0]
    ea, eb, gb = phy[a], phy[b], gpu_P[b]
    n_hi = node_P[a[0]]
    nb = node_P[b]
    hi_A = np.full_like(ea, hi)
    candidates = []
    # Swaps: a (on hi) <-> b (on gb).
    shift = weight_E[ea][:, None] - weight_E[eb][None, :]
    new_max = np.maximum(top - shift, load_G[gb][None, :] + shift)
    cost = (moved(ea[:, None], gb[None, :]) - moved(ea, hi_A)[:, None]
            + moved(eb, np.full_like(eb, hi))[None, :] - moved(eb, gb)[None, :])
    same_node = nb[None, :] == n_hi
    lost = np.where(same_node, 0.0, away(ea[:, None], nb[None, :], False) - away(ea, np.full_like(ea, n_hi), True)[:, None]
                    + away(eb, np.full_like(eb, n_hi), False)[None, :] - away(eb, nb, True)[None, :])
    candidates.append((("swap", a, b), new_max, cost, lost))
    # Re-purpose: replica x (of an expert with spare replicas, on any GPU) becomes one more of an
    # expert f of the busiest GPU, which then sheds part of f's load.
    x = np.nonzero(count_E[phy] >= 2)[0]
    f = np.unique(ea)
    if len(x):
        ex, gx = phy[x], gpu_P[x]
        held_EG = np.zeros((E, len(load_G)))
        np.add.at(held_EG, (phy, gpu_P), 1)
        delta_XG = held_EG[ex] * (load_E[ex] / (count_E[ex] - 1) - load_E[ex] / count_E[ex])[:, None]
        delta_XG[np.arange(len(x)), gx] -= load_E[ex] / (count_E[ex] - 1)
        delta_FG = held_EG[f] * (load_E[f] / (count_E[f] + 1) - load_E[f] / count_E[f])[:, None]
        new_XFG = load_G + delta_XG[:, None, :] + delta_FG[None, :, :]
        new_XFG[np.arange(len(x))[:, None], np.arange(len(f))[None, :], gx[:, None]] += load_E[f] / (count_E[f] + 1)
        new_max_XF = np.where(ex[:, None] == f[None, :], np.inf, new_XFG.max(-1))
        cost_XF = moved(f[None, :], gx[:, None]) - moved(ex, gx)[:, None]
        lost_XF = (away(f[None, :], node_P[x][:, None], False) * (count_E[f] / (count_E[f] + 1))[None, :]
                   - away(ex, node_P[x], True)[:, None])
        candidates.append((("repurpose", x, f), new_max_XF, cost_XF, lost_XF))
    best = None
    for where, new_max_, cost_, lost_ in candidates:
        useful = (new_max_ < top * (1 - 1e-12)) & (cost_ <= budget_left)
        keeps = useful & (off + lost_ <= max(off, off_target) * (1 + 1e-9))
        for tier, ok in ((2, keeps & (new_max_ <= target)), (1, keeps), (0, useful)):
            if not ok.any():
                continue
            gain = (top - new_max_) / top
            if tier == 2:
                score = np.where(ok, -1e6 * cost_ - 1e3 * lost_ / top + gain, -np.inf)
            else:
                score = np.where(ok, gain / np.maximum(cost_, 0.5) - 0.1 * lost_ / top, -np.inf)
            i, j = np.unravel_index(int(score.argmax()), score.shape)
            rank = (tier, float(score[i, j]))
            if best is None or rank > best[0]:
                best = (rank, (where[0], int(where[1][i]), int(where[2][j])))
            break
    return None if best is None else best[1]


def _apply(move, phy, gpu_P, node_P, count_E, held_EN, new_EG) -> int:
    """Applies a move in place; returns the change in moved slots."""
    kind, i, j = move
    if kind == "swap":
        e1, e2 = phy[i], phy[j]
        delta = (int(new_EG[e1, gpu_P[j]]) + int(new_EG[e2, gpu_P[i]]) - int(new_EG[e1, gpu_P[i]])
                 - int(new_EG[e2, gpu_P[j]]))
        held_EN[e1, node_P[i]] -= 1
        held_EN[e2, node_P[j]] -= 1
        phy[i], phy[j] = e2, e1
        held_EN[e2, node_P[i]] += 1
        held_EN[e1, node_P[j]] += 1
        return delta
    e1 = phy[i]
    delta = int(new_EG[j, gpu_P[i]]) - int(new_EG[e1, gpu_P[i]])
    held_EN[e1, node_P[i]] -= 1
    count_E[e1] -= 1
    phy[i] = j
    held_EN[j, node_P[i]] += 1
    count_E[j] += 1
    return delta
