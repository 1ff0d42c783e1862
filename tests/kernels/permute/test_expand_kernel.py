"""The expand/unexpand row-copy kernels against the references on the same CUDA device, bit for bit
(random bytes in every dtype, NaN patterns included), outputs poisoned first; argument errors; and
their sm_90a compile at the runtime's shapes."""

import pytest
import torch

from kernels import lowering
from kernels.permute import expert_layout, max_rows, reference
from kernels.permute.expand_kernel import expand, get_expand_kernel, get_kernel_args, get_unexpand_kernel, unexpand
from kernels.testing import poison_allocator, random_bits, routes, spy

E4M3 = torch.float8_e4m3fn
CASES = [  # (T, K, E, D, alignment, dtype, static capacity)
    (0, 8, 16, 7168, 128, torch.bfloat16, True),  # no tokens: every row is padding
    (0, 8, 16, 64, 8, torch.bfloat16, False),  # no tokens, no rows
    (1, 2, 4, 64, 8, torch.float32, False),
    (37, 6, 12, 100, 16, torch.bfloat16, True),  # 200-byte rows: 8-byte vectors
    (37, 6, 12, 100, 16, E4M3, False),  # 100-byte rows: 4-byte vectors
    (130, 8, 32, 100, 128, torch.float32, True),
    (29, 3, 5, 7, 4, E4M3, True),  # 7-byte rows: byte copies
    (29, 3, 5, 7, 4, torch.bfloat16, False),  # 14-byte rows: 2-byte copies
    (200, 8, 64, 7168 + 64, 128, torch.bfloat16, True),
    (200, 8, 64, 7168 + 64, 128, E4M3, False),
    (513, 4, 8, 7168, 128, torch.float32, False),  # two column tiles per row, the second partial
    (1025, 8, 256, 7168, 128, torch.bfloat16, False),
]


def make_layout(t, k, e, alignment, capacity, seed):
    topk_idx_TK = routes(t, k, e, dtype=torch.int32, device="cuda", seed=seed)
    return expert_layout(topk_idx_TK, e, alignment=alignment, num_rows=max_rows(t, k, e, alignment) if capacity else None)


def assert_same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,d,alignment,dtype,capacity", CASES)
def test_expand_matches_reference_bit_for_bit(t, k, e, d, alignment, dtype, capacity, seed):
    layout = make_layout(t, k, e, alignment, capacity, seed)
    x_TD = random_bits(t, d, dtype=dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    got, want = expand(x_TD, layout), reference.expand(x_TD, layout)
    end = int(layout.offsets_E[-1])  # rows past the segments are unspecified (a capacity's unused rows)
    assert got.shape == want.shape
    assert_same_bits(got[:end], want[:end])


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,d,alignment,dtype,capacity", CASES)
def test_unexpand_matches_reference_bit_for_bit(t, k, e, d, alignment, dtype, capacity, seed):
    layout = make_layout(t, k, e, alignment, capacity, seed)
    y_PD = random_bits(layout.num_rows, d, dtype=dtype, device="cuda", seed=seed + 1)
    poison_allocator("cuda")
    assert_same_bits(unexpand(y_PD, layout), reference.unexpand(y_PD, layout))


@pytest.mark.gpu
def test_unaligned_and_strided_inputs_are_copied_first(seed):
    layout = make_layout(64, 4, 8, 16, False, seed)
    big = random_bits(65, 100, dtype=E4M3, device="cuda", seed=seed)
    x_TD = big[1:]  # starts 100 bytes in: not on a 16-byte boundary
    assert_same_bits(expand(x_TD, layout), reference.expand(x_TD, layout))
    y_DP = random_bits(96, layout.num_rows, dtype=torch.bfloat16, device="cuda", seed=seed)
    assert_same_bits(unexpand(y_DP.t(), layout), reference.unexpand(y_DP.t(), layout))


@pytest.mark.gpu
def test_public_ops_take_the_kernels_on_hopper(monkeypatch, seed):
    from kernels import permute
    from kernels.permute import expand_kernel

    expands, unexpands = spy(monkeypatch, expand_kernel, "expand"), spy(monkeypatch, expand_kernel, "unexpand")
    layout = make_layout(300, 8, 32, 128, False, seed)
    x_TD = random_bits(300, 7168, device="cuda", seed=seed)
    y_PD = permute.expand(x_TD, layout)
    assert_same_bits(y_PD, reference.expand(x_TD, layout))
    assert_same_bits(permute.unexpand(y_PD, layout), reference.unexpand(y_PD, layout))
    assert len(expands) == len(unexpands) == 1


def test_bad_input_names_the_argument():
    layout = reference.expert_layout(routes(4, 2, 4, dtype=torch.int32), 4, alignment=8)
    with pytest.raises(TypeError, match="^layout: expected"):
        expand(torch.randn(4, 256), None)
    with pytest.raises(TypeError, match="^x_TD: expected"):
        expand([[1.0]], layout)
    with pytest.raises(ValueError, match="^x_TD: expected"):
        expand(torch.randn(5, 256), layout)
    with pytest.raises(ValueError, match="^x_TD: expected a tensor on a CUDA device"):
        expand(torch.randn(4, 256), layout)
    with pytest.raises(ValueError, match="^y_PD: expected"):
        unexpand(torch.randn(layout.num_rows + 1, 256), layout)
    with pytest.raises(ValueError, match="^y_PD: expected a tensor on a CUDA device"):
        unexpand(torch.randn(layout.num_rows, 256), layout)


def test_specializations_depend_on_vector_width_only():
    # Every row of a whole number of 16-byte vectors in (512, 1024] vectors shares one kernel.
    assert get_kernel_args(7168 * 2) == get_kernel_args(7168 * 4) == get_kernel_args((7168 + 64) * 2)
    assert get_kernel_args(64 * 2) == get_kernel_args(64 * 4) == get_kernel_args(100 * 4)
    assert get_kernel_args(7) == ("uint8", 1, 32) and get_kernel_args(14) == ("int16", 1, 32)


def test_compiles_for_sm90a():
    """The runtime's rows: hidden 7168 in bf16 (DeepSeek's dispatch), hidden 64 in bf16 or
    float32 (the tiny model; both one specialization)."""
    with lowering.compile_only():
        for row_bytes in (7168 * 2, 64 * 4):
            args = get_kernel_args(row_bytes)
            assert "expand_kernel" in lowering.kernel_source(get_expand_kernel(*args)), args
            assert "unexpand_kernel" in lowering.kernel_source(get_unexpand_kernel(*args)), args
