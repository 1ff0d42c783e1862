"""The FP8 expert MLP (``ep_runtime.fp8_experts``) on the CPU, where its GEMMs, casts and SwiGLU
run the kernels' references: forward and gradients against the bfloat16 grouped path, and the
option that switches it on.

Tolerance: relative L2 error 0.1 of the output and of each gradient (measured 0.063-0.070: each
chains two GEMMs on four e4m3 casts, ~2.6% each; the W13 gradient's x is cast twice)."""

import pytest
import torch

from ep_runtime.config import MoEConfig
from ep_runtime.dispatch import AllToAllDispatcher
from ep_runtime.experts import GroupedExperts
from ep_runtime.fp8_experts import FP8ExpertsFn
from ep_runtime.moe import MoELayer

HIDDEN, INTER = 256, 128  # multiples of 128, as on the GPU
FP8_ERROR = 0.1


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: which path GroupedExperts takes, seen on the CPU."""

    @property
    def is_cuda(self):
        return True


def dispatched(seed, num_tokens=200, device="cpu", dtype=torch.float32):
    """Tokens routed to 4 experts, none to expert 1, in a layout of 128-row segments, and 64 spare rows."""
    gen = torch.Generator().manual_seed(seed)
    idx_TK = torch.randint(0, 4, (num_tokens, 2), generator=gen)
    idx_TK[idx_TK == 1] = 0
    idx_TK[idx_TK[:, 0] == idx_TK[:, 1], 1] = -1
    x_TD = torch.randn(num_tokens, HIDDEN, generator=gen).to(device, dtype)
    x_PD, layout, _ = AllToAllDispatcher(num_experts=4, alignment=128).dispatch(
        x_TD, idx_TK.to(device), torch.rand(num_tokens, 2, generator=gen).to(device))
    spare = torch.randn(64, HIDDEN, generator=gen).to(device, dtype)
    return torch.cat([x_PD, spare]).requires_grad_(), layout


def rel_error(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def test_fp8_path_matches_the_bf16_path(seed):
    experts = GroupedExperts(4, HIDDEN, INTER, seed=seed)
    x_PD, layout = dispatched(seed)
    n = int(layout.offsets_E[-1])
    assert layout.offsets_E.tolist()[1] == layout.offsets_E.tolist()[0] and n % 128 == 0
    fp8 = FP8ExpertsFn.apply(x_PD, experts.w13_EDI2, experts.w2_EID, layout.offsets_E)
    bf16 = experts._grouped(x_PD, layout)
    assert fp8.dtype == x_PD.dtype == torch.float32
    assert rel_error(fp8[:n], bf16[:n]) < FP8_ERROR
    grad_PD = torch.randn(n, HIDDEN)
    params = (x_PD, experts.w13_EDI2, experts.w2_EID)
    got = torch.autograd.grad(fp8[:n], params, grad_PD)
    want = torch.autograd.grad(bf16[:n], params, grad_PD)
    assert got[0].shape == x_PD.shape and rel_error(got[0][:n], want[0][:n]) < FP8_ERROR
    for name, g, w in zip(("w13", "w2"), got[1:], want[1:]):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert rel_error(g, w) < FP8_ERROR, name
    assert not got[1][1].any() and not got[2][1].any()  # expert 1 has no rows


def test_weight_gradients_come_in_the_weights_dtype(seed, monkeypatch):
    """bfloat16 weights: the weight-gradient GEMM writes bfloat16 (half the bytes, no cast after),
    the gradients as close to float32 weights' as FP8 gets to bfloat16."""
    import ep_runtime.fp8_experts as fp8_experts

    asked = []
    wgrad = fp8_experts.grouped_fp8_mm_wgrad
    monkeypatch.setattr(fp8_experts, "grouped_fp8_mm_wgrad", lambda *a, **k: asked.append(k["out_dtype"]) or wgrad(*a, **k))
    experts = GroupedExperts(4, HIDDEN, INTER, seed=seed)
    x_PD, layout = dispatched(seed)
    n = int(layout.offsets_E[-1])
    grad_PD = torch.randn(n, HIDDEN)

    def weight_grads(w13, w2):
        return torch.autograd.grad(FP8ExpertsFn.apply(x_PD, w13, w2, layout.offsets_E)[:n], (w13, w2), grad_PD)

    want = weight_grads(experts.w13_EDI2, experts.w2_EID)
    got = weight_grads(*(w.detach().bfloat16().requires_grad_() for w in (experts.w13_EDI2, experts.w2_EID)))
    assert asked == [torch.float32] * 2 + [torch.bfloat16] * 2
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and rel_error(g, w) < FP8_ERROR  # the weights rounded to bfloat16 first


def test_the_option_switches_the_cuda_path(seed):
    x_PD, layout = dispatched(seed)
    n = int(layout.offsets_E[-1])
    for fp8 in (True, False):
        experts = GroupedExperts(4, HIDDEN, INTER, seed=seed, fp8=fp8)
        with torch.no_grad():
            picked = experts(x_PD.detach().as_subclass(_ClaimsCuda), layout).as_subclass(torch.Tensor)
            fp8_out = FP8ExpertsFn.apply(x_PD, experts.w13_EDI2, experts.w2_EID, layout.offsets_E)
        assert torch.equal(picked[:n], fp8_out[:n]) == fp8


def test_config_needs_128_row_segments():
    with pytest.raises(ValueError, match=r"^model\.moe\.alignment: expected a multiple of 128"):
        MoEConfig(fp8_experts=True, alignment=8)
    cfg = MoEConfig(num_experts=4, expert_hidden=INTER, fp8_experts=True, alignment=128)
    layer = MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=4, alignment=128), ep_rank=0, seed=0)
    assert layer.experts.fp8 and not MoEConfig().fp8_experts


@pytest.mark.gpu
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_fp8_kernels_match_the_bf16_path_on_cuda(seed, weights):
    """The same comparison with the TileLang kernels (a layout of 128-row segments, spare rows
    after them), forward and gradients, for float32 and bfloat16 weights."""
    experts = GroupedExperts(4, HIDDEN, INTER, seed=seed).cuda().to(weights)
    x_PD, layout = dispatched(seed, num_tokens=600, device="cuda", dtype=torch.bfloat16)
    n = int(layout.offsets_E[-1])
    fp8 = FP8ExpertsFn.apply(x_PD, experts.w13_EDI2, experts.w2_EID, layout.offsets_E)
    bf16 = experts._grouped(x_PD, layout)
    assert rel_error(fp8[:n], bf16[:n]) < FP8_ERROR
    grad_PD = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    params = (x_PD, experts.w13_EDI2, experts.w2_EID)
    got = torch.autograd.grad(fp8[:n], params, grad_PD)
    want = torch.autograd.grad(bf16[:n], params, grad_PD)
    assert rel_error(got[0][:n], want[0][:n]) < FP8_ERROR
    for name, g, w in zip(("w13", "w2"), got[1:], want[1:]):
        assert g.dtype == weights and rel_error(g, w) < FP8_ERROR, name


def test_a_weights_cast_is_kept_until_the_weight_changes(seed):
    """One cast a step for every micro-batch: the same tensors while the weight is unchanged, a new
    cast after an in-place update (a fused AdamW step, a copy), another weight's cast its own."""
    from ep_runtime.fp8_experts import WeightCasts

    casts = WeightCasts()
    experts = GroupedExperts(4, HIDDEN, INTER, seed=seed)
    w = experts.w13_EDI2
    first = casts.of(w)
    assert casts.of(w)[0][0] is first[0][0] and casts.of(w)[1][0] is first[1][0]
    assert casts.of(experts.w2_EID)[0][0].shape == (4, INTER, HIDDEN)
    w.grad = torch.randn_like(w)
    torch.optim.AdamW([w], lr=0.1, fused=True).step()
    stepped = casts.of(w)
    assert stepped[0][0] is not first[0][0] and not torch.equal(stepped[0][0].view(torch.uint8),
                                                                 first[0][0].view(torch.uint8))
    with torch.no_grad():
        w.copy_(torch.randn_like(w))
    assert casts.of(w)[0][0] is not stepped[0][0]
    torch.testing.assert_close(casts.of(w)[1][0].view(torch.uint8), casts.of(w)[0][0].transpose(1, 2).view(torch.uint8))


def test_the_backward_s_swiglu_skips_the_spare_rows(seed, monkeypatch):
    """Both SwiGLU ops of the backward get the layout's row bound (``offsets_E[-1:]``): the 64 spare
    rows past the segments cost nothing."""
    import ep_runtime.fp8_experts as fp8_module

    bounds = {}
    for name in ("swiglu", "swiglu_backward"):
        original = getattr(fp8_module, name)

        def recorded(*args, rows=None, _name=name, _original=original, **kwargs):
            bounds.setdefault(_name, []).append(rows)
            return _original(*args, rows=rows, **kwargs)

        monkeypatch.setattr(fp8_module, name, recorded)
    experts = GroupedExperts(4, HIDDEN, INTER, seed=seed)
    x_PD, layout = dispatched(seed)
    FP8ExpertsFn.apply(x_PD, experts.w13_EDI2, experts.w2_EID, layout.offsets_E).sum().backward()
    assert [b.tolist() for b in bounds["swiglu"]] == [[int(layout.offsets_E[-1])]]
    assert [b.tolist() for b in bounds["swiglu_backward"]] == [[int(layout.offsets_E[-1])]]
