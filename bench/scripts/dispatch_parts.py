"""The nvlink dispatch's sending kernel on two GPUs (a tuning record, not a product benchmark):
``kernels.comm.put_tokens`` (FP8 cast and rows into every rank a token goes to, then the barrier)
with the shipped tile and with other tiles and vector widths, each first checked to leave the same
bytes in every rank's regions as the shipped kernel, next to ``to_buffers`` (the whole sending and
receiving side) and the transport alone (``put_rows`` of FP8 rows already cast), each as a CUDA
graph started on both GPUs together, on DeepSeek-V3-shaped routes.

    torchrun --standalone --nproc-per-node 2 bench/scripts/dispatch_parts.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from ep_runtime.bench.dispatch import _capture, _routing
from ep_runtime.bench.ep_scaling import _Timer
from ep_runtime.dispatch import NVLinkDispatcher
from kernels.comm import TokenRegions, put_rows, put_tokens
from kernels.comm.put_tokens_kernel import get_put_tokens_kernel

# (tile_m, tile_n, threads, vec); shipped: (1, 1024, 64, 16), 16-byte e4m3 stores (before session 16's
# sweep: (1, 1024, 128, 8))
TILES = [(1, 1024, 128, 8), (1, 2048, 128, 16), (2, 1024, 128, 16), (1, 2048, 256, 8), (1, 3584, 224, 16),
         (1, 7168, 448, 16)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    d = NVLinkDispatcher(num_experts=a.experts, group=dist.group.WORLD, device=device, max_tokens_per_rank=a.tokens,
                         fp8=True)
    e_local = a.experts // world
    idx_TK, w_TK = _routing(a.tokens, a.experts, a.topk, rank, device)
    x_TD = torch.randn(a.tokens, a.hidden, device=device, dtype=torch.bfloat16)
    d.move_tokens(x_TD, idx_TK, w_TK)  # the heap, at its size
    q, sf = d._regions((d.num_recv_rows, a.hidden, torch.uint8), (d.num_recv_rows, -(-a.hidden // 128), torch.float32))
    regions = TokenRegions(q=q, sf=sf)
    dest_TW = torch.full((a.tokens, world), -1, dtype=torch.int32, device=device)
    for w in range(world):
        goes = ((idx_TK >= w * e_local) & (idx_TK < (w + 1) * e_local)).any(1)
        dest_TW[goes, w] = rank * a.tokens + torch.arange(a.tokens, device=device, dtype=torch.int32)[goes]
    q_TD = torch.randint(0, 256, (a.tokens, a.hidden), dtype=torch.uint8, device=device)

    def tiled(tile):
        kernel = get_put_tokens_kernel(a.hidden, "bfloat16", 128, world, a.topk, "int64", tile[:3], tile[3])
        first_q, first_sf = q.views[0], sf.views[0]
        return lambda: (kernel(x_TD, idx_TK, q.delta_W, first_q.view(torch.float8_e4m3fn).view(-1, tile[3]),
                               first_sf.view(-1), e_local, rank, a.tokens), d.heap.barrier())

    shipped = lambda: (put_tokens(x_TD, idx_TK, regions, num_local_experts=e_local, rank=rank), d.heap.barrier())  # noqa: E731
    parts = {"to_buffers": lambda: d.move_tokens(x_TD, idx_TK, w_TK),
             "put_rows of FP8 rows + barrier": lambda: (put_rows(q_TD, dest_TW, q), d.heap.barrier()),
             "put_tokens (1, 1024, 64, 16) + barrier": shipped}
    candidates = {f"put_tokens {tile} + barrier": tiled(tile) for tile in TILES}

    def snapshot(fn):
        for view in (q.views[rank], sf.views[rank]):
            view.zero_()
        d.heap.barrier()
        fn()
        torch.cuda.synchronize()
        return q.views[rank].clone(), sf.views[rank].clone()

    want = snapshot(shipped)
    for name, fn in candidates.items():
        same = torch.tensor([all(map(torch.equal, snapshot(fn), want))], device=device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            raise AssertionError(f"{name}: not the shipped put_tokens' bytes")
    parts |= candidates
    timer, flag = _Timer(device), torch.zeros(1, device=device)

    def time_ms(fn) -> float:
        samples = []
        for _ in range(5 + a.iters):
            dist.barrier(device_ids=[rank])
            samples.append(timer.time(fn, True, lambda: dist.all_reduce(flag)))
        worst = torch.tensor(samples[5:], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return statistics.median(worst.tolist())

    graphs = _capture(*parts.values())
    if rank == 0:
        print(f"{torch.cuda.get_device_name(device)} x {world}, {a.tokens} tokens per rank, hidden {a.hidden}, "
              f"{int((dest_TW >= 0).sum())} rows stored, {a.iters} iterations, median of the slowest rank:")
    for name, graph in zip(parts, graphs):
        ms = time_ms(graph.replay)
        if rank == 0:
            print(f"  {name:45s} {ms * 1e3:8.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
