"""Where an mHC sublayer's forward+backward spends its GPU time (a device-call diagnostic for issue
#7's overhead number): a HyperConnection around an identity sublayer, as ``ep-runtime bench
mhc-overhead`` times it, under torch.profiler; prints the kernels by total GPU time.

    python3 bench/scripts/profile_mhc.py [--hidden 4096] [--tokens 8192] [--dtype bfloat16]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from ep_runtime.config import MHCConfig
from ep_runtime.mhc import HyperConnection


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=3)
    a = p.parse_args()
    hc = HyperConnection(MHCConfig(n=a.streams), a.hidden).cuda()
    x = torch.randn(1, a.tokens, a.streams, a.hidden, device="cuda", dtype=getattr(torch, a.dtype))
    grad = torch.randn_like(x)

    def step():
        hc(x.detach().requires_grad_(), lambda y: y).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.iters):
            step()
        torch.cuda.synchronize()
    print(f"mHC sublayer, T {a.tokens} N {a.streams} D {a.hidden} {a.dtype}, {a.iters} steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))


if __name__ == "__main__":
    main()
