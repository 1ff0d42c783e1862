"""The ``locality`` policy: EPLB-global balance with traffic kept inside nodes.

Four phases per layer (see ``topology/README.md`` for the picture):

1. **Replicas.** Replica counts as EPLB's global policy picks them (every expert once, then each extra
   slot to the expert whose replicas are heaviest), unless stopping that a few slots early provably
   packs better (:func:`topology.packing.replicate_packable`: 36 equal hot replicas on 32 GPUs put two
   on four GPUs). A replica of ``e`` carries ``v_e = load_e / count_e`` (the replica rule of
   :mod:`topology.routing` keeps replicas equally loaded).
2. **Homes.** Whole expert groups are packed onto nodes (heaviest group first, onto the lightest node
   with room), so a token's group-limited routes meet few nodes. Each expert's first replica goes to
   its group's home node.
3. **Extra replicas and node balance.** Extra replicas, heaviest first, fill the free slots: an expert
   with at least one replica per node spreads over nodes (each node's tokens then stay local); any
   other stays on nodes that already hold it; among those the lightest node, unless another node is
   lighter by more than a small tolerance. Then pairs of replicas are swapped between the heaviest and
   the lightest node until node loads agree to 0.05%, picking among the swaps that close the gap
   (nearly) best the one that sends the least load away from its home.
4. **GPUs.** Inside each node: longest-processing-time packing onto its GPUs (equal counts), then
   swaps that lower the node's heaviest GPU until none does. Last, swaps between the busiest GPU and
   any other GPU, across nodes, while the busiest is more than 0.1% above a packing lower bound (this
   matters with few replicas per GPU, where node loads can agree while their GPUs cannot pack evenly);
   among the swaps that lower it at least half as much as the best, the one that sends the least load
   away from home. Two replicas of one expert on one GPU (a wasted slot) are split up by a swap when
   one exists that makes the busiest GPU at most 0.05% (of the mean) busier.

Shape suffixes: L layers, E logical experts, P physical experts, G GPUs, N nodes, C expert groups,
I items (replicas) of one layer.
"""

from __future__ import annotations

import numpy as np
import torch

from .cluster import Topology
from .packing import pack_equal, replicate_packable

__all__ = ["home_nodes", "locality_policy"]

_SPREAD_TOLERANCE = 0.002  # node-load slack (fraction of a node's fair share) for keeping a preference
_NODE_GAP = 0.0005  # stop balancing nodes when heaviest and lightest differ by this fraction
_EXTRA_REPLICA_COST = 0.3  # moving an extra replica off its node costs this much of a first replica
_DUPLICATE_SLACK = 0.0005  # load (fraction of the mean GPU) that splitting a same-GPU pair may add


def home_nodes(load_LE: torch.Tensor, topology: Topology, num_physical: int, expert_groups: int | None) -> torch.Tensor:
    """Home node of every expert: whole groups packed onto nodes, balancing group load.

    Without groups every expert is its own group. When the nodes divide the groups, each node gets the
    same number of groups (EPLB's group packing); otherwise groups go heaviest first onto the lightest
    node with room for the whole group, experts one by one when no node has.

    Returns home_LE (int64).
    """
    L, E = load_LE.shape
    N = topology.num_nodes
    C = expert_groups or E
    size = E // C
    group_load_LC = load_LE.double().view(L, C, size).sum(-1)
    if C % N == 0:
        node_LC, _ = pack_equal(group_load_LC, N)
        return node_LC.repeat_interleave(size, dim=1)
    slots = num_physical // N
    home_LE = torch.empty(L, E, dtype=torch.int64)
    for layer in range(L):
        g_load = group_load_LC[layer].numpy()
        e_load = load_LE[layer].double().numpy()
        node_load = np.zeros(N)
        free = np.full(N, slots)
        home = np.empty(E, dtype=np.int64)
        for c in np.argsort(-g_load, kind="stable"):
            fits = np.nonzero(free >= size)[0]
            if len(fits):
                n = fits[node_load[fits].argmin()]
                home[c * size:(c + 1) * size] = n
                node_load[n] += g_load[c]
                free[n] -= size
                continue
            for e in range(c * size, (c + 1) * size):
                room = np.nonzero(free > 0)[0]
                n = room[node_load[room].argmin()]
                home[e] = n
                node_load[n] += e_load[e]
                free[n] -= 1
        home_LE[layer] = torch.from_numpy(home)
    return home_LE


def locality_policy(load_LE: torch.Tensor, topology: Topology, num_physical: int,
                    expert_groups: int | None) -> torch.Tensor:
    """Places replicas for balance first and node-local traffic second; returns phy2log_LP."""
    L, E = load_LE.shape
    N, G = topology.num_nodes, topology.num_gpus
    slots = num_physical // N
    per_gpu = num_physical // G
    counts_LE = replicate_packable(load_LE, num_physical, G)
    home_LE = home_nodes(load_LE, topology, num_physical, expert_groups)
    weight_LE = (load_LE.double() / counts_LE).numpy()
    counts_np = counts_LE.numpy()
    home_np = home_LE.numpy()
    # Phases 2-3, per layer: the replicas of each node; [L, P] expert ids, node-major.
    expert_LI, node_LI = _nodes_of_replicas(weight_LE, counts_np, home_np, N, slots)
    fair_L = (weight_LE * counts_np).sum(-1) / N
    for layer in range(L):
        _balance_nodes(expert_LI[layer], node_LI[layer], weight_LE[layer], home_np[layer], E, N, float(fair_L[layer]))
    expert_LI = np.take_along_axis(expert_LI, np.argsort(node_LI, axis=-1, kind="stable"), -1)
    # Phase 4, all layers and nodes at once: longest-processing-time onto each node's GPUs.
    weight_LI = np.take_along_axis(weight_LE, expert_LI, 1)
    gpu_in_node_BS, _ = pack_equal(torch.from_numpy(weight_LI).view(L * N, slots), topology.gpus_per_node)
    gpus_of_node_NK = np.array(topology.gpus_of_node)
    gpu_LI = gpus_of_node_NK[np.arange(N)[:, None], gpu_in_node_BS.view(L, N, slots).numpy()].reshape(L, -1)
    node_of_gpu_G = np.array(topology.node_of_gpu)
    phy2log_LP = torch.empty(L, num_physical, dtype=torch.int64)
    for layer in range(L):
        gpu_I, weight_I = gpu_LI[layer], weight_LI[layer]
        for n in range(N):
            _refine_node(gpu_I, weight_I, slice(n * slots, (n + 1) * slots), gpus_of_node_NK[n])
        if N > 1:
            _swap_across_nodes(gpu_I, weight_I, home_np[layer][expert_LI[layer]], node_of_gpu_G, G, per_gpu)
        _separate_duplicates(gpu_I, weight_I, expert_LI[layer], node_of_gpu_G, G)
        order_I = np.lexsort((expert_LI[layer], gpu_I))  # by GPU, experts ascending inside a GPU
        phy2log_LP[layer] = torch.from_numpy(expert_LI[layer][order_I])
    return phy2log_LP


def _separate_duplicates(gpu_I: np.ndarray, weight_I: np.ndarray, expert_I: np.ndarray, node_of_gpu_G: np.ndarray,
                         G: int) -> None:
    """Phase 4c: two replicas of one expert on one GPU waste a slot; swap one of them with a replica
    elsewhere (same node first, then the smallest load change) when no GPU then exceeds the busiest
    GPU's load by more than 0.05% of the mean (updates gpu_I)."""
    held_GE = np.zeros((G, int(expert_I.max()) + 1), dtype=np.int64)
    np.add.at(held_GE, (gpu_I, expert_I), 1)
    if held_GE.max() < 2:
        return
    load_G = np.bincount(gpu_I, weights=weight_I, minlength=G)
    ceiling = load_G.max() + _DUPLICATE_SLACK * load_G.mean()
    for i in range(len(gpu_I)):
        g, e = int(gpu_I[i]), int(expert_I[i])
        if held_GE[g, e] < 2:
            continue
        shift_J = weight_I[i] - weight_I  # what GPU gpu_I[j] gains by taking item i for item j
        fits_J = ((gpu_I != g) & (held_GE[gpu_I, e] == 0) & (held_GE[g, expert_I] == 0)
                  & (load_G[gpu_I] + shift_J <= ceiling) & (load_G[g] - shift_J <= ceiling))
        if not fits_J.any():
            continue
        far_J = node_of_gpu_G[gpu_I] != node_of_gpu_G[g]
        j = int(np.where(fits_J, far_J * (1.0 + 2 * ceiling) + np.abs(shift_J), np.inf).argmin())
        k, x = int(gpu_I[j]), int(expert_I[j])
        held_GE[g, e] -= 1
        held_GE[k, e] += 1
        held_GE[k, x] -= 1
        held_GE[g, x] += 1
        gpu_I[i], gpu_I[j] = k, g
        load_G[k] += shift_J[j]
        load_G[g] -= shift_J[j]


def _nodes_of_replicas(weight_LE: np.ndarray, counts_LE: np.ndarray, home_LE: np.ndarray, N: int,
                       slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Phases 2 and 3a, all layers at once: (expert_LI, node_LI) of every replica, first replicas
    (at home) then the extra ones, heaviest first."""
    L, E = weight_LE.shape
    rows_L = np.arange(L)
    fair_L = (weight_LE * counts_LE).sum(-1) / N
    # Phase 2: first replicas at home.
    node_load_LN = np.zeros((L, N))
    np.add.at(node_load_LN, (rows_L[:, None], home_LE), weight_LE)
    fill_LN = np.zeros((L, N), dtype=np.int64)
    np.add.at(fill_LN, (rows_L[:, None], home_LE), 1)
    holds_LEN = np.zeros((L, E, N), dtype=bool)
    holds_LEN[rows_L[:, None], np.arange(E), home_LE] = True
    # Phase 3a: extra replicas, heaviest first (every layer has as many).
    extra_LX = np.stack([np.repeat(np.arange(E), counts_LE[layer] - 1) for layer in range(L)])
    extra_LX = np.take_along_axis(extra_LX, np.argsort(-np.take_along_axis(weight_LE, extra_LX, 1), axis=-1,
                                                       kind="stable"), 1)
    node_LX = np.empty_like(extra_LX)
    slack_L1 = (_SPREAD_TOLERANCE * fair_L)[:, None]
    for x in range(extra_LX.shape[1]):
        e_L = extra_LX[:, x]
        room_LN = fill_LN < slots
        load_LN = np.where(room_LN, node_load_LN, np.inf)
        spread_L1 = (counts_LE[rows_L, e_L] >= N)[:, None]
        preferred_LN = room_LN & (holds_LEN[rows_L, e_L] != spread_L1) & (node_load_LN <= load_LN.min(-1, keepdims=True)
                                                                          + slack_L1)
        n_L = np.where(preferred_LN.any(-1, keepdims=True) & ~preferred_LN, np.inf, load_LN).argmin(-1)
        node_LX[:, x] = n_L
        node_load_LN[rows_L, n_L] += weight_LE[rows_L, e_L]
        fill_LN[rows_L, n_L] += 1
        holds_LEN[rows_L, e_L, n_L] = True
    expert_LI = np.concatenate([np.broadcast_to(np.arange(E), (L, E)), extra_LX], 1)
    return expert_LI, np.concatenate([home_LE, node_LX], 1)


def _refine_node(gpu_I: np.ndarray, weight_I: np.ndarray, items: slice, gpus: np.ndarray) -> None:
    """Phase 4a: swaps inside one node that lower its busiest GPU, until none does (updates gpu_I)."""
    if len(gpus) == 1 or (items.stop - items.start) == len(gpus):
        return
    gpu_S, weight_S = gpu_I[items], weight_I[items]  # a view: swaps write through
    local_S = np.searchsorted(gpus, gpu_S)
    load_K = np.bincount(local_S, weights=weight_S, minlength=len(gpus))
    for _ in range(4 * len(weight_S)):
        hi = int(load_K.argmax())
        a = np.nonzero(local_S == hi)[0]
        b = np.nonzero(local_S != hi)[0]
        shift_AB = weight_S[a][:, None] - weight_S[b][None, :]
        gain_AB = load_K[hi] - np.maximum(load_K[hi] - shift_AB, load_K[local_S[b]][None, :] + shift_AB)
        i, j = np.unravel_index(int(gain_AB.argmax()), gain_AB.shape)
        if gain_AB[i, j] <= 1e-12 * load_K[hi]:
            break
        k = local_S[b[j]]
        local_S[a[i]], local_S[b[j]] = k, hi
        load_K[hi] -= shift_AB[i, j]
        load_K[k] += shift_AB[i, j]
    gpu_S[:] = gpus[local_S]


def _swap_across_nodes(gpu_I: np.ndarray, weight_I: np.ndarray, home_I: np.ndarray, node_of_gpu_G: np.ndarray,
                       G: int, per_gpu: int) -> None:
    """Phase 4b: swaps between the busiest GPU and any other, until the busiest is within 0.1% of the
    mean or of a packing lower bound, or no swap lowers it. Among the swaps that lower it at least half
    as much as the best one, the one sending the least load away from its home node (updates gpu_I)."""
    load_G = np.bincount(gpu_I, weights=weight_I, minlength=G)
    w_desc = np.sort(weight_I)[::-1]
    csum = np.concatenate([[0.0], np.cumsum(w_desc)])
    P = len(weight_I)
    bound = load_G.mean()
    for m in range(per_gpu):  # the bound of topology.packing.packing_lower_bound
        top, rest = m * G + 1, per_gpu - m - 1
        if top <= P:
            bound = max(bound, csum[top] - csum[top - m - 1] + csum[P] - csum[P - rest])
    target = max(bound, load_G.mean()) * (1 + 1e-3)
    for _ in range(4 * P):
        hi = int(load_G.argmax())
        if load_G[hi] <= target:
            break
        a = np.nonzero(gpu_I == hi)[0]
        b = np.nonzero(gpu_I != hi)[0]
        shift_AB = weight_I[a][:, None] - weight_I[b][None, :]
        gain_AB = load_G[hi] - np.maximum(load_G[hi] - shift_AB, load_G[gpu_I[b]][None, :] + shift_AB)
        best = gain_AB.max()
        if best <= 1e-12 * load_G[hi]:
            break
        node_a, node_b = node_of_gpu_G[hi], node_of_gpu_G[gpu_I[b]]
        leave_AB = (weight_I[a][:, None] * ((node_b[None, :] != home_I[a][:, None]).astype(float)
                                            - (node_a != home_I[a]).astype(float)[:, None])
                    + weight_I[b][None, :] * ((node_a != home_I[b]).astype(float)
                                              - (node_b != home_I[b]).astype(float))[None, :])
        score_AB = np.where(gain_AB >= 0.5 * best, leave_AB, np.inf)
        i, j = np.unravel_index(int(score_AB.argmin()), score_AB.shape)
        k = gpu_I[b[j]]
        gpu_I[a[i]], gpu_I[b[j]] = k, hi
        load_G[hi] -= shift_AB[i, j]
        load_G[k] += shift_AB[i, j]


def _balance_nodes(expert_I: np.ndarray, node_I: np.ndarray, weight_E: np.ndarray, home_E: np.ndarray,
                   E: int, N: int, fair: float) -> None:
    """Phase 3b: swaps between the heaviest and lightest node (updates node_I in place)."""
    if N == 1 or fair <= 0:
        return
    weight_I = weight_E[expert_I]
    cost_I = weight_I * np.where(np.arange(len(expert_I)) < E, 1.0, _EXTRA_REPLICA_COST)
    home_I = home_E[expert_I]
    node_load_N = np.bincount(node_I, weights=weight_I, minlength=N)
    for _ in range(8 * N + 64):
        heavy, light = int(node_load_N.argmax()), int(node_load_N.argmin())
        half_gap = (node_load_N[heavy] - node_load_N[light]) / 2
        if half_gap <= _NODE_GAP * fair / 2:
            break
        a = np.nonzero(node_I == heavy)[0]
        b = np.nonzero(node_I == light)[0]
        shift_AB = weight_I[a][:, None] - weight_I[b][None, :]
        gain_AB = half_gap - np.abs(half_gap - shift_AB)
        useful_AB = (shift_AB > 0) & (gain_AB > 0)
        if not useful_AB.any():
            break
        near_best_AB = useful_AB & (gain_AB >= gain_AB[useful_AB].max() - _NODE_GAP * fair / 2)
        # Cost of the traffic: load leaving home costs, load returning home earns.
        leave_A = np.where(home_I[a] == light, -cost_I[a], cost_I[a])
        leave_B = np.where(home_I[b] == heavy, -cost_I[b], cost_I[b])
        score_AB = np.where(near_best_AB, leave_A[:, None] + leave_B[None, :], np.inf)
        i, j = np.unravel_index(int(score_AB.argmin()), score_AB.shape)
        node_I[a[i]], node_I[b[j]] = light, heavy
        node_load_N[heavy] -= shift_AB[i, j]
        node_load_N[light] += shift_AB[i, j]
