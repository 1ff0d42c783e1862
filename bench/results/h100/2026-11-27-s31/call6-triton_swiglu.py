"""Session 31: torch.compile's small SwiGLU, its inductor code printed (TORCH_LOGS=output_code)."""
import torch

from ep_runtime.bench import kernels as bench

device, seed, timer = bench.tuning_setup(20)
inp = bench.Inputs(bench.SHAPES["small"], device, seed)
(case,) = bench.build_cases(inp, ["swiglu"], with_peers=True)
compiled = torch.compile(case.reference, dynamic=False)
out = compiled(*case.args)
