"""The norm + projection kernels (``mixes = (flat @ fn.T) * rsqrt(mean(flat^2) + eps)``) against the
reference in float64 on the same inputs, the public op's kernel path forward and backward, and an
sm_90a compile of the runtime's shapes.

Tolerance: a float32 sum of n terms is within ``n * u * sum |terms|`` of the exact one (``u =
2**-24``). The CUDA-core forward (float32 streams) sums ``K = N*D`` products; the tensor-core
forward sums the exact products of the streams' bfloat16 parts (one for bfloat16, two for float16
elements) with ``fn``'s three, ``3K`` or ``6K`` terms, and the tensor cores' float32 adds may
truncate, so twice that. The bound per element is that, scaled by rstd, plus rstd's error (a
float32 sum of K squares). Outputs start as poison
(:func:`kernels.testing.poison_allocator`)."""

import pytest
import torch

from kernels import lowering, mhc
from kernels.mhc import functions, reference
from kernels.mhc.norm_fn_kernel import (
    backward_chunks,
    get_fn_parts_kernel,
    get_norm_fn_backward_kernel,
    get_norm_fn_backward_mma_kernel,
    get_norm_fn_kernel,
    get_norm_fn_mma_kernel,
    MMA_STREAMS,
    X_PARTS,
    norm_fn,
    norm_fn_backward,
)
from kernels.tiles import tl_dtype
from kernels.testing import poison_allocator, spy

CASES = [  # (T, N, D, M, dtype, tf32)
    (0, 4, 64, 24, torch.bfloat16, False),
    (1, 4, 64, 24, torch.float32, False),
    (17, 1, 100, 3, torch.float16, False),  # K not a multiple of the chunk; head-like M
    (130, 4, 4096, 24, torch.bfloat16, False),
    (67, 4, 7168, 24, torch.float32, True),
    (33, 2, 300, 8, torch.bfloat16, True),
    (200, 1, 100, 3, torch.bfloat16, False),  # the tensor-core kernel: rows not 16-byte aligned, T past a tile
    (8192, 4, 7168, 24, torch.bfloat16, False),  # the bench's shape
    (130, 2, 300, 8, torch.float32, False),  # float32 / float16 in exact bfloat16 parts: K past a chunk, T past a tile
    (200, 4, 4096, 24, torch.float16, False),
    (1000, 4, 4096, 24, torch.float32, False),
]


def inputs(t, n, d, m, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x_TND = (torch.randn(t, n, d, generator=gen) * torch.logspace(-1, 1, n)[None, :, None]).to(dtype)
    fn_MK = torch.randn(m, n * d, generator=gen) / (n * d) ** 0.5
    return x_TND.cuda(), fn_MK.cuda()


def assert_close(mixes_TM, rstd_T, x_TND, fn_MK, tf32, eps=1e-6):
    t, n, d = x_TND.shape
    w = reference.round_to_tf32(fn_MK) if tf32 else fn_MK
    flat = x_TND.double().reshape(t, n * d)
    want_rstd = torch.rsqrt(flat.square().mean(-1) + eps)
    want = (flat @ w.double().T) * want_rstd[:, None]
    k, u = n * d, 2.0**-24
    mma = x_TND.dtype in MMA_STREAMS  # the tensor cores' sum of exact products (module docstring), else K FMAs
    adds = 2 * (3 * X_PARTS[tl_dtype(x_TND.dtype)] * k + 2) if mma else k + 2
    # the sum's error, then rstd's (a sum of K positive squares: K * u / 2 relative)
    bound = adds * u * (flat.abs() @ w.double().abs().T) * want_rstd[:, None] + (k / 2 + 4) * u * want.abs()
    assert mixes_TM.dtype == torch.float32 and mixes_TM.shape == want.shape
    assert torch.all((mixes_TM.double() - want).abs() <= bound), float(((mixes_TM.double() - want).abs() / bound).max())
    torch.testing.assert_close(rstd_T.double(), want_rstd, rtol=(k / 2 + 4) * u, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,d,m,dtype,tf32", CASES)
def test_matches_reference(t, n, d, m, dtype, tf32, seed):
    x_TND, fn_MK = inputs(t, n, d, m, dtype, seed)
    poison_allocator("cuda")
    mixes_TM, rstd_T = norm_fn(x_TND, fn_MK, eps=1e-6, tf32=tf32)
    assert_close(mixes_TM, rstd_T, x_TND, fn_MK, tf32)


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,d,m,dtype,tf32", CASES)
def test_backward_matches_reference(t, n, d, m, dtype, tf32, seed):
    """``grad_x`` against the reference formula in float64, within the rounding to ``x``'s dtype
    plus the float32 sum's bound (the tensor cores': three products of two parts of ``gproj`` and
    of ``fn``, within ``3 * 2**-16`` of each term, and truncating adds); ``grad_fn`` torch's float32
    GEMM, or the tensor cores' from two parts of ``gproj`` (within ``2**-16`` of each term) summed
    over the tokens."""
    x_TND, fn_MK = inputs(t, n, d, m, dtype, seed)
    mixes_TM, rstd_T = norm_fn(x_TND, fn_MK, eps=1e-6, tf32=tf32)
    g_TM = torch.randn(t, m, device="cuda")
    poison_allocator("cuda")
    grad_x, grad_fn = norm_fn_backward(x_TND, fn_MK, mixes_TM, rstd_T, g_TM, tf32)
    want_x, want_fn = functions.norm_fn_backward(x_TND.double(), fn_MK.double(), mixes_TM.double(),
                                                 rstd_T.double(), g_TM.double(), tf32)
    assert grad_x.dtype == x_TND.dtype and grad_x.shape == x_TND.shape
    w = (reference.round_to_tf32(fn_MK) if tf32 else fn_MK).double()
    gproj = g_TM.double() * rstd_T.double()[:, None]
    coef = (g_TM.double() * mixes_TM.double()).sum(-1) * rstd_T.double().square() / (n * d)
    flat = x_TND.double().reshape(t, n * d)
    scale = (gproj.abs() @ w.abs() + (coef[:, None] * flat).abs()).view_as(want_x)  # the terms' magnitudes
    mma, u = dtype == torch.bfloat16, 2.0**-24
    dropped = 3 * 2.0**-16 + 2 * (3 * m + 4) * u if mma else (m + 4) * u
    rounding = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    floor = 2.0**-25 if dtype == torch.float16 else 0.0  # half of float16's subnormal spacing
    bound = dropped * scale + rounding * want_x.abs() + floor
    assert torch.all((grad_x.double() - want_x).abs() <= bound)
    # grad_fn: the tensor cores' two parts of gproj (within 2**-16 of each term), or torch's float32
    # GEMM; either way a float32 sum over the tokens, of gproj as float32 computed it (a few ulps)
    dropped_fn = 2.0**-16 if mma else 8 * u
    bound_fn = (dropped_fn + 2 * (t + 2) * u) * (gproj.abs().T @ flat.abs())
    assert torch.all((grad_fn.double() - want_fn).abs() <= bound_fn)


@pytest.mark.gpu
def test_public_op_forward_and_backward(monkeypatch, seed):
    """``kernels.mhc.norm_fn`` runs the kernel; its gradients are the reference's formula."""
    from kernels.mhc import norm_fn_kernel

    forwards, backwards = spy(monkeypatch, norm_fn_kernel, "norm_fn"), spy(monkeypatch, norm_fn_kernel, "norm_fn_backward")
    x_TND, fn_MK = inputs(37, 4, 256, 24, torch.float32, seed)
    x, fn = x_TND.clone().requires_grad_(), fn_MK.clone().requires_grad_()
    xr, fnr = x_TND.clone().requires_grad_(), fn_MK.clone().requires_grad_()
    g = torch.randn(37, 24, device="cuda")
    got = mhc.norm_fn(x, fn)
    want = reference.norm_fn(xr, fnr)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fn.grad, fnr.grad, rtol=1e-4, atol=1e-4)
    assert len(forwards) == len(backwards) == 1


def test_backward_chunks():
    """The tensor-core backward's token blocks a CTA: every block of a small batch in one CTA (a
    power of two of them), 32 blocks a split beyond."""
    assert [backward_chunks(t) for t in (1, 64, 65, 200, 2048, 2049, 8192)] == [1, 1, 2, 4, 32, 32, 32]


def test_compiles_for_sm90a():
    """The CUDA-core kernels, which take float16 / float32 streams (training's): DeepSeek-V4 widths
    (N = 4, D = 4096, 7168), the tiny model's D = 64, a head's M = N."""
    with lowering.compile_only():
        for k, m, dtype in ((4 * 4096, 24, "float16"), (4 * 7168, 24, "float32"), (4 * 64, 24, "float32"),
                            (4 * 7168, 4, "float32")):
            source = lowering.kernel_source(get_norm_fn_kernel(k, m, dtype, 1e-6))
            assert "warp_reduce_sum" in source and "__fsqrt_rn" in source, (k, m, dtype)
            assert "grad_TK" in lowering.kernel_source(get_norm_fn_backward_kernel(k, m, dtype)), (k, m, dtype)


def test_tensor_core_kernels_compile_for_sm90a():
    """bfloat16 streams' kernels at both DeepSeek-V4 widths (the backward's code differs only in
    K there, so one), a head's M = N, and K = 600 and 100 ending inside a chunk (100: rows not
    16-byte aligned); the forward for float32 / float16 streams (an MMA per part of ``x``)."""
    with lowering.compile_only():
        for k, m in ((4 * 4096, 24), (4 * 7168, 24), (4 * 7168, 4), (600, 8), (100, 3)):
            source = lowering.kernel_source(get_norm_fn_mma_kernel(k, m, 1e-6))
            assert "wgmma" in source and "__fsqrt_rn" in source, (k, m)
            dtype = {(4 * 7168, 24): "float32", (600, 8): "float16"}.get((k, m))  # streams in bfloat16 parts
            if dtype:
                parts_source = lowering.kernel_source(get_norm_fn_mma_kernel(k, m, 1e-6, dtype=dtype))
                assert parts_source.count("wgmma_ss<") == X_PARTS[dtype] * source.count("wgmma_ss<"), (k, m, dtype)
            assert "w_RK" in lowering.kernel_source(get_fn_parts_kernel(k, m)), (k, m)
            if k != 4 * 7168 or m != 24:
                source = lowering.kernel_source(get_norm_fn_backward_mma_kernel(k, m, backward_chunks(8192)))
                assert "wgmma" in source and "grad_fn_SMK" in source, (k, m)
