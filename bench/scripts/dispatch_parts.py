"""The nvlink dispatch's sending kernel on two GPUs (a tuning record, not a product benchmark):
``kernels.comm.put_tokens`` (FP8 cast and rows into every rank a token goes to, then the barrier)
with the shipped tile and with other tiles and vector widths, each first checked to leave the same
bytes in every rank's regions as the shipped kernel, next to ``to_buffers`` (the whole sending and
receiving side) and the transport alone (``put_rows`` of FP8 rows already cast), each as a CUDA
graph started on both GPUs together, on DeepSeek-V3-shaped routes.

    torchrun --standalone --nproc-per-node 2 bench/scripts/dispatch_parts.py [--tokens 4096]
"""

from __future__ import annotations

import torch

from ep_runtime.bench.peer_tuning import check_same, parse_args, setup, time_parts
from kernels.comm import TokenRegions, put_rows, put_tokens
from kernels.comm.reference import token_rows
from kernels.comm.put_tokens_kernel import get_put_tokens_kernel

# (tile_m, tile_n, threads, vec); shipped: (1, 1024, 64, 16), 16-byte e4m3 stores (before session 16's
# sweep: (1, 1024, 128, 8))
TILES = [(1, 1024, 128, 8), (1, 2048, 128, 16), (2, 1024, 128, 16), (1, 2048, 256, 8), (1, 3584, 224, 16),
         (1, 7168, 448, 16)]


def main() -> None:
    a = parse_args(__doc__)
    s = setup(a)
    d, rank, world, x_TD, idx_TK = s.d, s.rank, s.world, s.x_TD, s.idx_TK
    e_local = a.experts // world
    d.move_tokens(x_TD, idx_TK, s.w_TK)  # the heap, at its size
    q, sf = d._regions((d.num_recv_rows, a.hidden, torch.uint8), (d.num_recv_rows, -(-a.hidden // 128), torch.float32))
    regions = TokenRegions(q=q, sf=sf)
    dest_TW, _ = token_rows(idx_TK, num_local_experts=e_local, world=world, rank=rank, max_tokens=a.tokens)
    q_TD = torch.randint(0, 256, (a.tokens, a.hidden), dtype=torch.uint8, device=s.device)

    def tiled(tile):
        kernel = get_put_tokens_kernel(a.hidden, "bfloat16", 128, world, a.topk, "int64", tile[:3], tile[3])
        first_q, first_sf = q.views[0], sf.views[0]
        return lambda: (kernel(x_TD, idx_TK, q.delta_W, first_q.view(torch.float8_e4m3fn).view(-1, tile[3]),
                               first_sf.view(-1), e_local, rank, a.tokens), d.heap.barrier())

    def shipped():
        put_tokens(x_TD, idx_TK, regions, num_local_experts=e_local, rank=rank)
        d.heap.barrier()

    parts = {"to_buffers": lambda: d.move_tokens(x_TD, idx_TK, s.w_TK),
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

    check_same(candidates, snapshot, shipped)
    time_parts(parts | candidates, a, s, f"{int((dest_TW >= 0).sum())} rows stored")


if __name__ == "__main__":
    main()
