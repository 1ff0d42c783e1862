"""Session 31: torch.compile's kernels for some ops at a bench shape, their inductor code printed
(run with TORCH_LOGS=output_code): python3 triton_ops.py SHAPE OP..."""
import sys

import torch

from ep_runtime.bench import kernels as bench

device, seed, timer = bench.tuning_setup(20)
inp = bench.Inputs(bench.SHAPES[sys.argv[1]], device, seed)
for case in bench.build_cases(inp, sys.argv[2:], with_peers=True):
    print(f"### {case.op}", flush=True)
    torch.compile(case.reference, dynamic=False)(*case.args)
    torch.cuda.synchronize()
