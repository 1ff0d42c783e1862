"""The split + Sinkhorn kernels (forward, and the backward to the mixes', scale's and base's
gradients) against the reference run on the same GPU, the public op's use of them, and sm_90a
compiles of every lane layout.

Tolerance: both compute in float32 with the same operations per entry, but the kernel sums rows
and columns over lanes in another order (a butterfly, or lane order) and its ``expf`` may differ
from ``torch.exp`` by an ulp; 39 normalizations carry that along, and entries stay within
``1e-5`` (coefficients in [0, 2]; the comb is doubly stochastic, entries in [0, 1]). Gradients
within ``1e-4`` of their largest magnitude (or of 1): the backward walks the 39 steps back,
dividing by sums near 1, and ``grad_scale``/``grad_base`` sum over the tokens in blocks of a CTA's
tokens where the reference sums them whole, which adds at most ``depth * 2**-24`` of the sum of
the terms' magnitudes; ``assert_grads_close`` adds that bound (with the kernel's depth: a CTA's
tokens, a third's mixes and the ``sum(0)`` over CTAs, each summed in order)."""

import math
import shutil
import subprocess

import pytest
import torch

from kernels import lowering, mhc
from kernels.mhc import functions, reference
from kernels.mhc.split_sinkhorn_kernel import (
    MAX_STREAMS,
    get_split_sinkhorn_backward_kernel,
    get_split_sinkhorn_kernel,
    lanes_for,
    split_sinkhorn,
    split_sinkhorn_backward,
    supports,
    tokens_per_cta,
)
from kernels.testing import poison_allocator

OPTIONS = dict(pre_eps=1e-6, post_mult=2.0, sinkhorn_eps=1e-6, iters=20)
# Every lane layout: one lane a token (N = 1), butterflies (2, 4), lane-order shuffles (3), a
# padding row (7), two rows a lane (8).
STREAMS = [1, 2, 3, 4, 7, 8]
TOKENS = [0, 1, 37, 130, 8192]  # 37, 130: not multiples of a CTA's tokens (8 at N = 4, 12 at N = 3)


def split_inputs(t, n, *, device, seed):
    gen = torch.Generator().manual_seed(seed)
    m = n * (n + 2)
    mixes_TM = torch.randn(t, m, generator=gen) * 2
    scale_3 = torch.rand(3, generator=gen) + 0.5
    base_M = torch.randn(m, generator=gen) * 0.1
    return mixes_TM.to(device), scale_3.to(device), base_M.to(device)


def output_grads(t, n, *, device, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen), torch.randn(t, n, n, generator=gen)]
    return [g.to(device) for g in grads]


def reference_grads(args, grads_out, **options):
    leaves = [a.clone().requires_grad_() for a in args]
    torch.autograd.backward(reference.split_sinkhorn(*leaves, **options), grads_out)
    return [a.grad for a in leaves]


def assert_grads_close(got, want, mixes_TM, scale_3):
    """``(grad_mixes, grad_scale, grad_base)`` within ``1e-4`` of the largest (or 1), plus for the
    two sums over tokens the bound of summing them in another order (module doc)."""
    t, m = mixes_TM.shape
    n = math.isqrt(m + 1) - 1
    da_TM = want[0].double() / functions.mix_scale(scale_3.double(), n)  # grad_mixes = da * scale_M
    terms_TM = (da_TM * mixes_TM.double()).abs()
    magnitudes = (torch.stack([terms_TM[:, :n].sum(), terms_TM[:, n:2 * n].sum(), terms_TM[:, 2 * n:].sum()]),
                  da_TM.abs().sum(0))
    depth = tokens_per_cta(lanes_for(n)) + n * n + -(-t // tokens_per_cta(lanes_for(n)))
    for name, g, w, sums in zip(("mixes", "scale", "base"), got, want, (0.0, *magnitudes)):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        bound = 1e-4 * max(float(w.abs().max()) if w.numel() else 0.0, 1.0) + depth * 2.0**-24 * sums
        excess = (g.double() - w.double()).abs() - bound
        assert excess.numel() == 0 or float(excess.max()) <= 0, (name, float(excess.max()))


@pytest.mark.gpu
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("t", TOKENS)
def test_forward_matches_reference(t, n, seed):
    args = split_inputs(t, n, device="cuda", seed=seed)
    poison_allocator("cuda")
    for got, want in zip(split_sinkhorn(*args, **OPTIONS), reference.split_sinkhorn(*args, **OPTIONS)):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert got.numel() == 0 or float((got - want).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("t", TOKENS)
def test_backward_matches_reference(t, n, seed):
    args = split_inputs(t, n, device="cuda", seed=seed)
    grads_out = output_grads(t, n, device="cuda", seed=seed)
    poison_allocator("cuda")
    got = split_sinkhorn_backward(*args, *grads_out, post_mult=2.0, sinkhorn_eps=1e-6, iters=20)
    assert_grads_close(got, reference_grads(args, grads_out, **OPTIONS), *args[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("n, iters, eps", [(7, 1, 0.0), (4, 3, 0.0), (3, 2, 1e-3)])
def test_iterations_and_eps(n, iters, eps, seed):
    """One or a few iterations, and eps = 0 (the padding row of N = 7 keeps a divisor of 1)."""
    options = dict(OPTIONS, iters=iters, sinkhorn_eps=eps)
    args = split_inputs(130, n, device="cuda", seed=seed)
    grads_out = output_grads(130, n, device="cuda", seed=seed)
    for got, want in zip(split_sinkhorn(*args, **options), reference.split_sinkhorn(*args, **options)):
        assert float((got - want).abs().max()) <= 1e-5
    got = split_sinkhorn_backward(*args, *grads_out, post_mult=2.0, sinkhorn_eps=eps, iters=iters)
    assert_grads_close(got, reference_grads(args, grads_out, **options), *args[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 7])
@pytest.mark.parametrize("t", [1, 130])
def test_public_op_gradients_match_reference(t, n, seed):
    args = split_inputs(t, n, device="cuda", seed=seed)
    grads_out = output_grads(t, n, device="cuda", seed=seed)
    leaves = [a.clone().requires_grad_() for a in args]
    outs = mhc.split_sinkhorn(*leaves, **OPTIONS)
    assert type(outs[0].grad_fn).__name__ == "_SplitSinkhornBackward"
    torch.autograd.backward(outs, grads_out)
    assert_grads_close([a.grad for a in leaves], reference_grads(args, grads_out, **OPTIONS), *args[:2])


def test_wrapper_names_bad_arguments():
    args = split_inputs(3, 4, device="cpu", seed=0)
    with pytest.raises(ValueError, match="^mixes_TM: expected a tensor on a CUDA device"):
        split_sinkhorn(*args, **OPTIONS)


def test_public_op_runs_the_kernel_only_where_selected(stub_kernel, monkeypatch):
    args = split_inputs(5, 4, device="cpu", seed=1)
    marker = (torch.full((5, 4), 1.0), torch.full((5, 4), 2.0), torch.full((5, 4, 4), 3.0))
    calls = stub_kernel(mhc.split_sinkhorn_kernel, "split_sinkhorn", marker)
    got, want = mhc.split_sinkhorn(*args, **OPTIONS), reference.split_sinkhorn(*args, **OPTIONS)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want)) and not calls
    monkeypatch.setattr(mhc, "use_tilelang", lambda device: True)
    got = mhc.split_sinkhorn(*args, **OPTIONS)
    assert all(torch.equal(a, b) for a, b in zip(got, marker)) and len(calls) == 1
    assert calls[0][1] == OPTIONS


def test_supports_float32_up_to_eight_streams():
    for n in range(1, MAX_STREAMS + 2):
        assert supports(*split_inputs(2, n, device="cpu", seed=n)) == (n <= MAX_STREAMS), n
    assert not supports(*(a.double() for a in split_inputs(2, 4, device="cpu", seed=0)))


def test_lanes_cover_each_token_in_one_warp():
    """A token's lanes hold every row (at most one padding row a lane) and fit one warp."""
    for n in range(1, MAX_STREAMS + 1):
        lay = lanes_for(n)
        assert lay.width <= 32 and lay.tokens >= 1, n
        assert lay.rows * lay.groups >= n > (lay.rows - 1) * lay.groups, n


def ptxas_usage(kernel, path) -> tuple[int, str]:
    """``(registers, ptxas' report)`` of the kernel's PTX for sm_90a."""
    kernel.export_ptx(str(path))
    report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(path), "-o", "/dev/null"], capture_output=True,
                            text=True, check=True).stderr
    return int(report.split(" registers")[0].rsplit("Used ", 1)[1]), report


@pytest.mark.parametrize("n", STREAMS)
def test_compiles_for_sm90a(n, tmp_path):
    """20 iterations (the runtime's): IEEE arithmetic and ``expf``; shuffles by butterfly for
    power-of-two groups, in lane order otherwise, none at N = 1; the backward's history in
    registers (no ``.local`` in the PTX, no spills), N = 4's within 64 of them (8 CTAs an SM)."""
    with lowering.compile_only():
        forward = get_split_sinkhorn_kernel(n, 20, 1e-6, 2.0, 1e-6)
        backward = get_split_sinkhorn_backward_kernel(n, 20, 2.0, 1e-6)
    for kernel in (forward, backward):
        source = lowering.kernel_source(kernel)
        assert "expf" in source and "__fdiv_rn" in source
        assert ("__shfl_xor_sync" in source) == (n in (2, 4, 8))
        assert ("__shfl_sync" in source) == (n in (3, 7))
    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas")
    registers, report = ptxas_usage(backward, tmp_path / "backward.ptx")
    assert ".local" not in (tmp_path / "backward.ptx").read_text()
    assert "0 bytes spill stores" in report, report
    assert n != 4 or registers <= 64, report
