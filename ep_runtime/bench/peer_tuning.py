"""What the two-GPU tuning scripts (``bench/scripts/dispatch_parts.py``, ``combine_parts.py``)
share: their arguments, an nvlink dispatcher over all ranks with DeepSeek-V3-shaped routes, the
check that a candidate leaves the shipped kernel's bytes, and the timing (each part as a CUDA
graph, started on every GPU together after a head start, as ``ep-runtime bench dispatch`` times;
the median over iterations of the slowest rank)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dispatch import NVLinkDispatcher
from .dispatch import _routing, timers
from .timer import capture_graphs


def parse_args(doc: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    return p.parse_args()


@dataclass
class Setup:
    """This rank's view of the run: the dispatcher (FP8 dispatch, ``T_max`` = ``--tokens``) and its
    inputs (bf16 tokens, routes and weights)."""

    rank: int
    world: int
    device: torch.device
    d: NVLinkDispatcher
    x_TD: torch.Tensor
    idx_TK: torch.Tensor
    w_TK: torch.Tensor


def setup(a: argparse.Namespace) -> Setup:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    d = NVLinkDispatcher(num_experts=a.experts, group=dist.group.WORLD, device=device, max_tokens_per_rank=a.tokens,
                         fp8=True)
    idx_TK, w_TK = _routing(a.tokens, a.experts, a.topk, rank, device)
    x_TD = torch.randn(a.tokens, a.hidden, device=device, dtype=torch.bfloat16)
    return Setup(rank, world, device, d, x_TD, idx_TK, w_TK)


def check_same(candidates: dict, snapshot, shipped) -> None:
    """Raises unless every candidate's ``snapshot(fn)`` (a tuple of this rank's regions after it
    ran) equals the shipped kernel's, on every rank."""
    want = snapshot(shipped)
    for name, fn in candidates.items():
        same = torch.tensor([all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bits: -0 is not +0
                                 for a, b in zip(snapshot(fn), want))], device=want[0].device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            raise AssertionError(f"{name}: not the shipped kernel's bytes")


def time_parts(parts: dict, a: argparse.Namespace, s: Setup, header: str) -> None:
    """Each part captured as a CUDA graph and timed; rank 0 prints ``header`` and the table."""
    median_ms, _ = timers(dist.group.WORLD, s.device, 5, a.iters)
    graphs = capture_graphs(*parts.values())
    if s.rank == 0:
        print(f"{torch.cuda.get_device_name(s.device)} x {s.world}, {a.tokens} tokens per rank, hidden {a.hidden}, "
              f"{header}, {a.iters} iterations, median of the slowest rank:")
    for name, graph in zip(parts, graphs):
        ms = median_ms(graph.replay)
        if s.rank == 0:
            print(f"  {name:50s} {ms * 1e3:8.1f} us")
    dist.destroy_process_group()
