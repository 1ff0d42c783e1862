"""Worker of tests/runtime/test_ep_equivalence.py's job of EP groups of one rank each: groups that
are not the whole job, which a group-of-everyone run cannot tell from the default group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpus import parallel_config
from dispatch_workers import HIDDEN, routing, run_case

from ep_runtime.config import MoEConfig
from ep_runtime.dispatch import AllToAllDispatcher, make_dispatcher
from ep_runtime.engram import ShardedTable
from ep_runtime.lanes import PerLane
from ep_runtime.parallel import init_parallel


def ep_groups_of_one() -> dict:
    """Per rank: the largest differences between the table and the all_to_all dispatcher over this
    rank's EP group of one and the same over no group (one process), and what ``make_dispatcher``
    makes for two lanes there."""
    ctx = init_parallel(parallel_config(ep=1))
    try:
        return {"table": _table_differences(ctx.ep_group, ctx.rank, ctx.device),
                "dispatch": _dispatch_differences(ctx.ep_group, ctx.rank, ctx.device), "lanes": _lanes(ctx),
                "fp8_rows_home": _fp8_rows_home(ctx.rank, ctx.device)}
    finally:
        dist.destroy_process_group()


def _table_differences(group, rank: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 50, (4, 7), generator=g).to(device)
    grad = torch.randn(4, 7, 3, generator=g).to(device)
    mine, whole = (ShardedTable(50, 3, group=over, seed=1).to(device) for over in (group, None))
    if mine.weight_LE.shape != whole.weight_LE.shape:
        return {"shard_rows": float(mine.weight_LE.shape[0] - whole.weight_LE.shape[0])}
    rows = [table(idx) for table in (mine, whole)]
    for r in rows:
        (r * grad).sum().backward()
    return {"rows": float((rows[0] - rows[1]).abs().max()),
            "grad": float((mine.weight_LE.grad - whole.weight_LE.grad).abs().max())}


def _dispatch_differences(group, rank: int, device: torch.device) -> dict:
    """FP8 rows home too: a rank's own rows skip the cast, wherever its EP rank says they are."""
    idx_TK, weights_TK = routing("masked", rank, 37, 8, device)
    x_TD = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(device)
    out = {}
    for fp8_combine in (False, True):
        got, want = (run_case(AllToAllDispatcher(num_experts=8, group=over, alignment=8, fp8_combine=fp8_combine),
                              x_TD, idx_TK, weights_TK, first_expert=0) for over in (group, None))
        for name in ("out", "grad_x", "grad_w"):
            out[name + ("-fp8-combine" if fp8_combine else "")] = float((got[name] - want[name]).abs().max())
    return out


def _fp8_rows_home(rank: int, device: torch.device) -> float:
    """Over both ranks (the job's group), FP8 rows home against exact rows home: the largest
    difference relative to the output's largest element (e4m3 keeps 3 mantissa bits)."""
    idx_TK, weights_TK = routing("balanced", rank, 37, 8, device)
    x_TD = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(device)
    exact, cast = (run_case(AllToAllDispatcher(num_experts=8, group=dist.group.WORLD, alignment=8, fp8_combine=fp8),
                            x_TD, idx_TK, weights_TK, first_expert=4 * rank)["out"] for fp8 in (False, True))
    return float((cast - exact).abs().max() / exact.abs().max())


def _lanes(ctx) -> dict:
    """Two lanes over an EP group of one rank: nothing travels, so one identity transport (no
    group, no collectives) serves both."""
    made = make_dispatcher(MoEConfig(), ctx, lanes=2)
    return {"per_lane": isinstance(made, PerLane), "group": getattr(made, "group", "missing")}
