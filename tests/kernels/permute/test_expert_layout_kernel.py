"""The sync-free expert-layout kernels against the reference on the same CUDA device, and their
sm_90a compile. Every output is compared bit for bit (counts, offsets, positions, inverse). Up to
512 tokens of top-8 (``ONE_CTA_ROUTES``) and 512 experts the layout is the one-CTA kernel; more
tokens, or 1024 experts, take the three passes."""

import pytest
import torch

from kernels.lowering import compile_only, waits_first
from kernels.permute import reference
from kernels.permute.expert_layout_kernel import (
    ONE_CTA_ROUTES,
    expert_layout,
    get_expert_layout_one_cta_kernel,
    get_expert_layout_rank_kernel,
    get_expert_layout_scan_kernel,
    get_expert_layout_scatter_kernel,
)
from kernels.testing import poison_allocator, routes


def check_layout(idx_TK, num_experts, alignment, num_rows):
    poison_allocator(idx_TK.device)
    got = expert_layout(idx_TK, num_experts, alignment=alignment, num_rows=num_rows)
    want = reference.expert_layout(idx_TK, num_experts, alignment=alignment, num_rows=num_rows)
    for name in ("counts_E", "offsets_E", "pos_TK", "src_P"):
        assert getattr(got, name).dtype == torch.int32, name
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.alignment == alignment


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("alignment", [1, 8, 128])
@pytest.mark.parametrize("num_experts, topk", [(256, 8), (8, 2), (1, 1), (72, 3), (1024, 4)])
@pytest.mark.parametrize("num_tokens", [0, 1, 37, ONE_CTA_ROUTES // 8, 4099, 16384])
def test_expert_layout_matches_reference(seed, num_tokens, num_experts, topk, alignment, index_dtype):
    idx_TK = routes(num_tokens, topk, num_experts, dtype=index_dtype, device="cuda", seed=seed)
    check_layout(idx_TK, num_experts, alignment, reference.max_rows(num_tokens, topk, num_experts, alignment) + 5)


@pytest.mark.gpu
def test_expert_layout_one_hot_expert(seed):
    # Every route on one expert: a single segment spanning every CTA's chunk.
    idx_TK = torch.full((5000, 8), 3, dtype=torch.int64, device="cuda")
    idx_TK[::7, 2] = -1
    check_layout(idx_TK, 16, 128, reference.max_rows(5000, 8, 16, 128))


@pytest.mark.gpu
def test_expert_layout_of_a_strided_view(seed):
    idx_TK = routes(999, 16, 64, device="cuda", seed=seed)[:, 5:13]  # strides (16, 1)
    check_layout(idx_TK, 64, 32, reference.max_rows(999, 8, 64, 32))


@pytest.mark.gpu
def test_public_op_trims_to_the_exact_rows(seed):
    from kernels.permute import expert_layout as public

    idx_TK = routes(777, 4, 32, device="cuda", seed=seed)
    got = public(idx_TK, 32, alignment=16)
    want = reference.expert_layout(idx_TK, 32, alignment=16)
    assert torch.equal(got.src_P, want.src_P) and torch.equal(got.pos_TK, want.pos_TK)


def test_bad_input_names_the_argument():
    idx_TK = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="^topk_idx_TK: expected"):
        expert_layout(idx_TK.float(), 8, num_rows=1000)
    with pytest.raises(ValueError, match="^topk_idx_TK: expected"):
        expert_layout(idx_TK, 8, num_rows=1000)  # not on CUDA


@pytest.mark.parametrize("num_experts, alignment, index_dtype",
                         [(256, 128, "int64"), (8, 8, "int64"), (72, 1, "int32"), (128, 8, "int32"), (512, 8, "int32")])
def test_compiles_for_sm90a(num_experts, alignment, index_dtype):
    with compile_only():
        kernels = [
            get_expert_layout_rank_kernel(num_experts, index_dtype),
            get_expert_layout_scan_kernel(num_experts, alignment),
            get_expert_layout_scatter_kernel(num_experts, index_dtype),
            get_expert_layout_one_cta_kernel(num_experts, alignment, index_dtype),
        ]
    for kernel in kernels:
        source = kernel.get_kernel_source()
        assert "expert_layout" in source and waits_first(source)
