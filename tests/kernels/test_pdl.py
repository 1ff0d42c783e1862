"""kernels.pdl: a chained kernel's CUDA opens with the trigger and the wait, and
``lowering.waits_first`` (which the comm, reduce and permute compile tests use) tells a kernel
that touches memory before its wait from one that does not."""

import tilelang
from tilelang import language as T

from kernels import lowering
from kernels.pdl import chained


@tilelang.jit
def get_double_kernel(n: int, wait_first: bool):
    @T.prim_func
    def double(a: T.Tensor[(n,), "float32"], b: T.Tensor[(n,), "float32"]):
        with T.Kernel(T.ceildiv(n, 128), threads=128) as bx:
            if not wait_first:
                b[bx * 128 + T.get_thread_binding()] = 0.0  # a store before the wait
            chained()
            for i in T.Parallel(128):
                if bx * 128 + i < n:
                    b[bx * 128 + i] = a[bx * 128 + i] * 2

    return double


def test_waits_first_tells_a_store_before_the_wait():
    with lowering.compile_only():
        chained_source = lowering.kernel_source(get_double_kernel(1000, True))
        early_source = lowering.kernel_source(get_double_kernel(1000, False))
    assert "cudaGridDependencySynchronize" in chained_source and lowering.waits_first(chained_source)
    assert "cudaGridDependencySynchronize" in early_source and not lowering.waits_first(early_source)
    assert not lowering.waits_first(chained_source.replace("cudaTriggerProgrammaticLaunchCompletion();", ""))
    assert not lowering.waits_first("")  # no kernel at all
