"""The batched transpose kernel against the reference, byte for byte, for every element width
(float8 included), ragged sizes, 2-D and strided input; outputs start as poison."""

import pytest
import torch

from kernels import lowering
from kernels.transpose import reference
from kernels.transpose.batched_transpose_kernel import (
    MATRIX_COLS,
    _matrix_chunk,
    batched_transpose,
    get_batched_transpose_kernel,
    get_matrix_transpose_kernel,
)
from kernels.testing import poison_allocator


def random_tensor(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype in (torch.int32, torch.int64):
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen).to(dtype)


DTYPES = [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int64]
SHAPES = [(3, 33, 70), (0, 16, 8), (2, 0, 5), (1, 128, 1), (2, 130, 257), (1, 7168 + 64, 300), (4, 256, 512),
          (8, 16, 7168), (2, 5, 300), (3, 1, 64),  # few rows: narrower, wider tiles
          (2, 24, 100), (5, 4, 36), (3, 32, 1000),  # output rows of up to 32 bytes: register blocks
          (3, 16, 96), (1, 16, 32)]  # 2-byte rows of 16: stmatrix, warps left without a block


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_bit_for_bit(shape, dtype, seed):
    x_BMN = random_tensor(shape, dtype, seed)
    poison_allocator("cuda")
    out = batched_transpose(x_BMN.cuda())
    expected = reference.batched_transpose(x_BMN)
    assert out.dtype == dtype and out.shape == expected.shape and out.stride() == expected.stride()
    assert torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_2d_and_strided_input(dtype, seed):
    x_MN = random_tensor((130, 257), dtype, seed).cuda()
    assert torch.equal(batched_transpose(x_MN).cpu().view(torch.uint8), reference.batched_transpose(x_MN.cpu()).view(torch.uint8))
    strided = x_MN[::2, 1::3]
    expected = reference.batched_transpose(strided.cpu())
    assert torch.equal(batched_transpose(strided).cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="^x_BMN: expected"):
        batched_transpose(torch.randn(5, device="cuda"))
    with pytest.raises(ValueError, match="^x_BMN: expected"):
        batched_transpose(torch.randn(4, 5))
    with pytest.raises(TypeError, match="^x_BMN: expected"):
        batched_transpose(torch.zeros(4, 5, dtype=torch.complex128, device="cuda"))


def test_compiles_for_sm90a():
    """One kernel per element width; at the hidden size and the tiny model's 64, and ragged; output
    rows of up to 32 bytes in registers, longer ones through shared memory."""
    with lowering.compile_only():
        for spec, in_registers in [((7168, 2048, "uint8"), False), ((7168, 2048, "uint16"), False),
                                   ((64, 128, "uint32"), False), ((130, 257, "uint64"), False),
                                   ((16, 7168, "uint16"), True), ((16, 7168, "uint8"), True),
                                   ((24, 100, "uint8"), True), ((5, 300, "uint8"), True), ((1, 64, "uint64"), True),
                                   ((33, 70, "uint8"), False)]:
            source = lowering.kernel_source(get_batched_transpose_kernel(*spec))
            assert "batched_transpose" in source and ("__shared__" not in source) == in_registers, spec


def test_matrix_kernel_compiles_for_sm90a():
    with lowering.compile_only():
        for threads in (32, 128, 256):
            source = lowering.kernel_source(get_matrix_transpose_kernel(7168, threads))
            assert "stmatrix" in source and "__syncthreads" not in source, threads


def test_matrix_chunks_fill_the_block_and_every_phase_takes_eight_bank_quads():
    """The 16-byte chunk of (column, half) is a permutation of the warp's 64 chunks; the 8 chunks one
    phase touches (a matrix's 8 columns in stmatrix, 8 consecutive columns in the reads) lie in 8
    different 16-byte bank quads of a 128-byte row of banks."""
    chunks = [_matrix_chunk(c, h) for c in range(MATRIX_COLS) for h in range(2)]
    assert sorted(chunks) == list(range(2 * MATRIX_COLS))
    for half in range(2):
        for k in range(4):  # stmatrix's matrix k: lanes 8k + m name block column 8 * (m // 2) + 2k + m % 2
            assert len({_matrix_chunk(8 * (m // 2) + 2 * k + m % 2, half) % 8 for m in range(8)}) == 8
        for q in range(4):  # the reads: lanes 8q .. 8q + 7 read their own columns
            assert len({_matrix_chunk(8 * q + t, half) % 8 for t in range(8)}) == 8
