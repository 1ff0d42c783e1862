"""kernels.transpose reference vs an element-by-row copy loop, compared byte for byte."""

import pytest
import torch

from kernels.transpose import batched_transpose

pytestmark = pytest.mark.usefixtures("seed")


def random_tensor(shape, dtype):
    if dtype == torch.int32:
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=dtype)
    return torch.randn(shape).to(dtype)


def slow_transpose(x_BMN):
    b, m, n = x_BMN.shape
    out = torch.empty(b, n, m, dtype=x_BMN.dtype)
    for batch in range(b):
        for row in range(m):
            out[batch, :, row] = x_BMN[batch, row, :]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32])
@pytest.mark.parametrize("shape", [(3, 33, 70), (0, 16, 8), (2, 0, 5), (1, 128, 1)])
def test_matches_slow_loop(shape, dtype):
    x_BMN = random_tensor(shape, dtype)
    out = batched_transpose(x_BMN)
    expected = slow_transpose(x_BMN)
    assert out.dtype == dtype and out.shape == expected.shape and out.stride() == expected.stride()
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_2d_and_strided_input(dtype):
    x_MN = random_tensor((130, 257), dtype)
    out = batched_transpose(x_MN)
    expected = slow_transpose(x_MN[None])[0]
    assert out.shape == (257, 130) and out.stride() == (130, 1)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    strided = x_MN[::2, 1::3]  # not contiguous
    assert torch.equal(batched_transpose(strided).view(torch.uint8), slow_transpose(strided[None])[0].view(torch.uint8))
    column = x_MN[:, :1].contiguous()  # its transpose [1, M] is contiguous too, yet must be a copy
    assert batched_transpose(column).data_ptr() != column.data_ptr()


@pytest.mark.parametrize(
    "x,error",
    [([[1, 2]], TypeError), (torch.randn(5), ValueError), (torch.randn(2, 3, 4, 5), ValueError)],
    ids=["list", "1d", "4d"],
)
def test_bad_input_names_the_argument(x, error):
    with pytest.raises(error, match="^x_BMN: expected"):
        batched_transpose(x)
