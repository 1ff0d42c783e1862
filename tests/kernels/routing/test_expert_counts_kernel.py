"""The expert-counts kernel against the reference on the same CUDA device, and its sm_90a compile."""

import pytest
import torch

from kernels.lowering import compile_only
from kernels.routing import reference
from kernels.routing.expert_counts_kernel import expert_counts, get_expert_counts_kernel
from kernels.testing import poison_allocator, routes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_experts, topk", [(256, 8), (8, 2), (12, 3), (1, 1)])
@pytest.mark.parametrize("num_tokens", [0, 1, 37, 4099, 16384])
def test_expert_counts_matches_reference(seed, num_tokens, num_experts, topk, dtype):
    idx_TK = routes(num_tokens, topk, num_experts, dtype=dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    counts_E = expert_counts(idx_TK, num_experts)
    assert counts_E.dtype == torch.int32
    assert torch.equal(counts_E, reference.expert_counts(idx_TK, num_experts))


@pytest.mark.gpu
def test_expert_counts_of_a_strided_view(seed):
    wide_TN = routes(1000, 16, 64, device="cuda", seed=seed)
    idx_TK = wide_TN[:, 3:11]  # strides (16, 1): copied before the kernel reads it
    assert torch.equal(expert_counts(idx_TK, 64), reference.expert_counts(idx_TK, 64))


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="^topk_idx_TK: expected"):
        expert_counts(torch.zeros(4, 2), 8)
    with pytest.raises(ValueError, match="^topk_idx_TK: expected"):
        expert_counts(torch.zeros(4, 2, dtype=torch.int64), 8)  # not on CUDA


@pytest.mark.parametrize("num_experts, index_dtype", [(256, "int64"), (8, "int32"), (72, "int64")])
def test_compiles_for_sm90a(num_experts, index_dtype):
    with compile_only():
        kernel = get_expert_counts_kernel(num_experts, index_dtype)
    assert "expert_counts_kernel" in kernel.get_kernel_source()
