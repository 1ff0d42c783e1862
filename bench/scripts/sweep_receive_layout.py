"""``kernels.comm.receive_layout``'s one-CTA kernel at several thread counts (a tuning record, not a
product benchmark): each variant checked against the reference on fresh routes, then timed with
``ep-runtime bench kernels``' timer, at the small batch's shapes (EP 1: 256 rows of 256 experts;
EP 2: two ranks' 128 rows, 128 experts here).

    python3 bench/scripts/sweep_receive_layout.py --out $OUT/sweep-receive-layout.json
"""

from __future__ import annotations

import argparse
import json

import torch

from ep_runtime.bench import kernels as bench
from kernels.comm import reference
from kernels.comm.receive_layout_kernel import THREADS, get_receive_layout_kernel
from kernels.permute import ExpertLayout, max_rows
from kernels.testing import send_routes

SHAPES = {"ep1-256": (1, 256, 8, 256), "ep2-128": (2, 128, 8, 128)}  # (W, T_max, K, E_local)
VARIANTS = [THREADS, 512, 256]
ALIGNMENT = 8


def _variant(meta, count, world, t_max, k, e_local, threads):
    kernel = get_receive_layout_kernel(world, k, e_local, ALIGNMENT, threads)
    rows, new = world * t_max, meta.new_empty
    num_rows = max_rows(rows, min(k, e_local), e_local, ALIGNMENT)

    def call():
        local, bits, back = new((rows, k)), new((rows, k)), new((rows, world))
        layout = ExpertLayout(counts_E=new(e_local), offsets_E=new(e_local), pos_TK=new((rows, k)),
                              src_P=new(num_rows), alignment=ALIGNMENT)
        kernel(meta, count, local, bits, back, layout.counts_E, layout.offsets_E, layout.pos_TK.view(-1), layout.src_P,
               world - 1, t_max)
        return local, bits.view(torch.float32), back, layout

    return call


def _same(got, want) -> bool:
    (local, weights, back, layout), (plan, want_layout) = got, want
    return (torch.equal(local.cpu(), plan.local_idx_RK) and torch.equal(back.cpu(), plan.back_RW)
            and torch.equal(weights.cpu().view(torch.int32), plan.weights_RK.view(torch.int32))
            and all(torch.equal(getattr(layout, n).cpu(), getattr(want_layout, n))
                    for n in ("counts_E", "offsets_E", "pos_TK", "src_P")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args()
    device, seed, timer = bench.tuning_setup(a.iters)
    print(f"{bench.device_name(device)}  seed {seed}", flush=True)
    rows = []
    for name, (world, t_max, k, e_local) in SHAPES.items():
        idx, weights = send_routes(world * t_max, k, world, e_local, seed=seed)
        meta = torch.cat([idx, weights.view(torch.int32)], 1)
        count = torch.full((world,), t_max, dtype=torch.int32)
        want = reference.receive_layout(meta, count, num_local_experts=e_local, rank=world - 1, max_tokens=t_max,
                                        alignment=ALIGNMENT,
                                        num_rows=max_rows(world * t_max, min(k, e_local), e_local, ALIGNMENT))
        for threads in VARIANTS:
            if threads < e_local:
                continue
            call = _variant(meta.to(device), count.to(device), world, t_max, k, e_local, threads)
            same = _same(call(), want)
            us, runs = timer.median_us(call)
            print(f"{name:8s} threads={threads:5d} {us:7.2f} us  ({runs} runs)  {'exact' if same else 'WRONG'}", flush=True)
            rows.append({"shape": name, "threads": threads, "time_us": us, "runs": runs, "exact": same})
    with open(a.out, "w") as f:
        json.dump({"device": bench.device_name(device), "seed": seed, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
