"""Session 30: each small-transpose variant once after the bench's L2 flush, inside a profiler range
(for Nsight Compute's launch statistics: the L1 / shared-memory split each kernel ran with)."""
import torch

from ep_runtime.bench import kernels as bench
from transpose_smem import VARIANTS, get_register_smem

device, seed, timer = bench.tuning_setup(10)
inp = bench.Inputs(bench.SHAPES["small"], device, seed)
(case,) = bench.build_cases(inp, ["batched_transpose"], with_peers=True)
compiled = torch.compile(case.reference, dynamic=False)
s = inp.shape
x = inp.x_TD.view(s.transpose_batch, s.tokens // s.transpose_batch, s.hidden).view(torch.uint16)
out = torch.empty((x.shape[0], x.shape[2], x.shape[1]), dtype=x.dtype, device=x.device)
fns = {"ours": case.ours, "torch.compile": lambda: compiled(*case.args)}
fns |= {name: (lambda k=get_register_smem(x.shape[1], x.shape[2], **kw): k(x, out)) for name, kw in VARIANTS.items()}
for fn in fns.values():
    for _ in range(3):
        fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for name, fn in fns.items():
    timer.flush()
    fn()
    torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("order:", list(fns))
