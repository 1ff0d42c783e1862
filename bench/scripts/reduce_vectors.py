"""weighted_reduce (hidden 7168, top-8) by batch size, row dtype and the order of the rows it
gathers: the op as shipped (its ``reduce_vector_bytes`` picks 16 or 8 bytes a thread) against each
choice forced, GPU time by CUPTI, each checked bit for bit against the reference first, beside a
copy of the same bytes. Where the choice flips is where the shipped op should track the faster one
(session 24).

``--positions`` orders the routes' rows: ``random`` (a permutation of every row), ``layout`` (the
expert-major layout of random top-8 routes over 256 experts, as ``bench kernels`` builds it) or
``sequential`` (token t's routes on rows 8t .. 8t+7). The same bytes in another order tell a
gather's locality apart from the kernel (session 26's large shape, kernels/reduce/NOTES.md).

``--warm-positions`` also times each call after a kernel that reads the positions (so they sit in
L2 while the rest was flushed), less that kernel alone: what the positions' DRAM round trip costs
(session 29).

    python3 bench/scripts/reduce_vectors.py [--tokens 128,256,...] [--dtypes e4m3,bf16] [--positions random,layout]
"""

import argparse

import torch

from ep_runtime.bench import kernels as bench
from kernels import permute
from kernels.reduce import reference, weighted_reduce
from kernels.reduce.weighted_reduce_kernel import get_weighted_reduce_kernel, reduce_vector_bytes

EXPERTS, ALIGNMENT = 256, 128


def positions(order: str, t: int, k: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[t, k]`` rows of the routes in ``order`` (one in ten masked -1); the rows number ``pos.max() + 1``."""
    if order == "random":
        pos = torch.randperm(t * k, generator=gen, device=device).view(t, k)
    elif order == "sequential":
        pos = torch.arange(t * k, device=device).view(t, k)
    elif order == "layout":
        experts = torch.rand(t, EXPERTS, generator=gen, device=device).topk(k, dim=1).indices
        pos = permute.expert_layout(experts, EXPERTS, alignment=ALIGNMENT).pos_TK.long()
    else:
        raise ValueError(f"--positions: expected random, layout or sequential, got {order!r}")
    pos[torch.rand(t, k, generator=gen, device=device) < 0.1] = -1
    return pos


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,256,512,1024,2048,4096")
    p.add_argument("--dtypes", default="e4m3", help="rows' dtypes: e4m3 (with float32 scales), bf16")
    p.add_argument("--positions", default="random", help="orders of the rows: random, layout, sequential")
    p.add_argument("--warm-positions", action="store_true", help="also time each with the positions in L2")
    a = p.parse_args()
    device, seed, timer = bench.tuning_setup(20)
    timer.kernel_calls = 20  # the copy's calls
    gen = torch.Generator(device).manual_seed(seed)
    d, k = 7168, 8
    for t in map(int, a.tokens.split(",")):
        for order in a.positions.split(","):
            pos = positions(order, t, k, gen, device)
            rows = int(pos.max()) + 1
            w = torch.rand(t, k, generator=gen, device=device)
            for name in a.dtypes.split(","):
                y = torch.randn(rows, d, generator=gen, device=device)
                sf = torch.rand(rows, d // 128, generator=gen, device=device) + 0.5
                fp8 = name == "e4m3"
                y = y.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
                extra = dict(sf_PG=sf) if fp8 else {}
                want = reference.weighted_reduce(y, pos, w, **extra)
                routed = int((pos >= 0).sum())
                moved = routed * d * y.itemsize + t * d * 2 + (routed * sf.shape[1] * 4 if fp8 else 0)
                line = f"T={t:5d} {name:4s} {order:10s} picks {reduce_vector_bytes(t, d, y.itemsize, device):2d} B:"
                for label, vector_bytes in (("shipped", None), ("16 B", 16), ("8 B", 8)):
                    if vector_bytes is None:
                        call = lambda: weighted_reduce(y, pos, w, **extra)  # noqa: E731
                    else:
                        kernel = get_weighted_reduce_kernel(d, k, "float8_e4m3fn" if fp8 else "bfloat16", "int64",
                                                            "bfloat16", 128, False, vector_bytes=vector_bytes)

                        def call(kernel=kernel):
                            out = torch.empty((t, d), dtype=torch.bfloat16, device=device)
                            kernel(y, sf, pos, w, out)
                            return out
                    assert torch.equal(call().view(torch.int16), want.view(torch.int16)), (t, name, order, label)
                    line += f"  {label} {timer.kernel_us(call):7.2f} us"
                    if a.warm_positions:
                        touch = pos.sum  # one kernel reading every position
                        warm = timer.kernel_us(lambda: (touch(), call())) - timer.kernel_us(touch)  # noqa: B023
                        line += f" ({warm:.2f} positions in L2)"
                print(f"{line}  copy of its {moved / 1e6:.0f} MB {timer.copy_kernel_us(moved):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
