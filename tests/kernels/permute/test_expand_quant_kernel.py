"""Expand fused with the per-token FP8 cast against its reference formulation
``per_token_cast(expand(x, layout))``: bit-exact e4m3 bytes and scales for every layout row
(routed and padding), outputs poisoned first."""

import pytest
import torch

from kernels import lowering
from kernels.permute.expand_quant_kernel import expand_per_token_cast, get_expand_per_token_cast_kernel
from kernels.permute import reference
from kernels.permute.reference import expert_layout, max_rows
from kernels.testing import cast_input, poison_allocator, routes

CASES = [  # (T, K, E, D, alignment, input dtype, static capacity)
    (0, 8, 16, 7168, 128, torch.bfloat16, True),
    (1, 2, 4, 64, 8, torch.float32, False),
    (37, 6, 12, 100, 16, torch.bfloat16, True),
    (130, 8, 32, 300, 128, torch.float16, False),
    (200, 8, 64, 7168 + 64, 128, torch.bfloat16, True),
    (513, 4, 8, 7168, 128, torch.bfloat16, False),
]
SF_MODES = {"fp32_sf": (False, False), "ue8m0_sf": (True, False), "packed_sf": (True, True)}


@pytest.mark.gpu
@pytest.mark.parametrize("sf_mode", SF_MODES)
@pytest.mark.parametrize("t,k,e,d,alignment,dtype,capacity", CASES)
def test_matches_reference_bit_for_bit(t, k, e, d, alignment, dtype, capacity, sf_mode, seed):
    round_sf, pack_sf = SF_MODES[sf_mode]
    topk_idx_TK = routes(t, k, e, dtype=torch.int32, seed=seed)
    num_rows = max_rows(t, k, e, alignment) if capacity else None
    layout = expert_layout(topk_idx_TK, e, alignment=alignment, num_rows=num_rows)
    layout_gpu = expert_layout(topk_idx_TK.cuda(), e, alignment=alignment, num_rows=num_rows)
    x_TD = cast_input(t, d, dtype=dtype, seed=seed)
    poison_allocator("cuda")
    q, sf = expand_per_token_cast(x_TD.cuda(), layout_gpu, round_sf=round_sf, pack_sf=pack_sf)
    q_ref, sf_ref = reference.expand_per_token_cast(x_TD, layout, round_sf=round_sf, pack_sf=pack_sf)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q.stride() == q_ref.stride()
    assert sf.dtype == sf_ref.dtype and sf.shape == sf_ref.shape
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(sf.cpu().view(torch.uint8), sf_ref.view(torch.uint8))


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    layout = expert_layout(routes(4, 2, 4, dtype=torch.int32).cuda(), 4, alignment=8)
    with pytest.raises(TypeError, match="^layout: expected"):
        expand_per_token_cast(torch.randn(4, 256, device="cuda"), None)
    with pytest.raises(ValueError, match="^x_TD: expected"):
        expand_per_token_cast(torch.randn(5, 256, device="cuda"), layout)
    with pytest.raises(TypeError, match="^x_TD: expected"):
        expand_per_token_cast(torch.randn(4, 256, device="cuda").to(torch.float8_e4m3fn), layout)
    with pytest.raises(ValueError, match="^group: expected"):
        expand_per_token_cast(torch.randn(4, 256, device="cuda"), layout, group=96)


def test_compiles_for_sm90a():
    """DeepSeek's dispatch (hidden 7168, top-8, bf16) and the tiny model's (hidden 64, float32 and
    bf16, top-2), then a ragged width with packed scales."""
    with lowering.compile_only():
        for spec in [
            (7168, 8, "bfloat16", 128, False, False),
            (7168, 8, "bfloat16", 128, True, True),
            (64, 2, "float32", 128, False, False),
            (64, 2, "bfloat16", 128, False, False),
            (300, 6, "float16", 128, True, True),
        ]:
            assert "fp8" in lowering.kernel_source(get_expand_per_token_cast_kernel(*spec)), spec
