"""weighted_reduce_backward: the reference against autograd through the reference forward (CPU),
the kernel against the reference (GPU: ``grad_PD`` bit for bit inside the segments, outputs
poisoned first; the router-weight gradients to float32 summation order), argument errors, and
the kernel's sm_90a compile at the runtime's shapes."""

import pytest
import torch

from kernels import lowering
from kernels.permute import expert_layout, max_rows
from kernels.reduce import reference
from kernels.reduce.weighted_reduce_backward_kernel import get_weighted_reduce_backward_kernel, weighted_reduce_backward
from kernels.testing import poison_allocator, routes

CASES = [  # (T, K, E, D, alignment, dtype, static capacity)
    (0, 8, 16, 7168, 128, torch.bfloat16, True),  # no tokens: every row is padding
    (1, 2, 4, 64, 8, torch.float32, False),
    (37, 6, 12, 100, 16, torch.bfloat16, True),
    (130, 8, 32, 300, 128, torch.float16, True),
    (200, 8, 64, 7168, 128, torch.bfloat16, True),
    (513, 4, 8, 7168, 128, torch.float32, False),
]


def make_inputs(t, k, e, d, alignment, dtype, capacity, seed, device):
    topk_idx_TK = routes(t, k, e, dtype=torch.int32, device=device, seed=seed)
    layout = expert_layout(topk_idx_TK, e, alignment=alignment, num_rows=max_rows(t, k, e, alignment) if capacity else None)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_TD = torch.randn(t, d, generator=gen).to(dtype).to(device)
    y_PD = torch.randn(layout.num_rows, d, generator=gen).to(dtype).to(device)
    weights_TK = torch.rand(t, k, generator=gen).to(device)
    return grad_TD, y_PD, weights_TK, layout


@pytest.mark.parametrize("t,k,e,d,alignment,dtype,capacity", [c for c in CASES if c[3] <= 300])
def test_reference_is_the_gradient_of_the_forward(t, k, e, d, alignment, dtype, capacity, seed):
    grad_TD, y_PD, weights_TK, layout = make_inputs(t, k, e, d, alignment, dtype, capacity, seed, "cpu")
    y = y_PD.clone().requires_grad_()
    w = weights_TK.clone().requires_grad_()
    reference.weighted_reduce(y, layout.pos_TK, w).backward(grad_TD)
    grad_PD, grad_weights_TK = reference.weighted_reduce_backward(grad_TD, y_PD, weights_TK, layout)
    torch.testing.assert_close(grad_PD, y.grad, rtol=0, atol=0)  # one product per element either way
    torch.testing.assert_close(grad_weights_TK, w.grad, rtol=1e-5, atol=1e-5)
    assert grad_weights_TK[layout.pos_TK < 0].eq(0).all()
    assert grad_PD[layout.src_P < 0].eq(0).all()  # padding rows and the unused capacity


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,d,alignment,dtype,capacity", CASES)
def test_kernel_matches_reference(t, k, e, d, alignment, dtype, capacity, seed):
    grad_TD, y_PD, weights_TK, layout = make_inputs(t, k, e, d, alignment, dtype, capacity, seed, "cuda")
    want_PD, want_TK = reference.weighted_reduce_backward(grad_TD, y_PD, weights_TK, layout)
    poison_allocator("cuda")
    got_PD, got_TK = weighted_reduce_backward(grad_TD, y_PD, weights_TK, layout)
    end = int(layout.offsets_E[-1])  # rows past the segments are unspecified (a capacity's unused rows)
    assert got_PD.shape == want_PD.shape and got_PD.dtype == want_PD.dtype
    assert torch.equal(got_PD[:end].view(torch.uint8), want_PD[:end].view(torch.uint8))
    torch.testing.assert_close(got_TK, want_TK, rtol=1e-5, atol=1e-4 * d**0.5)
    assert got_TK[layout.pos_TK < 0].eq(0).all()


@pytest.mark.gpu
def test_inputs_off_a_vector_boundary():
    """Contiguous views that start 2 bytes past a 16-byte boundary (the kernel's vector loads need
    the boundary: the wrapper copies them)."""
    grad_TD, y_PD, weights_TK, layout = make_inputs(37, 6, 12, 256, 16, torch.bfloat16, True, 0, "cuda")
    want_PD, want_TK = reference.weighted_reduce_backward(grad_TD, y_PD, weights_TK, layout)
    grad_off = torch.cat([grad_TD.new_zeros(1), grad_TD.flatten()])[1:].view_as(grad_TD)
    y_off = torch.cat([y_PD.new_zeros(1), y_PD.flatten()])[1:].view_as(y_PD)
    assert grad_off.data_ptr() % 16 and y_off.data_ptr() % 16
    got_PD, got_TK = weighted_reduce_backward(grad_off, y_off, weights_TK, layout)
    end = int(layout.offsets_E[-1])
    assert torch.equal(got_PD[:end], want_PD[:end])
    torch.testing.assert_close(got_TK, want_TK, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
def test_rows_past_the_segments_are_not_written():
    """A static capacity costs no stores: the kernel leaves its unused rows as they were."""
    grad_TD, y_PD, weights_TK, layout = make_inputs(64, 8, 16, 256, 128, torch.bfloat16, True, 0, "cuda")
    grad_PD = torch.full_like(y_PD, float("nan"))
    grad_weights_TK = torch.empty(weights_TK.shape, dtype=torch.float32, device="cuda")
    kernel = get_weighted_reduce_backward_kernel(256, 8, "bfloat16")
    kernel(grad_TD, y_PD, layout.pos_TK, weights_TK, layout.src_P, layout.offsets_E, grad_PD, grad_weights_TK)
    end = int(layout.offsets_E[-1])
    assert end < layout.num_rows
    assert grad_PD[end:].isnan().all() and not grad_PD[:end].isnan().any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "change,error,argname",
    [
        (dict(grad_TD=torch.ones(4, 64, dtype=torch.float64)), TypeError, "grad_TD"),
        (dict(grad_TD=torch.ones(3, 64)), ValueError, "grad_TD"),
        (dict(y_PD=torch.ones(5, 64)), ValueError, "y_PD"),
        (dict(weights_TK=torch.ones(4, 2).bfloat16()), TypeError, "weights_TK"),
        (dict(layout="rows"), TypeError, "layout"),
    ],
    ids=["grad_dtype", "grad_rows", "y_rows", "weights_dtype", "layout"],
)
def test_bad_input_names_the_argument(device, change, error, argname):
    grad_TD, y_PD, weights_TK, layout = make_inputs(4, 2, 4, 64, 8, torch.float32, False, 0, device)
    args = dict(grad_TD=grad_TD, y_PD=y_PD, weights_TK=weights_TK, layout=layout)
    args.update({name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in change.items()})
    op = weighted_reduce_backward if device == "cuda" else reference.weighted_reduce_backward
    with pytest.raises(error, match=f"^{argname}: expected"):
        op(**args)


SPECIALIZATIONS = [(7168, 8, "bfloat16"), (64, 2, "float32"), (64, 2, "bfloat16"), (300, 6, "float16")]


def test_compiles_for_sm90a():
    """The runtime's combine backward at hidden 7168 and 64 (the small preset), and a row of
    narrow vectors."""
    with lowering.compile_only():
        for spec in SPECIALIZATIONS:
            source = lowering.kernel_source(get_weighted_reduce_backward_kernel(*spec))
            assert "__fmul_rn" in source and "__syncthreads" in source, spec
