"""Session 29: the small batch's weighted_reduce_fp8 (128 tokens, top-8, hidden 7168, e4m3 rows of
the expert-major layout) and a device copy of the same bytes, each launched a few times for Nsight
Compute (run under ncu; it flushes the caches before each profiled kernel)."""
import sys

import torch

sys.path.insert(0, "bench/scripts")
from reduce_vectors import positions  # noqa: E402

from kernels.reduce import weighted_reduce  # noqa: E402

torch.manual_seed(0)
gen = torch.Generator("cuda").manual_seed(0)
t, k, d = 128, 8, 7168
pos = positions("layout", t, k, gen, "cuda").int()
rows = int(pos.max()) + 1
y = torch.randn(rows, d, device="cuda").to(torch.float8_e4m3fn)
sf = torch.rand(rows, d // 128, device="cuda") + 0.5
w = torch.rand(t, k, device="cuda")
routed = int((pos >= 0).sum())
moved = routed * d + t * d * 2 + routed * (d // 128) * 4
src = torch.empty(moved // 2 // 16 * 16, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
for _ in range(6):
    weighted_reduce(y, pos, w, sf_PG=sf)
    dst.copy_(src)
torch.cuda.synchronize()
print(f"routed rows {routed}, bytes {moved / 1e6:.2f} MB, copy of {src.numel() / 1e6:.2f} MB each way")
