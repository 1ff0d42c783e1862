"""The post kernel (``x'_j = post_j * f + sum_i comb[i, j] * x_i``) against the reference run on
the same GPU, the public op's choice between them, and an sm_90a compile of the DeepSeek-V4 shapes.

Tolerance: the float32 products are the same; the kernel sums them in stream order with IEEE adds,
the reference through a batched matmul (cuBLAS order, possibly FMAs) and one add, and both round
once to the output dtype. So per element
``|out - ref| <= 2 * u * (|ref| + |post_j * f| + sum_i |comb[i, j] * x_i|)`` with ``u`` the output
dtype's unit roundoff times two (2**-7 bfloat16, 2**-10 float16, 2**-23 float32). Every element is
checked; outputs start as poison (:func:`kernels.testing.poison_allocator`)."""

import pytest
import torch

from kernels import lowering, mhc
from kernels.mhc import reference
from kernels.mhc.post_kernel import get_post_kernel, post
from kernels.testing import poison_allocator

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
TOKENS = [0, 1, 130]
HIDDEN = [64, 7168, 100]
STREAMS = [1, 4]
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float32)]  # (x, f)  # fmt: skip


def post_inputs(t, n, d, *, dtype, f_dtype, device, seed):
    """Streams of mixed magnitudes, a sublayer output, post weights in (0, 2) and a doubly stochastic
    comb (a Sinkhorn of random logits), as ``split_sinkhorn`` gives them."""
    gen = torch.Generator().manual_seed(seed)
    x_TND = torch.randn(t, n, d, generator=gen) * torch.logspace(-2, 2, n)[None, :, None]
    f_TD = torch.randn(t, d, generator=gen)
    post_TN = 2 * torch.rand(t, n, generator=gen)
    comb_TNN = reference.sinkhorn(torch.randn(t, n, n, generator=gen), iters=20)
    return tuple(a.to(device) for a in (f_TD.to(f_dtype), x_TND.to(dtype), post_TN, comb_TNN))


def assert_close_to_reference(out_TND, f_TD, x_TND, post_TN, comb_TNN):
    ref_TND = reference.post(f_TD, x_TND, post_TN, comb_TNN)
    assert out_TND.dtype == ref_TND.dtype and out_TND.shape == ref_TND.shape
    assert out_TND.stride() == ref_TND.stride()
    terms_TND = torch.einsum("tij,tid->tjd", comb_TNN.double().abs(), x_TND.double().abs())
    terms_TND += (post_TN.double()[:, :, None] * f_TD.double()[:, None, :]).abs()
    bound = 2 * ULP[out_TND.dtype] * (ref_TND.double().abs() + terms_TND)
    excess = (out_TND.double() - ref_TND.double()).abs() - bound
    assert excess.numel() == 0 or float(excess.max()) <= 0, float(excess.max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,f_dtype", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
def test_matches_reference(t, d, n, dtype, f_dtype, seed):
    args = post_inputs(t, n, d, dtype=dtype, f_dtype=f_dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    assert_close_to_reference(post(*args), *args)


@pytest.mark.gpu
def test_transpose_of_comb(seed):
    """An asymmetric comb (a permutation): output stream j is input stream perm[j]."""
    f_TD, x_TND, _, _ = post_inputs(130, 4, 64, dtype=torch.float32, f_dtype=torch.float32, device="cuda", seed=seed)
    perm = [2, 0, 3, 1]
    comb_TNN = torch.zeros(130, 4, 4, device="cuda")
    for j, i in enumerate(perm):
        comb_TNN[:, i, j] = 1.0
    out_TND = post(f_TD, x_TND, torch.zeros(130, 4, device="cuda"), comb_TNN)
    assert torch.equal(out_TND, x_TND[:, perm])


@pytest.mark.gpu
def test_public_op_runs_kernel_without_grad_and_reference_with_grad(seed):
    f_TD, x_TND, post_TN, comb_TNN = post_inputs(
        130, 4, 100, dtype=torch.bfloat16, f_dtype=torch.bfloat16, device="cuda", seed=seed
    )
    assert torch.equal(mhc.post(f_TD, x_TND, post_TN, comb_TNN), post(f_TD, x_TND, post_TN, comb_TNN))
    f_TD.requires_grad_(True)
    out_TND = mhc.post(f_TD, x_TND, post_TN, comb_TNN)
    assert out_TND.grad_fn is not None
    out_TND.float().sum().backward()
    assert f_TD.grad is not None and f_TD.grad.shape == f_TD.shape
    with torch.no_grad():
        assert mhc.post(f_TD, x_TND, post_TN, comb_TNN).grad_fn is None


def test_wrapper_names_bad_arguments():
    f_TD, x_TND, post_TN, comb_TNN = post_inputs(
        3, 4, 64, dtype=torch.bfloat16, f_dtype=torch.bfloat16, device="cpu", seed=0
    )
    with pytest.raises(ValueError, match="^x_TND: expected a tensor on a CUDA device"):
        post(f_TD, x_TND, post_TN, comb_TNN)
    with pytest.raises(TypeError, match="^x_TND: expected dtype"):
        post(f_TD, x_TND.int(), post_TN, comb_TNN)


def test_public_op_on_cpu_is_the_reference():
    args = post_inputs(5, 4, 64, dtype=torch.float32, f_dtype=torch.float32, device="cpu", seed=1)
    assert torch.equal(mhc.post(*args), reference.post(*args))


def test_compiles_for_sm90a():
    """DeepSeek-V4 widths (D = 4096, 7168; N = 4) and the tiny model's D = 64, in bfloat16: 16-byte
    vector loads and stores, IEEE multiplies and adds (no FMA contraction)."""
    with lowering.compile_only():
        for d in (4096, 7168, 64):
            source = lowering.kernel_source(get_post_kernel(4, d, "bfloat16", "bfloat16"))
            assert "uint4" in source and "__fadd_rn" in source and "fma" not in source, d
