"""Expand fused with the FP8 cast back against its reference formulation
``expand(cast_back(q, sf), layout)``: the same bits in every layout row up to ``offsets_E[-1]``
(routed and padding), outputs poisoned first; rows no route points to hold NaN bytes (a receive
buffer's unused rows) and must not matter."""

import pytest
import torch

from kernels import lowering
from kernels.permute.expand_cast_back_kernel import expand_cast_back, get_expand_cast_back_kernel
from kernels.permute import reference
from kernels.permute.reference import expert_layout, max_rows
from kernels.testing import fp8_rows, poison_allocator, routes

CASES = [  # (T, K, E, D, alignment, output dtype, static capacity)
    (0, 8, 16, 7168, 128, torch.bfloat16, True),
    (1, 2, 4, 64, 8, torch.float32, False),
    (37, 6, 12, 100, 16, torch.bfloat16, True),
    (130, 8, 32, 300, 128, torch.float16, False),
    (200, 8, 64, 7168 + 64, 128, torch.bfloat16, True),
    (513, 4, 8, 7168, 8, torch.bfloat16, False),
    (1024, 8, 128, 7168, 128, torch.bfloat16, True),
]
NAN_E4M3 = 0x7F


def _received(t: int, k: int, e: int, d: int, *, packed: bool, seed: int):
    """Routes where every fourth row has none (an unused receive row, its bytes all NaN) and the
    rows' FP8 values with their scales."""
    topk_idx_TK = routes(t, k, e, dtype=torch.int32, seed=seed)
    topk_idx_TK[::4] = -1
    q_TD, sf_TG = fp8_rows(t, d, packed=packed, seed=seed)
    q_TD.view(torch.uint8)[::4] = NAN_E4M3
    return topk_idx_TK, q_TD, sf_TG


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["fp32_sf", "packed_sf"])
@pytest.mark.parametrize("t,k,e,d,alignment,dtype,capacity", CASES)
def test_matches_reference_bit_for_bit(t, k, e, d, alignment, dtype, capacity, packed, seed):
    topk_idx_TK, q_TD, sf_TG = _received(t, k, e, d, packed=packed, seed=seed)
    num_rows = max_rows(t, k, e, alignment) if capacity else None
    layout = expert_layout(topk_idx_TK, e, alignment=alignment, num_rows=num_rows)
    layout_gpu = expert_layout(topk_idx_TK.cuda(), e, alignment=alignment, num_rows=num_rows)
    poison_allocator("cuda")
    x_PD = expand_cast_back(q_TD.cuda(), sf_TG.cuda(), layout_gpu, out_dtype=dtype)
    x_ref = reference.expand_cast_back(q_TD, sf_TG, layout, out_dtype=dtype)
    assert x_PD.dtype == x_ref.dtype and x_PD.shape == x_ref.shape and x_PD.stride() == x_ref.stride()
    used = int(layout.offsets_E[-1])
    assert torch.equal(x_PD[:used].cpu().view(torch.uint8), x_ref[:used].view(torch.uint8))


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    layout = expert_layout(routes(4, 2, 4, dtype=torch.int32).cuda(), 4, alignment=8)
    q, sf = fp8_rows(4, 256, device="cuda")
    with pytest.raises(TypeError, match="^layout: expected"):
        expand_cast_back(q, sf, None)
    with pytest.raises(ValueError, match="^q_TD: expected"):
        expand_cast_back(q[:3], sf, layout)
    with pytest.raises(TypeError, match="^q_TD: expected"):
        expand_cast_back(q.float(), sf, layout)
    with pytest.raises(ValueError, match="^sf_TG: expected"):
        expand_cast_back(q, sf[:, :1], layout)
    with pytest.raises(ValueError, match="^group: expected"):
        expand_cast_back(q, sf, layout, group=96)
    with pytest.raises(TypeError, match="^out_dtype: expected"):
        expand_cast_back(q, sf, layout, out_dtype=torch.int32)


def test_reference_dequantizes_each_routed_row():
    """The reference by hand: layout row p is row ``src_P[p] // K`` times its scales."""
    topk_idx_TK, q_TD, sf_TG = _received(40, 4, 8, 300, packed=False, seed=3)
    layout = expert_layout(topk_idx_TK, 8, alignment=8)
    x_PD = reference.expand_cast_back(q_TD, sf_TG, layout, out_dtype=torch.float32)
    for p, src in enumerate(layout.src_P.tolist()):
        if src < 0:
            assert not x_PD[p].any()
            continue
        t = src // 4
        expected = q_TD[t].float() * sf_TG[t].repeat_interleave(128)[:300]
        assert torch.equal(x_PD[p], expected)


def test_compiles_for_sm90a():
    """DeepSeek's dispatch (hidden 7168, top-8, bf16 out) with float32 and packed scales, the tiny
    model's (hidden 64, top-2, float32 out), then a ragged width."""
    with lowering.compile_only():
        for spec in [
            (7168, 8, 128, False, "bfloat16"),
            (7168, 8, 128, True, "bfloat16"),
            (64, 2, 128, False, "float32"),
            (300, 6, 128, False, "float16"),
        ]:
            source = lowering.kernel_source(get_expand_cast_back_kernel(*spec))
            assert "fp8" in source and lowering.waits_first(source), spec
