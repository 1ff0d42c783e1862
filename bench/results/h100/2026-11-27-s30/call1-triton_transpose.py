"""Session 30: torch.compile's small-batch transpose, its Triton artifacts kept (TRITON_CACHE_DIR /
TORCHINDUCTOR_CACHE_DIR set by the caller) and its GPU time beside ours."""
import torch

from ep_runtime.bench import kernels as bench

device, seed, timer = bench.tuning_setup(100)
inp = bench.Inputs(bench.SHAPES["small"], device, seed)
(case,) = bench.build_cases(inp, ["batched_transpose"], with_peers=True)
compiled = torch.compile(case.reference, dynamic=False)
want = case.reference(*case.args)
assert torch.equal(compiled(*case.args), want)
assert torch.equal(case.ours(), want)
print("args", [(tuple(a.shape), a.dtype, a.stride()) for a in case.args if torch.is_tensor(a)])
for _ in range(3):
    print(f"ours {timer.kernel_us(case.ours):.3f} us   torch.compile {timer.kernel_us(lambda: compiled(*case.args)):.3f} us")
