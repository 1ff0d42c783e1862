"""The batched transpose kernel against the reference, byte for byte, for every element width
(float8 included), ragged sizes, 2-D and strided input; outputs start as poison."""

import pytest
import torch

from kernels import lowering
from kernels.transpose import reference
from kernels.transpose.batched_transpose_kernel import batched_transpose, get_batched_transpose_kernel
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
          (2, 16, 301)]  # register blocks of one column: 1- and 2-byte loads


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
    rows of up to 32 bytes in registers (their loads of 1, 2, 4, 8 and 16 bytes each compiled),
    longer ones through shared memory."""
    with lowering.compile_only():
        for spec, in_registers in [((7168, 2048, "uint8"), False), ((7168, 2048, "uint16"), False),
                                   ((64, 128, "uint32"), False), ((130, 257, "uint64"), False),
                                   ((16, 7168, "uint16"), True), ((16, 7168, "uint8"), True),
                                   ((24, 100, "uint8"), True), ((5, 300, "uint8"), True), ((1, 64, "uint64"), True),
                                   ((33, 70, "uint8"), False), ((16, 301, "uint8"), True), ((16, 301, "uint16"), True),
                                   ((8, 100, "uint32"), True)]:
            source = lowering.kernel_source(get_batched_transpose_kernel(*spec))
            assert "batched_transpose" in source and ("__shared__" not in source) == in_registers, spec
