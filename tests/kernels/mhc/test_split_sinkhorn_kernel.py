"""The split + Sinkhorn kernels (forward, and the backward to ``a = mixes * scale_M + base``)
against the reference run on the same GPU, the public ops' use of them, and an sm_90a compile.

Tolerance: both compute in float32 with the same operations in the same order per entry, but the
kernel's ``expf`` and the reference's ``torch.exp``/``sigmoid`` may differ by an ulp, and 39
normalizations carry that along; entries are within ``1e-5`` (coefficients in [0, 2]; the comb is
doubly stochastic, entries in [0, 1]). Gradients within ``1e-4`` of their largest magnitude (the
backward walks the 39 steps back, dividing by sums near 1)."""

import pytest
import torch

from kernels import lowering, mhc
from kernels.mhc import reference
from kernels.mhc.split_sinkhorn_kernel import (
    get_split_sinkhorn_backward_kernel,
    get_split_sinkhorn_kernel,
    split_sinkhorn,
)

OPTIONS = dict(pre_eps=1e-6, post_mult=2.0, sinkhorn_eps=1e-6, iters=20)


def split_inputs(t, n, *, device, seed):
    gen = torch.Generator().manual_seed(seed)
    m = n * (n + 2)
    mixes_TM = torch.randn(t, m, generator=gen) * 2
    scale_3 = torch.rand(3, generator=gen) + 0.5
    base_M = torch.randn(m, generator=gen) * 0.1
    return mixes_TM.to(device), scale_3.to(device), base_M.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("t", [0, 1, 130, 8192])
def test_forward_matches_reference(t, n, seed):
    args = split_inputs(t, n, device="cuda", seed=seed)
    for got, want in zip(split_sinkhorn(*args, **OPTIONS), reference.split_sinkhorn(*args, **OPTIONS)):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert got.numel() == 0 or float((got - want).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("t", [1, 130])
def test_public_op_gradients_match_reference(t, n, seed):
    args = split_inputs(t, n, device="cuda", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grads_out = [torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen), torch.randn(t, n, n, generator=gen)]
    grads_out = [g.to("cuda") for g in grads_out]

    def grads(op):
        leaves = [a.clone().requires_grad_() for a in args]
        outs = op(*leaves, **OPTIONS)
        torch.autograd.backward(outs, grads_out)
        return outs, [a.grad for a in leaves]

    outs, got = grads(mhc.split_sinkhorn)
    assert type(outs[0].grad_fn).__name__ == "_SplitSinkhornBackward"
    _, want = grads(reference.split_sinkhorn)
    for name, g, w in zip(("mixes", "scale", "base"), got, want):
        assert g.shape == w.shape and float((g - w).abs().max()) <= 1e-4 * max(float(w.abs().max()), 1.0), name


def test_wrapper_names_bad_arguments():
    args = split_inputs(3, 4, device="cpu", seed=0)
    with pytest.raises(ValueError, match="^mixes_TM: expected a tensor on a CUDA device"):
        split_sinkhorn(*args, **OPTIONS)


def test_public_op_on_cpu_is_the_reference():
    args = split_inputs(5, 4, device="cpu", seed=1)
    for got, want in zip(mhc.split_sinkhorn(*args, **OPTIONS), reference.split_sinkhorn(*args, **OPTIONS)):
        assert torch.equal(got, want)


def test_compiles_for_sm90a():
    """N = 4 (DeepSeek-V4) and 1, 20 iterations: one thread per token, IEEE arithmetic, ``expf``."""
    with lowering.compile_only():
        for n in (4, 1):
            source = lowering.kernel_source(get_split_sinkhorn_kernel(n, 20, 1e-6, 2.0, 1e-6))
            assert "expf" in source and "__fdiv_rn" in source, n
            source = lowering.kernel_source(get_split_sinkhorn_backward_kernel(n, 20, 2.0, 1e-6))
            assert "expf" in source and "outs" in source, n
