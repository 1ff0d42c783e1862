"""The inference-only fused pre kernel (norm + projection, split + Sinkhorn, pre-apply in one launch)
against the reference's ``pre_fused`` on the same GPU inputs, the public op's choice, and an sm_90a
compile of the runtime's shapes.

Tolerance: :func:`kernels.mhc.pre_fused_kernel.within_tolerance` (the benchmark's check uses it
too)."""

import pytest
import torch

from kernels import lowering, mhc
from kernels.mhc import pre_fused_kernel, reference
from kernels.mhc.pre_fused_kernel import get_pre_fused_kernel, pre_fused, within_tolerance
from kernels.testing import poison_allocator, spy

CASES = [  # (T, N, D, dtype, tf32)
    (0, 4, 64, torch.bfloat16, False),
    (1, 4, 64, torch.float32, False),
    (37, 1, 100, torch.float16, False),
    (130, 4, 4096, torch.bfloat16, False),
    (67, 4, 7168, torch.float32, True),
    (33, 2, 300, torch.bfloat16, True),
]


def inputs(t, n, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    m = n * (n + 2)
    x_TND = torch.randn(t, n, d, generator=gen).to(dtype)
    fn_MK = torch.randn(m, n * d, generator=gen) / (n * d) ** 0.5
    scale_3 = torch.rand(3, generator=gen) + 0.5
    base_M = torch.randn(m, generator=gen) * 0.5
    return [a.cuda() for a in (x_TND, fn_MK, scale_3, base_M)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,d,dtype,tf32", CASES)
def test_matches_reference(t, n, d, dtype, tf32, seed):
    args = inputs(t, n, d, dtype, seed)
    want = reference.pre_fused(*args, tf32=tf32)
    poison_allocator("cuda")
    y, post, comb = pre_fused(*args, norm_eps=1e-6, pre_eps=1e-6, post_mult=2.0, sinkhorn_eps=1e-6, iters=20,
                              tf32=tf32)
    assert y.dtype == dtype and y.shape == want[0].shape
    assert within_tolerance(args[0], (y, post, comb), want)


@pytest.mark.gpu
def test_public_op_runs_the_fused_kernel_for_float32(monkeypatch, seed):
    calls = spy(monkeypatch, pre_fused_kernel, "pre_fused")
    args = inputs(67, 4, 7168, torch.float32, seed)
    assert within_tolerance(args[0], mhc.pre_fused(*args), reference.pre_fused(*args))
    assert len(calls) == 1


@pytest.mark.gpu
def test_public_op_is_inference_only(seed):
    x, fn, scale, base = inputs(5, 4, 64, torch.bfloat16, seed)
    with torch.no_grad():
        y, _, _ = mhc.pre_fused(x, fn.requires_grad_(), scale, base)
    assert y.shape == (5, 64)
    with pytest.raises(ValueError, match="^fn_MK: pre_fused is inference-only"):
        mhc.pre_fused(x, fn, scale, base)


@pytest.mark.gpu
def test_public_op_takes_the_tensor_cores_for_bfloat16(monkeypatch, seed):
    """bfloat16 streams run pre()'s kernels (norm_fn on the tensor cores), not the fused walk."""
    from kernels.mhc import norm_fn_kernel, pre_apply_kernel, split_sinkhorn_kernel

    monkeypatch.setattr(pre_fused_kernel, "pre_fused", lambda *a, **k: pytest.fail("the fused walk ran"))
    calls = [spy(monkeypatch, norm_fn_kernel, "norm_fn"), spy(monkeypatch, split_sinkhorn_kernel, "split_sinkhorn"),
             spy(monkeypatch, pre_apply_kernel, "pre_apply")]
    args = inputs(130, 4, 4096, torch.bfloat16, seed)
    assert within_tolerance(args[0], mhc.pre_fused(*args), reference.pre_fused(*args))
    assert [len(c) for c in calls] == [1, 1, 1]


def test_compiles_for_sm90a():
    """DeepSeek-V4 widths (N = 4; D = 4096 bf16, 7168 float32) and the tiny model's D = 64."""
    with lowering.compile_only():
        for n, d, dtype in ((4, 4096, "bfloat16"), (4, 7168, "float32"), (4, 64, "bfloat16")):
            source = lowering.kernel_source(get_pre_fused_kernel(n, d, dtype, 1e-6, 1e-6, 2.0, 1e-6, 20))
            assert "comb_TNN" in source and "warp_reduce_sum" in source, (n, d, dtype)
