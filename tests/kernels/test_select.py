"""kernels.select: which implementation an op runs. The ops whose kernels have no autograd of their
own give the reference inputs that need a gradient, so a direct call is differentiable anywhere."""

import pytest
import torch

from kernels.quant import swiglu
from kernels.reduce import weighted_reduce
from kernels.select import needs_grad
from kernels.transpose import batched_transpose


def test_needs_grad_only_in_grad_mode():
    x, w = torch.ones(2, requires_grad=True), torch.ones(2)
    assert needs_grad(w, x) and not needs_grad(w, None)
    with torch.no_grad():
        assert not needs_grad(x)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_direct_calls_are_differentiable(device, seed):
    x_TI2 = torch.randn(5, 8, device=device, requires_grad=True)
    y_PD = torch.randn(6, 4, device=device, requires_grad=True)
    pos_TK = torch.tensor([[0, 3], [5, -1]], device=device)
    weights_TK = torch.rand(2, 2, device=device, requires_grad=True)
    x_BMN = torch.randn(2, 3, 4, device=device, requires_grad=True)
    outs = (swiglu(x_TI2), weighted_reduce(y_PD, pos_TK, weights_TK), batched_transpose(x_BMN))
    sum(out.float().sum() for out in outs).backward()
    for t in (x_TI2, y_PD, weights_TK, x_BMN):
        assert t.grad is not None and bool(t.grad.ne(0).any())
    assert torch.equal(x_BMN.grad, torch.ones_like(x_BMN))
