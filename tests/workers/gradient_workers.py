"""Worker of tests/runtime/test_gradients.py: gradients averaged over two processes, by the buckets
attached before backward (overlapped with it, or after several backwards) and by plain all-reduces."""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpus import parallel_config
from torch import nn

from ep_runtime.gradients import GradientBuckets
from ep_runtime.parallel import init_parallel

BUCKET_ELEMENTS = 80  # a few buckets of these layers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.unused = nn.Parameter(torch.ones(3))  # first: in the last bucket, which waits for the reduce
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def loss(self, seed: int) -> torch.Tensor:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        return self.layers(x.to(self.unused.device)).square().sum()


def _grads(net: Net) -> list[torch.Tensor]:
    return [p.grad.detach().cpu().clone() for p in net.parameters()]


def averaged_three_ways() -> dict:
    """This rank's averaged gradients (plain, overlapped, after two backwards: each with its plain
    all-reduce), the buckets, and how many started before backward returned."""
    ctx = init_parallel(parallel_config())
    world, seeds = ctx.world_size, [10 * ctx.rank, 10 * ctx.rank + 1]
    try:
        out = {}
        for name, backwards, overlap in (("one", 1, True), ("two", 2, False)):
            want, net = Net().to(ctx.device), Net().to(ctx.device)
            for seed in seeds[:backwards]:
                want.loss(seed).backward()
            for p in want.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world
            buckets = GradientBuckets(list(net.parameters()), None, world, overlap=overlap,
                                      bucket_elements=BUCKET_ELEMENTS)
            buckets.attach()
            for seed in seeds[:backwards]:
                net.loss(seed).backward()
            started = buckets._started
            buckets.reduce(ctx)
            out[name] = {"want": _grads(want), "got": _grads(net), "started": started,
                         "buckets": len(buckets.buckets)}
        twice = Net().to(ctx.device)
        GradientBuckets(list(twice.parameters()), None, world, overlap=True, bucket_elements=BUCKET_ELEMENTS).attach()
        twice.loss(seeds[0]).backward()
        try:
            twice.loss(seeds[1]).backward()
            out["second_backward"] = "accepted"
        except RuntimeError as exc:
            out["second_backward"] = str(exc)
        unattached = Net().to(ctx.device)  # reduce alone copies the gradients in
        unattached.loss(seeds[0]).backward()
        GradientBuckets(list(unattached.parameters()), None, world, bucket_elements=BUCKET_ELEMENTS).reduce(ctx)
        out["unattached"] = _grads(unattached)
        return out
    finally:
        dist.destroy_process_group()
