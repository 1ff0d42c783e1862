"""kernels.scan.block_scan: a CTA's inclusive prefix sums against torch.cumsum (every CTA size the
bookkeeping kernels use, several values a thread), its bad sizes, and sm_90a compile."""

import pytest
import tilelang
import torch
from tilelang import language as T

from kernels import lowering
from kernels.scan import HAND_SYNC_CONFIGS, WARP, block_scan


@tilelang.jit(pass_configs=HAND_SYNC_CONFIGS)
def scan_kernel(threads: int, count: int):
    """``(values_XS, sums_XS)`` for one CTA of ``threads`` threads: thread x scans ``values_XS[x]``."""
    scan = block_scan(count, threads // WARP)

    @T.prim_func
    def kernel(values_XS: T.Tensor[(threads, count), T.int32], sums_XS: T.Tensor[(threads, count), T.int32]):
        with T.Kernel(1, threads=threads):
            x = T.get_thread_binding()
            values_S = T.alloc_local((count,), T.int32)
            totals_SY = T.alloc_shared((count, threads // WARP), T.int32)
            for s in T.unroll(count):
                values_S[s] = values_XS[x, s]
            scan(values_S, totals_SY, x)
            for s in T.unroll(count):
                sums_XS[x, s] = values_S[s]

    return kernel


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 64, 256, 1024])
@pytest.mark.parametrize("count", [1, 3])
def test_inclusive_sums(threads, count, seed):
    values = torch.randint(-1000, 1000, (threads, count), dtype=torch.int32)
    sums = torch.full_like(values, -7).cuda()
    scan_kernel(threads, count)(values.cuda(), sums)
    assert torch.equal(sums.cpu(), values.cumsum(0, dtype=torch.int32))


@pytest.mark.parametrize("warps", [0, 33])
def test_warps_out_of_range(warps):
    with pytest.raises(ValueError, match="warps"):
        block_scan(1, warps)


def test_compiles_for_sm90a():
    with lowering.compile_only():
        source = lowering.kernel_source(scan_kernel(1024, 2))
    assert "__shfl_up_sync" in source and source.count("__syncthreads") == 2
