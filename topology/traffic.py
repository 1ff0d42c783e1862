"""The traffic model: which links a step's dispatch crosses, counted from routes.

Input: routes (logical top-k ids per token, ``topk_idx_LTK``), either measured or drawn with
:func:`topology.synthetic.draw_routes`. Token ``t`` of the sample sits on GPU ``t % G`` with local token
index ``t // G`` (tokens are spread evenly over GPUs, each GPU's routes drawn from the same
distribution), and picks its replicas with the plan's deterministic rule (:mod:`topology.routing`).

Counting, as DeepEP's internode dispatch sends a token (combine sends the same back):

* RDMA (inter-node): one transfer per destination node other than the token's own, however many
  experts it uses there; it lands on the GPU with the sender's local rank.
* NVLink (intra-node; PCIe where the node has no NVLink): one transfer per destination GPU that is
  neither the sender nor, on a remote node, the RDMA landing GPU (which forwards over NVLink).

The same count judges a plan: :meth:`topology.Plan.evaluate` runs it on routes the plan was not
built from (a second sample, or the next window of real routes) and adds the routes each GPU
received, whose max/mean is the balance those tokens saw. Judged on the routes it was built from, a
plan only shows how well it fits their noise.

Shape suffixes: L layers, T tokens, K top-k, E experts, R replica slots, N nodes, G GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cluster import Topology
from .routing import replica_draws, slot_fractions

__all__ = ["DEFAULT_TRAFFIC", "Traffic", "TrafficModel", "count_traffic"]


@dataclass(frozen=True, kw_only=True)
class TrafficModel:
    """What the traffic estimate takes.

    Fields:
        routes_LTK: sampled routes, [L, T, K] logical ids (-1 = no route); None: draw ``sample_tokens``
            per layer from the load with group-limited top-``topk`` routing (``topk_groups`` of the
            plan's ``expert_groups``; plain top-k without groups), treating load as popularity.
        topk, topk_groups, sample_tokens, seed: how routes are drawn when none are given.
        tokens_per_gpu: tokens each GPU dispatches per step (scales counts to bytes).
        token_bytes: bytes of one dispatched token (default: hidden 7168 in bf16).
    """

    routes_LTK: torch.Tensor | None = None
    topk: int = 8
    topk_groups: int | None = None
    sample_tokens: int = 256
    seed: int = 0
    tokens_per_gpu: int = 4096
    token_bytes: int = 7168 * 2

    def __post_init__(self) -> None:
        for name in ("topk", "sample_tokens", "tokens_per_gpu", "token_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrafficModel.{name}: expected a positive int, got {value!r}")
        if self.topk_groups is not None and (not isinstance(self.topk_groups, int) or self.topk_groups < 1):
            raise ValueError(f"TrafficModel.topk_groups: expected a positive int or None, got {self.topk_groups!r}")


DEFAULT_TRAFFIC = TrafficModel()
"""The default estimate: 256 tokens per layer drawn from the load (the mean over layers is good to about
1%; a layer's own to a few percent), top-8, 4096 tokens per GPU, bf16 7168."""


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Expected dispatch traffic of one step (all layers, all GPUs; combine mirrors it).

    Fields:
        remote_nodes_per_token_L: [L] mean RDMA transfers (destination nodes other than its own) per token.
        intra_node_copies_per_token_L: [L] mean NVLink/PCIe transfers per token.
        inter_node_bytes_L, intra_node_bytes_L: [L] bytes per step per layer over RDMA / NVLink.
        gpu_routes_LG: [L, G] routes of the sample each GPU received (the replica rule's picks).
        tokens_per_step: tokens dispatched per layer per step (all GPUs).
        sampled_tokens: tokens the estimate counted per layer.
    """

    remote_nodes_per_token_L: torch.Tensor
    intra_node_copies_per_token_L: torch.Tensor
    inter_node_bytes_L: torch.Tensor
    intra_node_bytes_L: torch.Tensor
    gpu_routes_LG: torch.Tensor
    tokens_per_step: int
    sampled_tokens: int

    @property
    def remote_nodes_per_token(self) -> float:
        return float(self.remote_nodes_per_token_L.mean())

    @property
    def intra_node_copies_per_token(self) -> float:
        return float(self.intra_node_copies_per_token_L.mean())

    @property
    def balance_L(self) -> torch.Tensor:
        """[L] max / mean routes per GPU in the sample (1.0 for a layer without routes)."""
        mean_L = self.gpu_routes_LG.double().mean(-1)
        return torch.where(mean_L > 0, self.gpu_routes_LG.max(-1).values / mean_L.clamp(min=1e-300), 1.0)

    @property
    def balance(self) -> float:
        """Mean over layers of :attr:`balance_L`."""
        return float(self.balance_L.mean())

    @property
    def inter_node_bytes(self) -> float:
        return float(self.inter_node_bytes_L.sum())

    @property
    def intra_node_bytes(self) -> float:
        return float(self.intra_node_bytes_L.sum())


def count_traffic(
    phy2log_LP: torch.Tensor,
    experts_per_gpu: int,
    topology: Topology,
    routes_LTK: torch.Tensor,
    *,
    num_experts: int,
    tokens_per_gpu: int,
    token_bytes: int,
) -> Traffic:
    """Counts the sample's transfers under the replica rule and scales them to bytes per step.

    The picks are :func:`topology.routing.choose_replicas`'s, found with one search per route: slots
    sorted by (expert, slot) and each source node's fractions summed along them put expert ``e``'s
    replicas at ``[n * E + e, n * E + e + 1)`` of one increasing sequence, where ``n * E + e + u`` falls
    on the replica the rule picks."""
    L, T, K = routes_LTK.shape
    G, N, E = topology.num_gpus, topology.num_nodes, num_experts
    P = phy2log_LP.shape[1]
    node_of_gpu_G = torch.tensor(topology.node_of_gpu)
    local_rank_G = torch.tensor(topology.local_rank_of_gpu)
    node_of_physical = node_of_gpu_G.repeat_interleave(experts_per_gpu)
    src_gpu_T = torch.arange(T) % G
    src_node_T = node_of_gpu_G[src_gpu_T]
    token_index_T = torch.arange(T) // G
    # Which destination GPUs cost an NVLink transfer for a token sent from GPU s: [G(src), G(dst)].
    same_node_GG = node_of_gpu_G.unsqueeze(1) == node_of_gpu_G.unsqueeze(0)
    same_local_GG = local_rank_G.unsqueeze(1) == local_rank_G.unsqueeze(0)
    nvlink_GG = torch.where(same_node_GG, ~torch.eye(G, dtype=torch.bool), ~same_local_GG)
    order_LP = (phy2log_LP * P + torch.arange(P)).argsort(-1)
    fraction_LNP = slot_fractions(phy2log_LP, node_of_physical, E, N).gather(2, order_LP.unsqueeze(1).expand(L, N, P))
    cumulative_LX = (fraction_LNP.cumsum(-1) + E * torch.arange(N, dtype=torch.float64).view(1, N, 1)).view(L, N * P)
    e_LTK = routes_LTK.clamp(min=0)
    u_LTK = replica_draws(e_LTK, token_index_T.view(1, T, 1), src_gpu_T.view(1, T, 1))
    query_LX = (src_node_T.view(1, T, 1) * E + e_LTK + u_LTK).view(L, T * K)
    position_LTK = torch.searchsorted(cumulative_LX, query_LX, right=True).view(L, T, K) - src_node_T.view(1, T, 1) * P
    count_LE = torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, phy2log_LP, torch.ones_like(phy2log_LP))
    end_LTK = count_LE.cumsum(-1).gather(1, e_LTK.view(L, -1)).view(L, T, K)  # rounding may step outside
    position_LTK = torch.minimum(torch.maximum(position_LTK, end_LTK - count_LE.gather(1, e_LTK.view(L, -1)).view(
        L, T, K)), end_LTK - 1)
    physical_LTK = torch.where(routes_LTK >= 0, order_LP.gather(1, position_LTK.view(L, -1)).view(L, T, K), -1)
    # Distinct destinations per token: sort along K, keep first occurrences (-1 routes sort first).
    gpu_LTK = torch.where(physical_LTK >= 0, physical_LTK // experts_per_gpu, -1).sort(-1).values
    first_LTK = torch.ones_like(gpu_LTK, dtype=torch.bool)
    first_LTK[..., 1:] = gpu_LTK[..., 1:] != gpu_LTK[..., :-1]
    first_LTK &= gpu_LTK >= 0
    dst_LTK = gpu_LTK.clamp(min=0)
    nvlink_L = (first_LTK & nvlink_GG[src_gpu_T.view(1, T, 1), dst_LTK]).sum(-1).double().mean(-1)
    node_LTK = torch.where(gpu_LTK >= 0, node_of_gpu_G[dst_LTK], -1).sort(-1).values
    new_node_LTK = torch.ones_like(node_LTK, dtype=torch.bool)
    new_node_LTK[..., 1:] = node_LTK[..., 1:] != node_LTK[..., :-1]
    remote_LTK = new_node_LTK & (node_LTK >= 0) & (node_LTK != src_node_T.view(1, T, 1))
    remote_L = remote_LTK.sum(-1).double().mean(-1)
    valid_LTK = gpu_LTK >= 0
    gpu_routes_LG = torch.zeros(L, G, dtype=torch.float64).scatter_add_(
        1, dst_LTK.view(L, -1), valid_LTK.view(L, -1).double())
    tokens_per_step = tokens_per_gpu * G
    return Traffic(remote_nodes_per_token_L=remote_L, intra_node_copies_per_token_L=nvlink_L,
                   inter_node_bytes_L=remote_L * tokens_per_step * token_bytes,
                   intra_node_bytes_L=nvlink_L * tokens_per_step * token_bytes,
                   gpu_routes_LG=gpu_routes_LG, tokens_per_step=tokens_per_step, sampled_tokens=T)
