"""Where the nvlink combine's time goes on two GPUs (a tuning record, not a product benchmark):
its reduce-and-store kernel (``kernels.comm.reduce_put``) with every store, with only the stores
home to this rank, with only those to the peer, the same reduce into local memory
(``weighted_reduce``), the reduced rows' transport alone (``put_rows`` of the same bytes), and the
home sum, each as a CUDA graph started on both GPUs together (``ep-runtime bench dispatch``'s
timer), on the routes and expert rows of a real DeepSeek-V3-shaped dispatch. Then the candidates
for what the combine could run instead, each first checked to leave the same bits in every rank's
region as the shipped kernel: ``reduce_put`` with other CTA sizes (``max_threads``), and the
reduce into local memory in chunks with each chunk's ``put_rows`` beside the next chunk's reduce
(``staged``: the link's time and the memory's overlapped across two streams), or the rows bound
for the peers reduced and stored beside those bound home (``split``).

    torchrun --standalone --nproc-per-node 2 bench/scripts/combine_parts.py [--tokens 4096]
"""

from __future__ import annotations

import torch

from ep_runtime.bench.peer_tuning import check_same, parse_args, setup, time_parts
from ep_runtime.dispatch.all_to_all import sum_home
from kernels.comm import put_rows, reduce_put
from kernels.reduce import weighted_reduce
from kernels.reduce.weighted_reduce_kernel import reduce_put as reduce_put_kernel


def main() -> None:
    a = parse_args(__doc__)
    s = setup(a)
    d, rank, world = s.d, s.rank, s.world
    y_PD, _, handle = d.dispatch(s.x_TD, s.idx_TK, s.w_TK)
    y_PD = y_PD.detach()
    route, weights_RK = handle.route, handle.recv_weights_RK
    pos_RK, back_RW = route.layout.pos_TK, route.back_RW
    (region,) = d._regions((d.num_recv_rows, a.hidden, torch.bfloat16))
    home_RW, peer_RW = back_RW.clone(), back_RW.clone()
    home_RW[:, [w for w in range(world) if w != rank]] = -1
    peer_RW[:, rank] = -1
    rows_RD = torch.randn(d.num_recv_rows, a.hidden, device=s.device, dtype=torch.bfloat16)

    def shipped():
        reduce_put(y_PD, pos_RK, weights_RK, back_RW, region)
        d.heap.barrier()

    parts = {
        "combine (graph)": lambda: d.combine(y_PD, handle),
        "reduce_put, every store + barrier": shipped,
        "reduce_put, stores home only": lambda: reduce_put(y_PD, pos_RK, weights_RK, home_RW, region),
        "reduce_put, stores to the peer only": lambda: reduce_put(y_PD, pos_RK, weights_RK, peer_RW, region),
        "weighted_reduce into local memory": lambda: weighted_reduce(y_PD, pos_RK, weights_RK),
        "put_rows of the reduced rows + barrier": lambda: (put_rows(rows_RD, back_RW, region), d.heap.barrier()),
        "sum_home": lambda: sum_home(region.views[rank], route.home_TW),
    }
    side = torch.cuda.Stream(s.device, priority=-1)  # high: its CTAs go first as SMs free up

    def staged(chunks: int):
        rows = -(-d.num_recv_rows // chunks)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for c in range(chunks):
            part = slice(c * rows, (c + 1) * rows)
            reduced_CD = weighted_reduce(y_PD, pos_RK[part], weights_RK[part])
            reduced_CD.record_stream(side)  # not reused by the next chunk's reduce while side reads it
            side.wait_stream(main)
            with torch.cuda.stream(side):
                put_rows(reduced_CD, back_RW[part], region)
        main.wait_stream(side)
        d.heap.barrier()

    def split():
        """The rows bound for the peers (link-bound) beside those bound home (memory-bound)."""
        main, mine = torch.cuda.current_stream(), slice(rank * a.tokens, (rank + 1) * a.tokens)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for w in range(world):
                if w != rank:
                    theirs = slice(w * a.tokens, (w + 1) * a.tokens)
                    reduce_put(y_PD, pos_RK[theirs], weights_RK[theirs], back_RW[theirs], region)
        reduce_put(y_PD, pos_RK[mine], weights_RK[mine], back_RW[mine], region)
        main.wait_stream(side)
        d.heap.barrier()

    candidates = {"split: peers' rows beside home's + barrier": split}
    candidates |= {f"reduce_put, max_threads {n} + barrier": lambda n=n: (
        reduce_put_kernel(y_PD, pos_RK, weights_RK, back_RW, region, max_threads=n), d.heap.barrier())
        for n in (256, 1024)}
    candidates |= {f"staged, {c} chunks + barrier": lambda c=c: staged(c) for c in (4, 8, 16)}

    def snapshot(fn):
        region.views[rank].zero_()
        d.heap.barrier()
        fn()
        torch.cuda.synchronize()
        return (region.views[rank].clone(),)

    check_same(candidates, snapshot, shipped)
    time_parts(parts | candidates, a, s, f"{y_PD.shape[0]} expert rows ({y_PD.numel() * 2 / 1e6:.0f} MB), "
                                         f"{int((back_RW >= 0).sum())} rows reduced here")


if __name__ == "__main__":
    main()
