"""Baseline placement policies: DeepSeek's EPLB global and hierarchical policies (our own
implementation of the published algorithm), a plain greedy one, and no replication.

Every policy maps ``load_LE`` to ``phy2log_LP``: physical expert ``p`` lives on GPU ``p // (P / G)``.

Shape suffixes: L layers, E logical experts, P physical experts, G GPUs, N nodes, C expert groups.
"""

from __future__ import annotations

import torch

from .cluster import Topology
from .packing import expand_replicas, pack_equal, replicate_greedy

__all__ = ["eplb_global", "eplb_hierarchical", "greedy", "no_replication"]


def _lay_out(expert_BP: torch.Tensor, gpu_BP: torch.Tensor, slot_BP: torch.Tensor, per_gpu: int) -> torch.Tensor:
    """phy2log from each replica's GPU and slot on that GPU."""
    phy2log_BP = torch.empty_like(expert_BP)
    phy2log_BP.scatter_(1, gpu_BP * per_gpu + slot_BP, expert_BP)
    return phy2log_BP


def eplb_global(load_LE: torch.Tensor, topology: Topology, num_physical: int) -> torch.Tensor:
    """EPLB's global policy: replicate the heaviest replicas one at a time over the whole cluster,
    then pack all replicas onto all GPUs by longest-processing-time with equal counts per GPU.
    Node boundaries and expert groups are ignored."""
    G = topology.num_gpus
    counts_LE = replicate_greedy(load_LE, num_physical)
    expert_LP, _ = expand_replicas(counts_LE)
    weight_LP = (load_LE.double() / counts_LE).gather(-1, expert_LP)
    gpu_LP, slot_LP = pack_equal(weight_LP, G)
    return _lay_out(expert_LP, gpu_LP, slot_LP, num_physical // G)


def eplb_hierarchical(load_LE: torch.Tensor, topology: Topology, num_physical: int, expert_groups: int) -> torch.Tensor:
    """EPLB's hierarchical policy, for group-limited routing when the nodes divide the groups:

    1. pack whole expert groups onto nodes, the same number per node, balancing group load;
    2. inside each node, replicate its experts into the node's ``P / N`` slots (heaviest replica first);
    3. pack each node's replicas onto its GPUs (longest-processing-time, equal counts).
    """
    L, E = load_LE.shape
    N, G = topology.num_nodes, topology.num_gpus
    C = expert_groups
    if C % N:
        raise ValueError(f"expert_groups: the hierarchical policy needs a multiple of the {N} nodes, got {C}")
    group_size = E // C
    groups_per_node = C // N
    experts_per_node = E // N
    slots_per_node = num_physical // N
    gpus_per_node = topology.gpus_per_node
    per_gpu = num_physical // G
    load_LE = load_LE.double()
    # 1. groups -> nodes; node-major expert order (node, rank of the group in the node, expert in group)
    node_LC, rank_LC = pack_equal(load_LE.view(L, C, group_size).sum(-1), N)
    position_LC = node_LC * groups_per_node + rank_LC
    position_LE = (position_LC.unsqueeze(-1) * group_size + torch.arange(group_size)).view(L, E)
    expert_at_LE = torch.empty_like(position_LE).scatter_(1, position_LE, torch.arange(E).expand(L, E))
    # 2. replicate inside each node: [L * N, experts of the node]
    load_BM = load_LE.gather(1, expert_at_LE).view(L * N, experts_per_node)
    counts_BM = replicate_greedy(load_BM, slots_per_node)
    local_BS, _ = expand_replicas(counts_BM)
    weight_BS = (load_BM / counts_BM).gather(-1, local_BS)
    # 3. replicas -> GPUs of the node
    gpu_in_node_BS, slot_BS = pack_equal(weight_BS, gpus_per_node)
    expert_BS = expert_at_LE.view(L * N, experts_per_node).gather(1, local_BS)
    gpus_of_node_NK = torch.tensor(topology.gpus_of_node)
    node_B = torch.arange(N).repeat(L)
    gpu_BS = gpus_of_node_NK[node_B.unsqueeze(-1), gpu_in_node_BS]
    return _lay_out(expert_BS.view(L, num_physical), gpu_BS.view(L, num_physical),
                    slot_BS.view(L, num_physical), per_gpu)


def greedy(load_LE: torch.Tensor, topology: Topology, num_physical: int) -> torch.Tensor:
    """Plain greedy: the same replica counts as EPLB's global policy, but each replica is placed in
    expert-id order (not heaviest first) on the least-loaded GPU that still has room."""
    L = load_LE.shape[0]
    G = topology.num_gpus
    per_gpu = num_physical // G
    counts_LE = replicate_greedy(load_LE, num_physical)
    expert_LP, _ = expand_replicas(counts_LE)
    weight_LP = (load_LE.double() / counts_LE).gather(-1, expert_LP)
    gpu_LP = torch.empty_like(expert_LP)
    slot_LP = torch.empty_like(expert_LP)
    load_LG = torch.zeros(L, G, dtype=torch.float64)
    fill_LG = torch.zeros(L, G, dtype=torch.int64)
    rows_L = torch.arange(L)
    for p in range(num_physical):
        g_L = torch.where(fill_LG < per_gpu, load_LG, float("inf")).argmin(-1)
        gpu_LP[:, p] = g_L
        slot_LP[:, p] = fill_LG[rows_L, g_L]
        load_LG[rows_L, g_L] += weight_LP[:, p]
        fill_LG[rows_L, g_L] += 1
    return _lay_out(expert_LP, gpu_LP, slot_LP, per_gpu)


def no_replication(load_LE: torch.Tensor, topology: Topology, num_physical: int) -> torch.Tensor:
    """No replication and no load awareness: expert e on slot e (needs P == E), the plain EP layout."""
    L, E = load_LE.shape
    if num_physical != E:
        raise ValueError(f"num_physical_experts: policy 'none' places each of the {E} experts once, "
                         f"got {num_physical}")
    return torch.arange(E).expand(L, E).clone()
