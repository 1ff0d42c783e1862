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


@pytest.fixture
def fresh_choice(monkeypatch):
    """``kernels.select``'s per-device cache emptied before and after, ``EP_KERNELS`` unset."""
    from kernels import select

    monkeypatch.delenv("EP_KERNELS", raising=False)
    select._choice.cache_clear()
    yield select
    select._choice.cache_clear()


def _capability(monkeypatch, capability):
    asked = []

    def get_device_capability(index=None):
        asked.append(index)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    return asked


@pytest.mark.parametrize("capability, choice", [((9, 0), "tilelang"), ((10, 0), "tilelang"), ((8, 9), "reference"),
                                                ((7, 0), "reference")])
def test_cuda_devices_from_compute_capability_9_run_tilelang(fresh_choice, monkeypatch, caplog, capability, choice):
    asked = _capability(monkeypatch, capability)
    with caplog.at_level("INFO", logger="kernels.select"):
        assert fresh_choice.use_tilelang(torch.device("cuda", 1)) == (choice == "tilelang")
        assert fresh_choice.use_tilelang(torch.device("cuda", 1)) == (choice == "tilelang")  # cached
    assert asked == [1]  # once per device
    why = "CUDA compute capability >= 9.0" if choice == "tilelang" else "cuda device"
    assert [r.getMessage() for r in caplog.records] == [f"kernels on cuda:1: {choice} ({why})"]


def test_a_cuda_device_without_an_index_is_the_current_one(fresh_choice, monkeypatch):
    asked = _capability(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert fresh_choice.use_tilelang(torch.device("cuda"))
    assert asked == [3]


def test_the_cpu_runs_the_reference(fresh_choice, monkeypatch, caplog):
    asked = _capability(monkeypatch, (9, 0))
    with caplog.at_level("INFO", logger="kernels.select"):
        assert not fresh_choice.use_tilelang(torch.device("cpu"))
    assert asked == [] and [r.getMessage() for r in caplog.records] == ["kernels on cpu: reference (cpu device)"]


@pytest.mark.parametrize("value", ["reference", " Reference ", "REFERENCE"])
def test_ep_kernels_reference_overrides_a_capable_gpu(fresh_choice, monkeypatch, caplog, value):
    _capability(monkeypatch, (9, 0))
    monkeypatch.setenv("EP_KERNELS", value)
    with caplog.at_level("INFO", logger="kernels.select"):
        assert not fresh_choice.use_tilelang(torch.device("cuda", 0))
    assert [r.getMessage() for r in caplog.records] == ["kernels on cuda:0: reference (EP_KERNELS)"]


def test_ep_kernels_tilelang_overrides_an_older_gpu_but_not_the_cpu(fresh_choice, monkeypatch):
    _capability(monkeypatch, (8, 0))
    monkeypatch.setenv("EP_KERNELS", "tilelang")
    assert fresh_choice.use_tilelang(torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"^EP_KERNELS=tilelang needs a CUDA device, got cpu$"):
        fresh_choice.use_tilelang(torch.device("cpu"))


def test_a_bad_ep_kernels_is_named(fresh_choice, monkeypatch):
    monkeypatch.setenv("EP_KERNELS", "triton")
    with pytest.raises(ValueError, match=r"^EP_KERNELS: expected one of \('reference', 'tilelang'\), got 'triton'$"):
        fresh_choice.use_tilelang(torch.device("cpu"))


@pytest.mark.parametrize("op", ["swiglu", "weighted_reduce", "batched_transpose"])
def test_ops_without_kernel_autograd_run_the_reference_for_inputs_that_need_a_gradient(op, stub_kernel, monkeypatch,
                                                                                        seed):
    """Where TileLang is selected, an input that needs a gradient goes to the reference (which is
    differentiable), the same input without one (or under no_grad) to the kernel."""
    import kernels.quant
    import kernels.reduce
    import kernels.transpose

    x_TI2, y_PD = torch.randn(5, 8), torch.randn(6, 4)
    pos_TK, weights_TK = torch.tensor([[0, 3], [5, -1]]), torch.rand(2, 2)
    package, kernel_module, name, args = {
        "swiglu": (kernels.quant, kernels.quant.swiglu_kernel, "swiglu", (x_TI2,)),
        "weighted_reduce": (kernels.reduce, kernels.reduce, "weighted_reduce_kernel", (y_PD, pos_TK, weights_TK)),
        "batched_transpose": (kernels.transpose, kernels.transpose, "batched_transpose_kernel",
                              (torch.randn(2, 3, 4),)),
    }[op]
    if not hasattr(kernel_module, name):
        pytest.fail(f"{kernel_module.__name__} has no {name}: the stub would not replace the kernel")
    marker = torch.full((1,), 7.0)
    calls = stub_kernel(kernel_module, name, marker)
    monkeypatch.setattr(package, "use_tilelang", lambda device: True)
    public = getattr(package, op)
    assert torch.equal(public(*args), marker) and len(calls) == 1
    with torch.no_grad():
        assert torch.equal(public(*[a.requires_grad_() if a.is_floating_point() else a for a in args]), marker)
    assert len(calls) == 2
    out = public(*args)  # the float inputs now need a gradient
    assert len(calls) == 2 and out.requires_grad and not torch.equal(out, marker)
