"""weighted_reduce of e4m3 rows (hidden 7168, top-8) by batch size: the op as shipped (its
``reduce_vector_bytes`` picks 16 or 8 bytes a thread) against each choice forced, GPU time by
CUPTI, each checked bit for bit against the reference first. Where the choice flips is where the
shipped op should track the faster one (session 24).

    python3 bench/scripts/reduce_vectors.py [--tokens 128,256,...]
"""

import argparse

import torch

from ep_runtime.bench import kernels as bench
from kernels.reduce import reference, weighted_reduce
from kernels.reduce.weighted_reduce_kernel import get_weighted_reduce_kernel, reduce_vector_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,256,512,1024,2048,4096")
    a = p.parse_args()
    device, seed, timer = bench.tuning_setup(20)
    gen = torch.Generator(device).manual_seed(seed)
    d, k = 7168, 8
    for t in map(int, a.tokens.split(",")):
        rows = t * k
        q = torch.randn(rows, d, generator=gen, device=device).to(torch.float8_e4m3fn)
        sf = torch.rand(rows, d // 128, generator=gen, device=device) + 0.5
        pos = torch.randperm(rows, generator=gen, device=device).view(t, k)
        pos[torch.rand(t, k, generator=gen, device=device) < 0.1] = -1
        w = torch.rand(t, k, generator=gen, device=device)
        want = reference.weighted_reduce(q, pos, w, sf_PG=sf)
        line = f"T={t:5d} shipped picks {reduce_vector_bytes(t, d, 1, device):2d} B:"
        for label, vector_bytes in (("shipped", None), ("16 B", 16), ("8 B", 8)):
            if vector_bytes is None:
                call = lambda: weighted_reduce(q, pos, w, sf_PG=sf)  # noqa: E731
            else:
                kernel = get_weighted_reduce_kernel(d, k, "float8_e4m3fn", "int64", "bfloat16", 128, False,
                                                    vector_bytes=vector_bytes)

                def call(kernel=kernel):
                    out = torch.empty((t, d), dtype=torch.bfloat16, device=device)
                    kernel(q, sf, pos, w, out)
                    return out
            assert torch.equal(call().view(torch.int16), want.view(torch.int16)), (t, label)
            line += f"  {label} {timer.kernel_us(call):7.2f} us"
        print(line, flush=True)


if __name__ == "__main__":
    main()
