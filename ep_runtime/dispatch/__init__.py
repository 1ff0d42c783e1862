"""Dispatch/combine backends behind one ``Dispatcher`` protocol (see ``protocol``)."""

from __future__ import annotations

from ..config import MoEConfig
from ..parallel import ParallelContext
from .all_to_all import AllToAllDispatcher
from .protocol import Dispatcher, DispatchHandle, RowSplits, TokenRoute

__all__ = ["AllToAllDispatcher", "Dispatcher", "DispatchHandle", "RowSplits", "TokenRoute", "make_dispatcher"]


def make_dispatcher(cfg: MoEConfig, ctx: ParallelContext) -> Dispatcher:
    """The backend named by ``cfg.dispatcher`` over this rank's EP group."""
    if cfg.dispatcher == "all_to_all":
        return AllToAllDispatcher(num_experts=cfg.num_experts, group=ctx.ep_group, alignment=cfg.alignment,
                                  fp8=cfg.fp8_dispatch)
    raise ValueError(f"model.moe.dispatcher: expected 'all_to_all', got {cfg.dispatcher!r}")
