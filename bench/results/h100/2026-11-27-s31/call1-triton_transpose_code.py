"""Session 31: torch.compile's small transpose, its inductor code printed (TORCH_LOGS=output_code)
and its Triton cache kept by the caller."""
import torch

from ep_runtime.bench import kernels as bench

device, seed, timer = bench.tuning_setup(20)
inp = bench.Inputs(bench.SHAPES["small"], device, seed)
(case,) = bench.build_cases(inp, ["batched_transpose"], with_peers=True)
compiled = torch.compile(case.reference, dynamic=False)
assert torch.equal(compiled(*case.args), case.reference(*case.args))
