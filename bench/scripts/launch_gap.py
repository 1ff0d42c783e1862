"""Where a small batch's last half microsecond goes (issue #3: at 128 tokens torch.compile's Triton
SwiGLU and transpose took 0.4-0.6 us less than ours under ``bench kernels``' timer). For each op
at the small shape (any of ``bench kernels``' ops) it reports, for ours, torch.compile's and the
op's tile-kernels peer, alternating ``--rounds`` times in one process:

- the timer's time (events around the call, the GPU busy before it: launch + kernel);
- the kernel's own time on the GPU (``Timer.kernel_us``: CUPTI through ``torch.profiler``, the L2
  flushed before each call as the timer does; memsets were left out before session 23): if ours
  matches Triton's here, the gap is in the launch, not the body;
- for the transpose, the same TileLang kernel launched by TileLang's Cython wrapper (which sets
  the programmatic-stream-serialization attribute on every launch) next to the default TVM-FFI one,
  and the register kernel's CTA sizes;
- for SwiGLU, one-row tiles with fewer values a thread.

    python3 bench/scripts/launch_gap.py --out $OUT/launch-gap.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ep_runtime.bench import kernels as bench


def transpose_variant(x, backend: str = "tvm_ffi", **options):
    """The transpose kernel with factory ``options``, compiled for TileLang's ``backend`` launcher."""
    import tilelang

    from kernels.transpose.batched_transpose_kernel import get_batched_transpose_kernel

    b, m, n = x.shape
    factory = get_batched_transpose_kernel
    kernel = tilelang.compile(factory.get_tir(m, n, "int16", **options), execution_backend=backend,
                              pass_configs=factory.pass_configs)

    def call():
        out = torch.empty((b, n, m), dtype=x.dtype, device=x.device)
        kernel(x.view(torch.int16), out.view(torch.int16))
        return out

    return call


def swiglu_variant(x, tile, vec):
    """The few-token SwiGLU forward with another one-row tile and vector width."""
    from kernels.quant.swiglu_kernel import get_swiglu_forward_kernel

    t, inter = x.shape[0], x.shape[1] // 2
    kernel = get_swiglu_forward_kernel(inter, "bfloat16", 128, False, False, False, True, False, tile=tile, vec=vec)
    scales, rows = torch.empty((t, -(-inter // 128)), device=x.device), torch.empty(1, dtype=torch.int32, device=x.device)

    def call():
        y = torch.empty((t, inter), dtype=x.dtype, device=x.device)
        kernel(x, y, scales, rows)
        return y

    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="batched_transpose,swiglu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device, seed, timer = bench.tuning_setup(a.iters)
    print(f"{bench.device_name(device)}  seed {seed}", flush=True)
    inp = bench.Inputs(bench.SHAPES["small"], device, seed)
    rows = []
    for case in bench.build_cases(inp, a.ops.split(","), with_peers=True):
        want = case.reference(*case.args)
        compiled = torch.compile(case.reference, dynamic=False)
        impls = {"ours": case.ours, "torch_compile": lambda: compiled(*case.args), **case.peers}
        if case.op == "swiglu":  # fewer values a thread: shorter chains of IEEE expf and divisions
            for tile, vec in [((1, 1024, 128), 8), ((1, 1024, 256), 4), ((1, 1024, 1024), 1), ((1, 512, 256), 2)]:
                impls[f"ours_{tile[1]}x{tile[2]}_vec{vec}"] = swiglu_variant(*case.args, tile, vec)
        if case.op == "batched_transpose":
            impls["ours_cython_launch"] = transpose_variant(*case.args, backend="cython")
            for threads in (32, 128, 256):
                impls[f"ours_{threads}_threads"] = transpose_variant(*case.args, register_threads=threads)
        for name, fn in impls.items():
            if name.startswith("ours"):
                checked = bench.check(fn(), want, case.exact, case.within)
                assert checked["ok"], f"{case.op}/{name} differs from the reference: {checked}"
        times = {name: {"timer_us": [], "kernel_us": []} for name in impls}
        for _ in range(a.rounds):
            for name, fn in impls.items():
                times[name]["timer_us"].append(timer.median_us(fn)[0])
                times[name]["kernel_us"].append(timer.kernel_us(fn, 50))
        for name, t in times.items():
            print(f"{case.op:18s} {name:20s} timer {statistics.median(t['timer_us']):5.2f} us  "
                  f"kernel {statistics.median(t['kernel_us']):5.2f} us", flush=True)
        rows.append({"op": case.op, "times": times})
    with open(a.out, "w") as f:
        json.dump({"device": bench.device_name(device), "seed": seed, "rounds": a.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
