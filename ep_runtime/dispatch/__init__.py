"""Dispatch/combine backends behind one ``Dispatcher`` protocol (see ``protocol``)."""

from __future__ import annotations

from ..config import DISPATCHERS, MoEConfig
from ..lanes import PerLane
from ..parallel import ParallelContext, lane_context
from .all_to_all import AllToAllDispatcher
from .deepep import DeepEPDispatcher
from .hierarchical import HierarchicalDispatcher
from .nvlink import NVLinkDispatcher
from .protocol import Dispatcher, DispatchHandle, Route

__all__ = ["AllToAllDispatcher", "DeepEPDispatcher", "Dispatcher", "DispatchHandle", "HierarchicalDispatcher",
           "NVLinkDispatcher", "Route", "make_dispatcher"]


def make_dispatcher(cfg: MoEConfig, ctx: ParallelContext, *, lanes: int = 1) -> Dispatcher:
    """The backend named by ``cfg.dispatcher`` over this rank's EP group (``deepep`` needs the
    ``deep_ep`` package and says so otherwise): ``nvlink`` is two-stage
    (``hierarchical``) when the group spans nodes. Without a group (one process) tokens do not
    travel: every backend is the identity transport of ``all_to_all``.

    ``lanes`` > 1 (the ``overlap`` pipeline schedule): one dispatcher per lane, each over its own
    groups of the same ranks (``PerLane``; collective: every rank calls it)."""
    if lanes > 1 and ctx.ep_group is not None:
        contexts = [ctx] + [lane_context(ctx) for _ in range(lanes - 1)]
        return PerLane([make_dispatcher(cfg, c) for c in contexts])
    if cfg.dispatcher == "nvlink" and ctx.ep_rail_group is not None:
        return HierarchicalDispatcher(num_experts=cfg.num_experts, rail_group=ctx.ep_rail_group,
                                      node_group=ctx.ep_node_group, device=ctx.device,
                                      max_tokens_per_rank=cfg.max_tokens_per_rank, alignment=cfg.alignment,
                                      fp8=cfg.fp8_dispatch, fp8_combine=cfg.fp8_combine)
    if cfg.dispatcher == "nvlink" and ctx.ep_group is not None:
        return NVLinkDispatcher(num_experts=cfg.num_experts, group=ctx.ep_group, device=ctx.device,
                                max_tokens_per_rank=cfg.max_tokens_per_rank, alignment=cfg.alignment,
                                fp8=cfg.fp8_dispatch, fp8_combine=cfg.fp8_combine)
    if cfg.dispatcher == "deepep" and ctx.ep_rail_group is not None:
        raise ValueError("model.moe.dispatcher: 'deepep' runs DeepEP's intranode mode, and this EP group spans "
                         "nodes; use 'nvlink' (two stages: NVLink inside nodes, all_to_all between them) or "
                         "'all_to_all'")
    if cfg.dispatcher == "deepep" and ctx.ep_group is not None:
        return DeepEPDispatcher(num_experts=cfg.num_experts, group=ctx.ep_group, alignment=cfg.alignment,
                                fp8=cfg.fp8_dispatch)
    if cfg.dispatcher in DISPATCHERS:
        return AllToAllDispatcher(num_experts=cfg.num_experts, group=ctx.ep_group, alignment=cfg.alignment,
                                  fp8=cfg.fp8_dispatch, fp8_combine=cfg.fp8_combine)
    raise ValueError(f"model.moe.dispatcher: expected one of {DISPATCHERS}, got {cfg.dispatcher!r}")
