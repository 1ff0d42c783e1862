"""The Engram gate kernels (forward; backward, checked against the reference's autograd) against
the reference run on the same GPU, the public op's
choice between them, and an sm_90a compile of the DeepSeek-V4 shapes.

Tolerance: the kernel sums ``x^2``, ``k^2`` and ``x*w*k`` over D in another order than PyTorch's
reductions (and takes ``1/sqrt`` where the reference takes ``rsqrt``), which moves ``dot`` by a few
float32 roundings of its terms; through ``sigmoid(sqrt(|dot|))`` that moves the gate by well under
``1e-4`` for these inputs. So per element
``|out - ref| <= 2 * u * (|ref| + |x| + |v|) + 1e-4 * |v|``, with ``u`` the output dtype's unit
roundoff times two (2**-7 bfloat16, 2**-10 float16, 2**-23 float32). Every element is checked;
outputs start as poison (:func:`kernels.testing.poison_allocator`)."""

import pytest
import torch

from kernels import engram, lowering
from kernels.engram import reference
from kernels.engram.gate_backward_kernel import (
    ULP,
    BackwardPlan,
    backward_excess,
    backward_fits,
    backward_plan,
    gate_backward,
    get_gate_backward_kernel,
    get_weight_grad_kernel,
)
from kernels.engram.gate_kernel import gate, get_gate_kernel
from kernels.testing import poison_allocator

TOKENS = [0, 1, 130]
HIDDEN = [64, 7168, 100]
STREAMS = [1, 4]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = {"bf16": (BF16, BF16, BF16, BF16), "fp32": (F32, F32, F32, F32), "mixed": (F32, BF16, F16, BF16)}


def gate_inputs(t, n, d, *, dtypes, device, seed):
    """``(x, k, v, wh, we)``: x and k of a few magnitudes, norm weights around 1 (x, k, v, weight
    dtypes as given)."""
    gen = torch.Generator().manual_seed(seed)
    x_TND = torch.randn(t, n, d, generator=gen) * 3
    k_TND = torch.randn(t, n, d, generator=gen) * 0.1 + 0.3 * x_TND  # correlated: gates away from 0.5
    v_TD = torch.randn(t, d, generator=gen)
    wh_ND, we_ND = torch.rand(n, d, generator=gen) + 0.5, torch.rand(n, d, generator=gen) + 0.5
    x_dtype, k_dtype, v_dtype, w_dtype = dtypes
    return (x_TND.to(x_dtype).to(device), k_TND.to(k_dtype).to(device), v_TD.to(v_dtype).to(device),
            wh_ND.to(w_dtype).to(device), we_ND.to(w_dtype).to(device))  # fmt: skip


def assert_close_to_reference(out_TND, args, add_residual):
    ref_TND = reference.gate(*args, add_residual=add_residual)
    assert out_TND.dtype == ref_TND.dtype and out_TND.shape == ref_TND.shape
    assert out_TND.numel() == 0 or out_TND.stride() == ref_TND.stride()  # empty: any strides
    x, v = args[0].double(), args[2].double()[:, None, :]
    bound = 2 * ULP[out_TND.dtype] * (ref_TND.double().abs() + x.abs() + v.abs()) + 1e-4 * v.abs()
    excess = (out_TND.double() - ref_TND.double()).abs() - bound
    assert excess.numel() == 0 or float(excess.max()) <= 0, float(excess.max())


@pytest.mark.gpu
@pytest.mark.parametrize("add_residual", [True, False])
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
def test_matches_reference(t, d, n, dtypes, add_residual, seed):
    args = gate_inputs(t, n, d, dtypes=DTYPES[dtypes], device="cuda", seed=seed)
    poison_allocator("cuda")
    assert_close_to_reference(gate(*args, add_residual=add_residual), args, add_residual)


def reference_grads(args, g_TND, add_residual):
    leaves = [a.detach().requires_grad_() for a in args]
    reference.gate(*leaves, add_residual=add_residual).backward(g_TND)
    return [a.grad for a in leaves]


def assert_backward_close(grads, args, g_TND, add_residual):
    """Each gradient of the reference's dtype and shape, within :func:`backward_excess`'s bound."""
    want = reference_grads(args, g_TND, add_residual)
    for name, got, ref in zip(("x", "k", "v", "wh", "we"), grads, want):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
    excess = backward_excess(grads, want)
    assert all(e <= 0 for e in excess.values()), excess


@pytest.mark.gpu
@pytest.mark.parametrize("add_residual", [True, False])
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("t", [*TOKENS, 600])  # 600: several tokens a CTA, the ring running on into the next
def test_backward_matches_reference(t, d, n, dtypes, add_residual, seed):
    check_backward(t, d, n, DTYPES[dtypes], add_residual, seed)


def check_backward(t, d, n, dtypes, add_residual, seed, **plan_options):
    args = gate_inputs(t, n, d, dtypes=dtypes, device="cuda", seed=seed)
    g_TND = torch.randn(t, n, d, generator=torch.Generator().manual_seed(seed + 1)).to(args[0].dtype).to("cuda")
    poison_allocator("cuda")
    _, stats_TN3 = gate(*args, add_residual=add_residual, return_stats=True)
    grads = gate_backward(*args, g_TND, stats_TN3, add_residual=add_residual, **plan_options)
    assert_backward_close(grads, args, g_TND, add_residual)


@pytest.mark.gpu
@pytest.mark.parametrize("d, warps, tile, stages, w_resident, g_buffers", [
    (7168, 8, 2, 3, False, 2), (7168, 8, 3, 2, False, 2), (7168, 8, 1, 6, False, 2), (7168, 16, 1, 3, False, 2),
    (7168, 8, 2, 2, True, 1), (4096, 8, 2, 3, True, 2), (4096, 8, 4, 2, True, 2), (4096, 8, 1, 2, True, 1),
])
def test_backward_plans_agree(d, warps, tile, stages, w_resident, g_buffers, seed):
    """Every layout the plan can choose (the sweep's variants), N = 4, where the ring's steps (2 to
    14 a token, the last one short for tile 3) and their slots wrap unevenly, one token into the
    next; ``w`` resident fits beside two tokens' ``g`` at D = 4096, beside one at 7168, and streams
    (the wrapper's float32 product) beside two. Each is the layout asked for, not a fallback."""
    args = gate_inputs(1, 4, d, dtypes=DTYPES["bf16"], device="cuda", seed=seed)
    options = dict(warps=warps, tile=tile, stages=stages, w_resident=w_resident, g_buffers=g_buffers)
    plan = backward_plan(*args[:3], **options)
    assert (plan.threads // 32, plan.tile, plan.stages, plan.w_resident, plan.g_buffers) == tuple(options.values())
    check_backward(600, d, 4, DTYPES["bf16"], True, seed, **options)


@pytest.mark.gpu
def test_public_op_runs_the_kernels_forward_and_backward(seed):
    args = gate_inputs(130, 4, 100, dtypes=DTYPES["bf16"], device="cuda", seed=seed)
    assert torch.equal(engram.gate(*args), gate(*args))
    leaves = [a.clone().requires_grad_() for a in args]
    out_TND = engram.gate(*leaves)
    assert type(out_TND.grad_fn).__name__ == "_GateBackward" and torch.equal(out_TND, gate(*args))
    g_TND = torch.randn_like(out_TND)
    out_TND.backward(g_TND)
    assert_backward_close([a.grad for a in leaves], args, g_TND, True)


@pytest.mark.gpu
@pytest.mark.parametrize("n, d, dtype", [(8, 8192, BF16), (4, 7, BF16)])
def test_shapes_beyond_the_backward_take_the_reference(n, d, dtype, seed):
    """N * D = 64K: a thread's weight gradients (128, with the warps doubled) do not fit its
    registers; D = 7 in bfloat16: a 2-byte vector, under ``cp.async``'s 4. The kernel refuses and
    the public op runs the reference."""
    args = gate_inputs(2, n, d, dtypes=(dtype,) * 4, device="cuda", seed=seed)
    assert not backward_fits(*args[:3])
    with pytest.raises(ValueError, match=rf"^x_TND: N = {n}, D = {d} in torch.bfloat16 .* is beyond the backward"):
        gate_backward(*args, torch.ones_like(args[0]), torch.ones(2, n, 3, device="cuda"))
    assert torch.equal(engram.gate(*args), reference.gate(*args))


H100_SHARED = 232448  # bytes a CTA may take on an H100 or H200 (shared_memory_per_block_optin)


def test_backward_plan_picks_the_measured_layout_where_it_fits():
    """On a Hopper's shared memory: the measured default (two ``g`` buffers, 3 stages) at both
    DeepSeek-V4 widths, 8 warps, tile 2 and ``w`` resident at D = 4096, 16 warps (56 weight
    gradients a thread, not 112), so tile 1, and ``w`` streamed (two ``g`` buffers and ``w`` do not
    fit together) at 7168; float32 streams at D = 7168 give up a ``g`` buffer; a tighter CTA gives
    up stages, then the tile; shapes beyond registers or ``cp.async`` get none."""

    def plan(n, d, dtype=BF16, **options):
        x, v = torch.empty(1, n, d, dtype=dtype, device="meta"), torch.empty(1, d, dtype=dtype, device="meta")
        return backward_plan(x, x, v, shared_memory=options.pop("shared_memory", H100_SHARED), **options)

    for d, warps, tile, w_resident in ((4096, 2, 2, True), (7168, 4, 1, False)):
        got = plan(4, d)
        assert got == BackwardPlan(4, 8, d // 8, warps, d // (256 * warps), tile, 3, w_resident, 2), got
        assert got.threads == 128 * warps and got.shared_bytes(BF16, BF16, BF16) <= H100_SHARED
    assert plan(4, 7168, F32) == BackwardPlan(4, 4, 1792, 4, 14, 1, 3, False, 1)
    roomy = plan(4, 4096, tile=2, stages=3)
    assert roomy.stages == 3
    tight = roomy._replace(tile=1, stages=2).shared_bytes(BF16, BF16, BF16)
    assert plan(4, 4096, tile=2, stages=3, shared_memory=tight) == roomy._replace(tile=1, stages=2)
    assert plan(8, 8192) is None and plan(4, 7) is None and plan(4, 7, F32) is not None


def test_wrapper_names_bad_arguments():
    args = gate_inputs(3, 4, 64, dtypes=DTYPES["bf16"], device="cpu", seed=0)
    with pytest.raises(ValueError, match="^x_TND: expected a tensor on a CUDA device"):
        gate(*args)
    with pytest.raises(ValueError, match="^clamp: expected"):
        gate(*args, clamp=0.0)
    with pytest.raises(ValueError, match="^v_TD: expected shape"):
        gate(args[0], args[1], args[2][:, :8], args[3], args[4])


def test_public_op_runs_the_kernel_only_where_selected(stub_kernel, monkeypatch):
    """On the CPU the reference runs and the kernel is never called; where ``use_tilelang`` says
    so, the forward and the backward are the kernels' (stubs here)."""
    args = [a.requires_grad_() for a in gate_inputs(5, 4, 64, dtypes=DTYPES["fp32"], device="cpu", seed=1)]
    marker = torch.full((5, 4, 64), 3.0)
    calls = stub_kernel(engram.gate_kernel, "gate", (marker, torch.zeros(5, 4, 3)))
    back = stub_kernel(engram.gate_backward_kernel, "gate_backward", tuple(torch.ones_like(a) for a in args))
    assert torch.equal(engram.gate(*args), reference.gate(*args)) and not calls
    monkeypatch.setattr(engram, "use_tilelang", lambda device: True)
    monkeypatch.setattr(engram.gate_backward_kernel, "backward_fits", lambda *a: True)
    out = engram.gate(*args)
    assert torch.equal(out, marker) and len(calls) == 1 and calls[0][1]["return_stats"]
    out.sum().backward()
    assert len(back) == 1 and all(torch.equal(a.grad, torch.ones_like(a)) for a in args)


def test_compiles_for_sm90a():
    """DeepSeek-V4 widths (D = 4096, 7168; N = 4) and the tiny model's D = 64, bfloat16 activations
    with float32 norm weights: 16-byte vector accesses, IEEE adds, one ``expf`` per row; the
    backward in the layout its plan picks on a Hopper (``w`` streamed at 7168)."""
    with lowering.compile_only():
        for d in (4096, 7168, 64):
            kernel = get_gate_kernel(4, d, "bfloat16", "bfloat16", "bfloat16", "float32", 1e-6, 1e-6, True)
            source = lowering.kernel_source(kernel)
            assert "uint4" in source and "__fadd_rn" in source and source.count("expf(") == 1, d
            x, v = torch.empty(1, 4, d, dtype=BF16, device="meta"), torch.empty(1, d, dtype=BF16, device="meta")
            plan = backward_plan(x, x, v, shared_memory=H100_SHARED)
            backward = get_gate_backward_kernel(4, d, "bfloat16", "bfloat16", "bfloat16", "float32", 1e-6, True,
                                                plan.warps_per_stream, plan.tile, plan.stages, plan.w_resident,
                                                plan.g_buffers)
            source = lowering.kernel_source(backward)
            assert "uint4" in source and "warp_reduce_sum" in source and "grad_w_CND" in source, d
            for w_dtype in ("float32", "bfloat16"):
                source = lowering.kernel_source(get_weight_grad_kernel(4 * d, w_dtype))
                assert "float4" in source and "__fadd_rn" in source, (d, w_dtype)
