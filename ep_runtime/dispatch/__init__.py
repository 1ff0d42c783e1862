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
    """The backend registered as ``cfg.dispatcher`` over this rank's EP group (``deepep`` needs the
    ``deep_ep`` package and says so otherwise; ``nvlink`` is two-stage, ``hierarchical``, when the
    group spans nodes). Without a group (one process), or in an EP group of one rank, tokens do not
    travel: every backend is the identity transport of ``all_to_all``, which never syncs.

    ``lanes`` > 1 (the ``overlap`` pipeline schedule): one dispatcher per lane, each over its own
    groups of the same ranks (``PerLane``; collective: every rank calls it)."""
    if cfg.dispatcher not in DISPATCHERS:
        raise ValueError(f"model.moe.dispatcher: expected one of {DISPATCHERS}, got {cfg.dispatcher!r}")
    if ctx.ep_group is None or ctx.ep_size == 1:
        return AllToAllDispatcher.from_config(cfg, ctx)
    if lanes > 1:
        contexts = [ctx] + [lane_context(ctx) for _ in range(lanes - 1)]
        return PerLane([make_dispatcher(cfg, c) for c in contexts])
    return Dispatcher.backends[cfg.dispatcher].from_config(cfg, ctx)
