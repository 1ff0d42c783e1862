"""The post kernels (``x'_j = post_j * f + sum_i comb[i, j] * x_i`` and its backward) against the
reference run on the same GPU, the public op's choice between them, and an sm_90a compile of the DeepSeek-V4 shapes.

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
from kernels.mhc.post_kernel import get_post_backward_kernel, get_post_kernel, post, post_backward
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


def reference_grads(f_TD, x_TND, post_TN, comb_TNN, g_TND):
    leaves = [a.detach().requires_grad_() for a in (f_TD, x_TND, post_TN, comb_TNN)]
    reference.post(*leaves).backward(g_TND)
    return [a.grad for a in leaves]


def assert_backward_close(grads, f_TD, x_TND, post_TN, comb_TNN, g_TND):
    """``grad_f = sum_j post_j g_j`` and ``grad_x_i = sum_j comb[i, j] g_j``: N float32 terms in
    another order, rounded once (``2u`` of the magnitudes, as the forward); ``grad_post_j = sum_d
    g_j f`` and ``grad_comb[i, j] = sum_d x_i g_j``: float32 sums over D in another order (within
    ``D * 2**-24`` of the terms' magnitudes)."""
    want = reference_grads(f_TD, x_TND, post_TN, comb_TNN, g_TND)
    f, x, p, c, g = (a.double() for a in (f_TD, x_TND, post_TN, comb_TNN, g_TND))
    d = x_TND.shape[-1]
    terms = [torch.einsum("tj,tjd->td", p.abs(), g.abs()), torch.einsum("tij,tjd->tid", c.abs(), g.abs()),
             torch.einsum("tjd,td->tj", g.abs(), f.abs()), torch.einsum("tid,tjd->tij", x.abs(), g.abs())]
    units = [2 * ULP[f_TD.dtype], 2 * ULP[x_TND.dtype], d * 2.0**-24, d * 2.0**-24]
    for name, got, ref, term, u in zip(("f", "x", "post", "comb"), grads, want, terms, units):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        bound = u * (ref.double().abs() + term) + 1e-30
        assert bool(((got.double() - ref.double()).abs() <= bound).all()), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,f_dtype", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
def test_backward_matches_reference(t, d, n, dtype, f_dtype, seed):
    args = post_inputs(t, n, d, dtype=dtype, f_dtype=f_dtype, device="cuda", seed=seed)
    g_TND = torch.randn(t, n, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to("cuda")
    poison_allocator("cuda")
    assert_backward_close(post_backward(*args, g_TND), *args, g_TND)


@pytest.mark.gpu
def test_public_op_runs_the_kernels_forward_and_backward(seed):
    args = post_inputs(130, 4, 100, dtype=torch.bfloat16, f_dtype=torch.bfloat16, device="cuda", seed=seed)
    assert torch.equal(mhc.post(*args), post(*args))
    leaves = [a.clone().requires_grad_() for a in args]
    out_TND = mhc.post(*leaves)
    assert type(out_TND.grad_fn).__name__ == "_PostBackward" and torch.equal(out_TND, post(*args))
    g_TND = torch.randn_like(out_TND)
    out_TND.backward(g_TND)
    assert_backward_close([a.grad for a in leaves], *args, g_TND)


def test_wrapper_names_bad_arguments():
    f_TD, x_TND, post_TN, comb_TNN = post_inputs(
        3, 4, 64, dtype=torch.bfloat16, f_dtype=torch.bfloat16, device="cpu", seed=0
    )
    with pytest.raises(ValueError, match="^x_TND: expected a tensor on a CUDA device"):
        post(f_TD, x_TND, post_TN, comb_TNN)
    with pytest.raises(TypeError, match="^x_TND: expected dtype"):
        post(f_TD, x_TND.int(), post_TN, comb_TNN)


def test_public_op_runs_the_kernel_only_where_selected(stub_kernel, monkeypatch):
    args = post_inputs(5, 4, 64, dtype=torch.float32, f_dtype=torch.float32, device="cpu", seed=1)
    marker = torch.full((5, 4, 64), 3.0)
    calls = stub_kernel(mhc.post_kernel, "post", marker)
    assert torch.equal(mhc.post(*args), reference.post(*args)) and not calls
    monkeypatch.setattr(mhc, "use_tilelang", lambda device: True)
    assert torch.equal(mhc.post(*args), marker) and len(calls) == 1


def test_compiles_for_sm90a():
    """DeepSeek-V4 widths (D = 4096, 7168; N = 4) and the tiny model's D = 64, in bfloat16: 16-byte
    vector loads and stores; the forward in IEEE multiplies and adds (no FMA contraction: the
    reference's bits), the backward's products free to contract (held to a reassociation bound)."""
    with lowering.compile_only():
        for d in (4096, 7168, 64):
            source = lowering.kernel_source(get_post_kernel(4, d, "bfloat16", "bfloat16"))
            assert "uint4" in source and "__fadd_rn" in source and "fma" not in source, d
        for n, d, dtype, f_dtype in [(4, 4096, "bfloat16", "bfloat16"), (4, 7168, "bfloat16", "bfloat16"),
                                     (4, 64, "bfloat16", "bfloat16"), (1, 100, "float32", "float32"),
                                     (4, 4096, "bfloat16", "float32")]:
            source = lowering.kernel_source(get_post_backward_kernel(n, d, dtype, f_dtype))
            assert "warp_reduce_sum" in source and "__fmul_rn" not in source, (n, d)
