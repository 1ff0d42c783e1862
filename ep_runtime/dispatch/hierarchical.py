"""An EP group that spans nodes: ``all_to_all`` between nodes, ``nvlink`` inside them (DeepEP's
internode scheme).

A token travels once to each node holding one of its experts, to the rank of that node with its
own local index (the "rail": the ranks of equal local index, one per node, linked by the
network); there it is one of the rows the node-level ``nvlink`` backend forwards, once per rank
of the node that holds one of its experts. Combine runs the other way: the node sums its ranks'
rows per forwarded row, the rail sends one row per token home, the home rank sums its nodes. With
``fp8_combine`` both stages send e4m3 rows (each stage's own rows stay in y's dtype), so a row
that crosses the network was rounded to e4m3 twice: a node's sum carries its ranks' rounding.

EP rank ``r`` is node ``r // G``, local rank ``r % G`` (G ranks per node); expert ``e`` is on EP
rank ``e // E_local`` as in the flat backends. Both stages are the flat backends' transports, so
the autograd of ``autograd.py`` serves the composition unchanged. Testable on one host by
declaring fewer ranks per node (``parallel.ranks_per_node``; 1: every GPU its own node).

Shape letters: T tokens, K routes, D hidden, R1 rows received from the rail, R rows received
from the node, P layout rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.permute import ExpertLayout
from kernels.validate import check_positive

from .all_to_all import AllToAllDispatcher, TokenRoute
from .autograd import CombineFn, DispatchFn
from .nvlink import NVLinkDispatcher, PeerRoute, node_sizes
from .protocol import Dispatcher, DispatchHandle, check_combine_args, check_dispatch_args, local_experts


@dataclass(frozen=True)
class TwoStageRoute:
    """Where the rows went: over the rail (``rail``), then inside the node (``node``)."""

    rail: TokenRoute
    node: PeerRoute
    layout: ExpertLayout  # the node stage's: over the R rows this rank received
    num_tokens: int


class HierarchicalDispatcher(Dispatcher, name="hierarchical"):
    """Dispatch/combine over an EP group of ``N`` nodes x ``G`` ranks: ``rail_group`` (this rank's
    local index on every node) and ``node_group`` (this rank's node). ``nvlink``'s backend over an
    EP group that spans nodes. ``group``, the whole EP group, moves no tokens: it is what the
    model's Engram tables shard over, as with every other backend."""

    fp8_combine_capable = True

    @classmethod
    def from_config(cls, cfg, ctx):
        return cls(group=ctx.ep_group, rail_group=ctx.ep_rail_group, node_group=ctx.ep_node_group,
                   **node_sizes(cfg, ctx))

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup, rail_group: dist.ProcessGroup,
                 node_group: dist.ProcessGroup, device: torch.device, max_tokens_per_rank: int,
                 alignment: int = 128, fp8: bool = False, fp8_combine: bool = False):
        check_positive("max_tokens_per_rank", max_tokens_per_rank)  # before the node's multiple of it
        nodes, per_node = dist.get_world_size(rail_group), dist.get_world_size(node_group)
        self.ep_rank = dist.get_rank(rail_group) * per_node + dist.get_rank(node_group)  # node-major, as the experts
        if dist.get_rank(group) != self.ep_rank:
            raise ValueError(f"group: expected this rank at {self.ep_rank} of the EP group (node-major), "
                             f"got {dist.get_rank(group)}")
        self.group = group
        self.num_experts, self.num_local_experts = num_experts, local_experts(num_experts, nodes * per_node)
        self.rail = AllToAllDispatcher(num_experts=num_experts, group=rail_group, alignment=alignment,
                                       dispatch_format="e4m3" if fp8 else "bf16")
        # A rank forwards at most one row per token of each node's rail peer.
        self.node = NVLinkDispatcher(num_experts=num_experts // nodes, group=node_group, device=device,
                                     max_tokens_per_rank=nodes * max_tokens_per_rank, alignment=alignment, fp8=fp8)
        self.max_tokens, self.fp8_combine = max_tokens_per_rank, fp8_combine

    def scatter(self, rows_TX: torch.Tensor, route: TwoStageRoute) -> torch.Tensor:
        return self.node.scatter(self.rail.scatter(rows_TX, route.rail), route.node)

    def gather_home(self, rows_RX: torch.Tensor, route: TwoStageRoute) -> torch.Tensor:
        return self.rail.gather_home(self.node.gather_home(rows_RX, route.node), route.rail)

    def reduce_home(self, y_PD: torch.Tensor, weights_RK: torch.Tensor, route: TwoStageRoute, *,
                    fp8: bool = False) -> torch.Tensor:
        rows_R1D = self.node.reduce_home(y_PD, weights_RK, route.node, fp8=fp8)
        return self.rail.gather_home(rows_R1D, route.rail, fp8=fp8)

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        check_dispatch_args(x_TD, topk_idx_TK, topk_weights_TK)
        if x_TD.shape[0] > self.max_tokens:
            raise ValueError(f"x_TD: rank {dist.get_rank()} dispatches {x_TD.shape[0]} tokens, more than the "
                             f"{self.max_tokens} its peers' receive buffers hold (model.moe.max_tokens_per_rank)")
        with torch.no_grad():
            rail, node_idx_R1K, x_R1D, weights_R1K = self.rail.move_tokens(x_TD, topk_idx_TK, topk_weights_TK)
            node, x_PD, weights_RK = self.node.move_tokens(x_R1D, node_idx_R1K, weights_R1K, expand=True)
        route = TwoStageRoute(rail=rail, node=node, layout=node.layout, num_tokens=x_TD.shape[0])
        x_PD, recv_weights_RK = DispatchFn.apply(x_TD, topk_weights_TK, x_PD, weights_RK, route, self)
        return x_PD, route.layout, DispatchHandle(route=route, recv_weights_RK=recv_weights_RK)

    def combine(self, y_PD, handle: DispatchHandle):
        check_combine_args(y_PD, handle)
        return CombineFn.apply(y_PD, handle.recv_weights_RK, handle.route, self, self.fp8_combine)
