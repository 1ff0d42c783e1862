"""Device diagnostic (issue #6): does the nvlink backend's symmetric heap work on process groups
smaller than the job? Run one scenario per torchrun on 4 GPUs; a hang prints every rank's stack
(SIGTERM from `timeout`).

    torchrun --standalone --nproc-per-node 4 bench/scripts/symm_groups.py SCENARIO

Scenarios: prefix (ranks [0, 2) alone, a heap that grows), partition ([0, 1] and [2, 3] at once),
world-after-prefix (a heap over all ranks after one over [0, 2)), dispatcher (NVLinkDispatcher
forward and backward over [0, 2) while the others wait).
"""

import faulthandler
import os
import signal
import sys

import torch
import torch.distributed as dist

from ep_runtime.dispatch.nvlink import NVLinkDispatcher
from ep_runtime.dispatch.symmetric import CudaHeap
from kernels.comm import put_rows

faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
rank = int(os.environ["RANK"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)


def check_heap(group, nbytes=1 << 20):
    """Each rank stores its group rank into every peer's row of it; all rows must arrive."""
    heap = CudaHeap(nbytes, group, device)
    region = heap.region(0, (heap.world, 4), torch.int32)
    src = torch.full((1, 4), heap.rank + 100, dtype=torch.int32, device=device)
    put_rows(src, torch.full((1, heap.world), heap.rank, dtype=torch.int32, device=device), region)
    heap.barrier()
    got = region.views[heap.rank][:, 0].tolist()
    assert got == [r + 100 for r in range(heap.world)], got
    return heap


def say(msg):
    torch.cuda.synchronize()
    print(f"rank {rank}: {msg}", flush=True)


scenario = sys.argv[1]
if scenario == "prefix":
    group = dist.new_group([0, 1])
    if rank < 2:
        first = check_heap(group)
        say("first heap ok")
        second = check_heap(group, 64 << 20)
        say("grown heap ok")
        del first
        say("first heap freed")
elif scenario == "partition":
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    heap = check_heap(groups[rank // 2])
    say("partition heap ok")
    heap = check_heap(groups[rank // 2], 64 << 20)
    say("partition grown heap ok")
elif scenario == "world-after-prefix":
    group = dist.new_group([0, 1])
    if rank < 2:
        check_heap(group)
        say("prefix heap ok")
    dist.barrier()
    check_heap(dist.group.WORLD)
    say("world heap ok")
elif scenario == "dispatcher":
    group = dist.new_group([0, 1])
    if rank < 2:
        d = NVLinkDispatcher(num_experts=8, group=group, device=device, max_tokens_per_rank=256, fp8=True)
        for step in range(3):
            x = torch.randn(256, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
            idx = torch.rand(256, 8, device=device).argsort(1)[:, :2]
            w = torch.rand(256, 2, device=device)
            x_PD, layout, handle = d.dispatch(x, idx, w)
            d.combine(x_PD * 2, handle).float().square().sum().backward()
            say(f"step {step} ok")
        del d
        say("dispatcher freed")
dist.barrier()
say(f"{scenario}: done")
dist.destroy_process_group()
