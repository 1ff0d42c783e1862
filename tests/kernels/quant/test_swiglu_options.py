"""SwiGLU's per-row weights and clamp (kernels.quant.reference): the forward against a float64
formulation, the backward (input and weight gradients) against torch autograd of the reference,
and the clamp's edges (which operand, which side, the gradient at the limit)."""

import pytest
import torch

from kernels.quant import reference, swiglu, swiglu_backward, swiglu_per_token_cast

pytestmark = pytest.mark.usefixtures("seed")

CLAMP = 2.5


def swiglu_f64(x: torch.Tensor, weights: torch.Tensor | None, clamp: float | None) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    y = gate / (1 + torch.exp(-gate)) * up
    return y if weights is None else y * weights.double()[:, None]


def inputs(t: int = 29, inter: int = 96, dtype: torch.dtype = torch.float32):
    x = (3 * torch.randn(t, 2 * inter)).to(dtype)
    return x, torch.rand(t) + 0.1, torch.randn(t, inter).to(dtype)


@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["no_clamp", "clamp"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_forward_matches_float64(weighted, clamp):
    x, weights, _ = inputs()
    weights = weights if weighted else None
    y = swiglu(x, weights_T=weights, clamp=clamp)
    torch.testing.assert_close(y.double(), swiglu_f64(x, weights, clamp), rtol=1e-6, atol=1e-6)


def test_clamp_limits_the_gate_from_above_and_up_on_both_sides():
    gate = torch.tensor([[-9.0, -1.0, 1.0, 9.0]])
    up = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    y = swiglu(torch.cat([gate, up], dim=1), clamp=CLAMP)
    # the gate is clamped above only: -9 stays -9 (silu(-9) ~ -1.1e-3), 9 becomes 2.5
    assert torch.equal(y, torch.nn.functional.silu(torch.tensor([[-9.0, -1.0, 1.0, CLAMP]])))
    y = swiglu(torch.tensor([[1.0, 1.0, -9.0, 9.0]]), clamp=CLAMP)
    silu_1 = torch.nn.functional.silu(torch.tensor(1.0))
    assert torch.equal(y, torch.stack([silu_1 * -CLAMP, silu_1 * CLAMP])[None])


def test_weight_multiplies_the_float32_result_before_the_cast():
    x, weights, _ = inputs(t=8, inter=256)
    q, sf = swiglu_per_token_cast(x, weights_T=weights, clamp=CLAMP)
    q_ref, sf_ref = reference.per_token_cast(reference.swiglu(x, weights_T=weights, clamp=CLAMP))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)
    _, sf_unweighted = swiglu_per_token_cast(x, clamp=CLAMP)
    assert not torch.equal(sf, sf_unweighted)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2.0**-7)])
@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["no_clamp", "clamp"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_backward_matches_autograd_of_the_reference(weighted, clamp, dtype, rtol):
    x, weights, grad = inputs(dtype=dtype)
    x_leaf = x.float().requires_grad_()
    w_leaf = weights.clone().requires_grad_() if weighted else None
    reference.swiglu(x_leaf, weights_T=w_leaf, clamp=clamp).backward(grad.float())
    out = swiglu_backward(x, grad, weights_T=weights if weighted else None, clamp=clamp)
    grad_x, grad_w = out if weighted else (out, None)
    assert grad_x.dtype == dtype and grad_x.shape == x.shape
    torch.testing.assert_close(grad_x.float(), x_leaf.grad, rtol=rtol, atol=1e-5)
    if weighted:
        assert grad_w.dtype == torch.float32 and grad_w.shape == weights.shape
        torch.testing.assert_close(grad_w, w_leaf.grad, rtol=1e-5, atol=1e-5)
    if clamp is not None:
        gate, up = x.float().chunk(2, dim=1)
        clamped = torch.cat([gate > clamp, up.abs() > clamp], dim=1)
        assert clamped.any() and not grad_x[clamped].any()


def test_gradient_passes_at_the_limit_itself():
    """As torch's clamp: an input equal to the limit is not clamped away from its gradient."""
    x = torch.tensor([[CLAMP, 1.0, CLAMP, -CLAMP]])
    grad_x = swiglu_backward(x, torch.ones(1, 2), clamp=CLAMP)
    x_leaf = x.clone().requires_grad_()
    reference.swiglu(x_leaf, clamp=CLAMP).sum().backward()
    assert grad_x.ne(0).all()
    torch.testing.assert_close(grad_x, x_leaf.grad, rtol=1e-6, atol=0)


ERRORS = {
    "clamp_zero": (lambda x, w: swiglu(x, clamp=0.0), ValueError, "clamp"),
    "clamp_bool": (lambda x, w: swiglu_backward(x, x[:, :4], clamp=True), ValueError, "clamp"),
    "weights_dtype": (lambda x, w: swiglu(x, weights_T=w.double()), TypeError, "weights_T"),
    "weights_shape": (lambda x, w: swiglu_per_token_cast(x, weights_T=w[:2]), ValueError, "weights_T"),
    "weights_backward": (lambda x, w: swiglu_backward(x, x[:, :4], weights_T=w[None]), ValueError, "weights_T"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_names_the_argument(case):
    call, error, argname = ERRORS[case]
    with pytest.raises(error, match=f"^{argname}: expected"):
        call(torch.randn(4, 8), torch.rand(4))
