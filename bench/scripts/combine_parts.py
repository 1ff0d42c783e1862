"""Where the nvlink combine's time goes on two GPUs (a tuning record, not a product benchmark):
its two kernels (``kernels.comm.reduce_put`` of the rows bound for the peers, with the barrier, and
``kernels.reduce.reduce_sum_home``), what they replaced (``reduce_put`` storing every row, home ones
included, then the unit-weight ``sum_home``), the same reduce into local memory
(``weighted_reduce``) and the reduced rows' transport alone (``put_rows`` of the same bytes), each
as a CUDA graph started on both GPUs together (``ep-runtime bench dispatch``'s timer), on the
routes and expert rows of a real DeepSeek-V3-shaped dispatch. Then candidates, each first checked
to leave the same bits in every rank's region as the shipped kernel: ``reduce_put`` with other CTA
sizes (``max_threads``), its rows staged in shared memory or not (``staged``), bf16 and FP8 rows
home; ``reduce_sum_home`` with its own rows in registers (the build before session 28, which
staged them), checked to return the shipped kernel's bits.
(Session 16's staged and split combines, session 17's few-CTA ``reduce_put`` beside the home rows
and session 28's persistent one, which overlapped nothing, are in this script's history:
``kernels/comm/NOTES.md``.)

    torchrun --standalone --nproc-per-node 2 bench/scripts/combine_parts.py [--tokens 4096]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ep_runtime.bench.peer_tuning import check_same, parse_args, setup, time_parts
from ep_runtime.dispatch.all_to_all import sum_home
from kernels.comm import TokenRegions, put_rows, reduce_put
from kernels.reduce import reduce_sum_home, weighted_reduce
from kernels.reduce.weighted_reduce_kernel import reduce_put as reduce_put_kernel
from kernels.reduce.weighted_reduce_kernel import reduce_sum_home as reduce_sum_home_kernel


# (max_threads, staged) candidates; shipped: (1024, False) for bf16 rows, (256, True) for FP8 rows home
PUT_BUILDS = [(128, False), (256, False), (256, True), (1024, True)]
FP8_PUT_BUILDS = [(128, False), (256, False), (1024, False), (1024, True)]


def main() -> None:
    a = parse_args(__doc__)
    s = setup(a)
    d, rank = s.d, s.rank
    y_PD, _, handle = d.dispatch(s.x_TD, s.idx_TK, s.w_TK)
    y_PD = y_PD.detach()
    route, weights_RK = handle.route, handle.recv_weights_RK
    pos_RK, back_RW = route.layout.pos_TK, route.back_RW
    mine = slice(rank * a.tokens, (rank + 1) * a.tokens)
    (region,) = d._regions((d.num_recv_rows, a.hidden, torch.bfloat16))
    rows_RD = torch.randn(d.num_recv_rows, a.hidden, device=s.device, dtype=torch.bfloat16)

    def shipped():
        reduce_put(y_PD, pos_RK, weights_RK, back_RW, region, skip_rank=rank)
        d.heap.barrier()

    parts = {
        "combine (graph)": lambda: d.combine(y_PD, handle),
        "reduce_put to the peers + barrier": shipped,
        "reduce_sum_home": lambda: reduce_sum_home(y_PD, pos_RK[mine], weights_RK[mine], region.views[rank],
                                                   route.home_TW, rank=rank),
        "before (at today's CTA size): reduce_put, every store + barrier": lambda: (
            reduce_put(y_PD, pos_RK, weights_RK, back_RW, region), d.heap.barrier()),
        "before: sum_home": lambda: sum_home(region.views[rank], route.home_TW),
        "weighted_reduce into local memory": lambda: weighted_reduce(y_PD, pos_RK, weights_RK),
        "put_rows of the reduced rows + barrier": lambda: (put_rows(rows_RD, back_RW, region), d.heap.barrier()),
    }
    candidates = {f"reduce_put to the peers, max_threads {n}{' staged' * st} + barrier":
                  lambda n=n, st=st: (reduce_put_kernel(y_PD, pos_RK, weights_RK, back_RW, region, skip_rank=rank,
                                                        max_threads=n, staged=st), d.heap.barrier())
                  for n, st in PUT_BUILDS}
    # FP8 rows home (model.moe.fp8_combine), as NVLinkDispatcher.reduce_home stores them
    q, sf = d._regions((d.num_recv_rows, a.hidden, torch.uint8), (d.num_recv_rows, -(-a.hidden // 128), torch.float32))
    fp8_region = TokenRegions(q=q, sf=sf)
    returned_q, returned_sf = q.views[rank].view(torch.float8_e4m3fn), sf.views[rank]

    def fp8_shipped():
        reduce_put(y_PD, pos_RK, weights_RK, back_RW, fp8_region, skip_rank=rank)
        d.heap.barrier()

    parts |= {
        "FP8 rows home: reduce_put to the peers + barrier": fp8_shipped,
        "FP8 rows home: reduce_sum_home": lambda: reduce_sum_home(
            y_PD, pos_RK[mine], weights_RK[mine], returned_q, route.home_TW, rank=rank, sf_SG=returned_sf),
    }
    fp8_candidates = {f"FP8 rows home: reduce_put, max_threads {n}{' staged' * st} + barrier":
                      lambda n=n, st=st: (reduce_put_kernel(y_PD, pos_RK, weights_RK, back_RW, fp8_region,
                                                            skip_rank=rank, max_threads=n, staged=st),
                                          d.heap.barrier()) for n, st in FP8_PUT_BUILDS}
    homes = {
        "reduce_sum_home, own rows in registers": (lambda st: reduce_sum_home_kernel(
            y_PD, pos_RK[mine], weights_RK[mine], region.views[rank], route.home_TW, rank=rank, staged=st)),
        "FP8 rows home: reduce_sum_home, own rows in registers": (lambda st: reduce_sum_home_kernel(
            y_PD, pos_RK[mine], weights_RK[mine], returned_q, route.home_TW, rank=rank, sf_SG=returned_sf, staged=st)),
    }

    def snapshot(fn):
        region.views[rank].zero_()
        d.heap.barrier()
        fn()
        torch.cuda.synchronize()
        return (region.views[rank].clone(),)

    def fp8_snapshot(fn):
        q.views[rank].zero_()
        sf.views[rank].zero_()
        d.heap.barrier()
        fn()
        torch.cuda.synchronize()
        return q.views[rank].clone(), sf.views[rank].clone()

    check_same(candidates, snapshot, shipped)
    check_same(fp8_candidates, fp8_snapshot, fp8_shipped)
    for name, home in homes.items():  # after the FP8 check: the regions hold returned rows of both kinds
        same = torch.tensor([torch.equal(home(False).view(torch.uint8), home(None).view(torch.uint8))], device=s.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            raise AssertionError(f"{name}: not the shipped (staged) kernel's bits")
    homes = {name: lambda home=home: home(False) for name, home in homes.items()}
    time_parts(parts | candidates | fp8_candidates | homes, a, s, f"{y_PD.shape[0]} expert rows ({y_PD.numel() * 2 / 1e6:.0f} MB), "
                                         f"{int((back_RW >= 0).sum())} rows reduced here")


if __name__ == "__main__":
    main()
