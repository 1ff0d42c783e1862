"""Where an eager nvlink dispatch + combine spends its host time (issue #9: eager calls take ~0.5 ms
at 256 tokens against ~47 us as CUDA graphs): wall microseconds a call (the host is the
bottleneck), then cProfile of the same calls, top functions by own and by cumulative time.
One GPU, EP 1 (every kernel and Python line of the path runs; the stores go to the rank's own heap).

    torchrun --standalone --nproc-per-node 1 bench/scripts/host_profile.py --tokens 256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from ep_runtime.bench.dispatch import _routing
from ep_runtime.config import ParallelConfig
from ep_runtime.dispatch import NVLinkDispatcher
from ep_runtime.parallel import init_parallel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--calls", type=int, default=100)
    a = p.parse_args()
    ctx = init_parallel(ParallelConfig())
    d = NVLinkDispatcher(num_experts=a.experts, group=ctx.ep_group, device=ctx.device, max_tokens_per_rank=a.tokens,
                         alignment=8, fp8=True)
    idx_TK, w_TK = _routing(a.tokens, a.experts, a.topk, 0, ctx.device)
    x_TD = torch.randn(a.tokens, a.hidden, device=ctx.device, dtype=torch.bfloat16)

    def step():
        x_PD, _, handle = d.dispatch(x_TD, idx_TK, w_TK)
        d.combine(x_PD, handle)

    with torch.no_grad():
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()  # the host is the bottleneck: the GPU's ~47 us a call is hidden
        for _ in range(a.calls):
            step()
        torch.cuda.synchronize()
        print(f"dispatch + combine: {(time.perf_counter() - start) / a.calls * 1e6:.1f} us a call, eager "
              f"({a.tokens} tokens, EP 1)")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(a.calls):
            step()
        profiler.disable()
        torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    stats.print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    print(out.getvalue())


if __name__ == "__main__":
    main()
