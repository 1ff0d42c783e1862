"""The pre-apply kernels (``y = sum_i pre_i * x_i`` and its backward) against the reference run on
the same GPU, the public op's choice between them, and an sm_90a compile of the DeepSeek-V4 shapes.

Tolerance: both compute the same float32 products; the kernel sums them over the streams in order
with IEEE adds, the reference in whatever order its CUDA reduction takes, then both round once to
the output dtype. So per element ``|y - y_ref| <= 2 * u * (|y_ref| + sum_i |pre_i * x_i|)``, with
``u`` the output dtype's unit roundoff times two (2**-7 bfloat16, 2**-10 float16, 2**-23 float32):
one output rounding step plus the reassociation of N float32 adds. Every element is checked;
outputs start as poison (:func:`kernels.testing.poison_allocator`)."""

import pytest
import torch

from kernels import lowering, mhc
from kernels.mhc import reference
from kernels.mhc.pre_apply_kernel import get_pre_apply_backward_kernel, get_pre_apply_kernel, pre_apply, pre_apply_backward
from kernels.testing import poison_allocator

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
TOKENS = [0, 1, 130]
HIDDEN = [64, 7168, 100]
STREAMS = [1, 4]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def pre_apply_inputs(t, n, d, *, dtype, device, seed):
    """Streams of mixed magnitudes and positive pre weights (as ``sigmoid + eps`` gives)."""
    gen = torch.Generator().manual_seed(seed)
    x_TND = torch.randn(t, n, d, generator=gen) * torch.logspace(-2, 2, n)[None, :, None]
    pre_TN = torch.rand(t, n, generator=gen) + 1e-6
    return x_TND.to(dtype).to(device), pre_TN.to(device)


def assert_close_to_reference(y_TD, x_TND, pre_TN):
    y_ref = reference.pre_apply(x_TND, pre_TN)
    assert y_TD.dtype == y_ref.dtype and y_TD.shape == y_ref.shape and y_TD.stride() == y_ref.stride()
    terms = (pre_TN.double()[:, :, None] * x_TND.double()).abs().sum(1)
    bound = 2 * ULP[y_TD.dtype] * (y_ref.double().abs() + terms)
    excess = (y_TD.double() - y_ref.double()).abs() - bound
    assert excess.numel() == 0 or float(excess.max()) <= 0, float(excess.max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
def test_matches_reference(t, d, n, dtype, seed):
    x_TND, pre_TN = pre_apply_inputs(t, n, d, dtype=dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    assert_close_to_reference(pre_apply(x_TND, pre_TN), x_TND, pre_TN)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widest_stream_count(dtype, seed):
    """32 streams, the most the kernel takes: its shared-memory staging is then 64 KB a CTA, past
    the 48 KB a launch gets without asking."""
    x_TND, pre_TN = pre_apply_inputs(130, 32, 4096, dtype=dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    assert_close_to_reference(pre_apply(x_TND, pre_TN), x_TND, pre_TN)


@pytest.mark.gpu
def test_strided_input_is_copied(seed):
    x_TND, pre_TN = pre_apply_inputs(130, 4, 7168 + 8, dtype=torch.bfloat16, device="cuda", seed=seed)
    x_TND = x_TND[:, :, 8:]  # not contiguous, not 16-byte aligned rows
    poison_allocator("cuda")
    assert_close_to_reference(pre_apply(x_TND, pre_TN), x_TND, pre_TN)


def reference_grads(x_TND, pre_TN, g_TD):
    x, pre = x_TND.detach().requires_grad_(), pre_TN.detach().requires_grad_()
    reference.pre_apply(x, pre).backward(g_TD)
    return x.grad, pre.grad


def assert_backward_close(grad_x_TND, grad_pre_TN, x_TND, pre_TN, g_TD):
    """``grad_x = pre_i * g``: one float32 multiply rounded once, the reference's bits. ``grad_pre
    = sum_d g * x_i`` in float32, summed in another order: within ``D * 2**-24`` of the sum of
    the terms' magnitudes (the reassociation bound)."""
    want_x, want_pre = reference_grads(x_TND, pre_TN, g_TD)
    assert grad_x_TND.dtype == want_x.dtype and torch.equal(grad_x_TND, want_x)
    terms_TN = (x_TND.double() * g_TD.double()[:, None, :]).abs().sum(-1)
    bound = x_TND.shape[-1] * 2.0**-24 * terms_TN + 1e-30
    assert grad_pre_TN.dtype == torch.float32
    assert bool(((grad_pre_TN.double() - want_pre.double()).abs() <= bound).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
def test_backward_matches_reference(t, d, n, dtype, seed):
    x_TND, pre_TN = pre_apply_inputs(t, n, d, dtype=dtype, device="cuda", seed=seed)
    g_TD = torch.randn(t, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to("cuda")
    poison_allocator("cuda")
    assert_backward_close(*pre_apply_backward(x_TND, pre_TN, g_TD), x_TND, pre_TN, g_TD)


@pytest.mark.gpu
def test_public_op_runs_the_kernels_forward_and_backward(seed):
    x_TND, pre_TN = pre_apply_inputs(130, 4, 100, dtype=torch.bfloat16, device="cuda", seed=seed)
    assert torch.equal(mhc.pre_apply(x_TND, pre_TN), pre_apply(x_TND, pre_TN))
    x, pre = x_TND.clone().requires_grad_(), pre_TN.clone().requires_grad_()
    y_TD = mhc.pre_apply(x, pre)
    assert type(y_TD.grad_fn).__name__ == "_PreApplyBackward" and torch.equal(y_TD, pre_apply(x_TND, pre_TN))
    g_TD = torch.randn_like(y_TD)
    y_TD.backward(g_TD)
    assert_backward_close(x.grad, pre.grad, x_TND, pre_TN, g_TD)


def test_wrapper_names_bad_arguments():
    x_TND, pre_TN = pre_apply_inputs(3, 4, 64, dtype=torch.bfloat16, device="cpu", seed=0)
    with pytest.raises(ValueError, match="^x_TND: expected a tensor on a CUDA device"):
        pre_apply(x_TND, pre_TN)
    with pytest.raises(TypeError, match="^x_TND: expected dtype"):
        pre_apply(x_TND.int(), pre_TN)


def test_public_op_runs_the_kernel_only_where_selected(stub_kernel, monkeypatch):
    x_TND, pre_TN = pre_apply_inputs(5, 4, 64, dtype=torch.float32, device="cpu", seed=1)
    marker = torch.full((5, 64), 3.0)
    calls = stub_kernel(mhc.pre_apply_kernel, "pre_apply", marker)
    assert torch.equal(mhc.pre_apply(x_TND, pre_TN), reference.pre_apply(x_TND, pre_TN)) and not calls
    monkeypatch.setattr(mhc, "use_tilelang", lambda device: True)
    assert torch.equal(mhc.pre_apply(x_TND, pre_TN), marker) and len(calls) == 1
    assert torch.equal(mhc.pre_apply(x_TND.double(), pre_TN.double()), reference.pre_apply(x_TND.double(),
                       pre_TN.double())) and len(calls) == 1  # float64: a dtype the kernel does not take


def test_compiles_for_sm90a():
    """DeepSeek-V4 widths (D = 4096, 7168; N = 4) and the tiny model's D = 64, in bfloat16: 16-byte
    vector loads and streaming stores, IEEE multiplies and adds (no FMA contraction), staged in shared
    memory; loads past L1 where a stream's row is a power of two of bytes (4096 and 64), through it
    otherwise (7168). D = 100 in float16 (8-byte vectors) takes plain moves."""
    with lowering.compile_only():
        for d, past_l1 in ((4096, True), (7168, False), (64, True)):
            source = lowering.kernel_source(get_pre_apply_kernel(4, d, "bfloat16"))
            assert "__fadd_rn" in source and "fma" not in source and "buf_dyn_shmem" in source, d
            assert "st.global.cs.v4" in source, d
            assert ("ld.global.nc.L1::no_allocate.v4" in source) == past_l1, d
            assert ("= *(uint4*)(x_TND" in source) == (not past_l1), d
        source = lowering.kernel_source(get_pre_apply_kernel(4, 100, "float16"))
        assert "st.global" not in source and "uint2" in source
        for n, d, dtype in [(4, 4096, "bfloat16"), (4, 7168, "bfloat16"), (4, 64, "bfloat16"), (1, 100, "float32")]:
            source = lowering.kernel_source(get_pre_apply_backward_kernel(n, d, dtype, dtype))
            assert "warp_reduce_sum" in source and "__fmul_rn" in source and "fma" not in source, (n, d)
