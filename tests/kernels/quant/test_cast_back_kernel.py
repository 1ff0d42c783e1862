"""The FP8 dequantization kernel against the reference ``cast_back``: bit-exact (one float32
multiply, then one rounding to ``out_dtype``), every output element written."""

import pytest
import torch

from kernels import lowering
from kernels.quant import reference
from kernels.quant.cast_back_kernel import cast_back, get_cast_back_kernel
from kernels.testing import cast_input, poison_allocator

CASES = [  # (M, N, block, out dtype)
    (0, 7168, (1, 128), torch.bfloat16),
    (3, 64, (1, 128), torch.float32),
    (37, 100, (1, 128), torch.bfloat16),
    (130, 300, (1, 128), torch.float16),
    (200, 7168 + 64, (1, 128), torch.bfloat16),
    (129, 256, (1, 64), torch.float32),
    (257, 300, (128, 128), torch.bfloat16),
    (200, 7168, (128, 128), torch.float32),
    (130, 300, (128, 1), torch.bfloat16),
    (4096 + 37, 7168 + 64, (1, 128), torch.bfloat16),  # many CTAs, ragged
    (65, 300, (1, 2), torch.bfloat16),  # blocks narrower than a vector: staged per-token scales
    (4096, 300, (1, 64), torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["fp32_sf", "packed_sf"])
@pytest.mark.parametrize("m,n,block,out_dtype", CASES)
def test_matches_reference_bit_for_bit(m, n, block, out_dtype, packed, seed):
    x = cast_input(m, n, dtype=torch.float32, seed=seed)
    q, sf = reference._blockwise_cast(x, block, round_sf=packed, pack_sf=packed)
    poison_allocator("cuda")
    out = cast_back(q.cuda(), sf.cuda(), block=block, out_dtype=out_dtype)
    expected = reference.cast_back(q, sf, block=block, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n) and out.stride() == expected.stride()
    assert torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "call,error,argname",
    [
        (lambda q, sf: cast_back(q.float(), sf, block=(1, 128)), TypeError, "q"),
        (lambda q, sf: cast_back(q.cpu(), sf, block=(1, 128)), ValueError, "q"),
        (lambda q, sf: cast_back(q, sf[:, :1], block=(1, 128)), ValueError, "sf"),
        (lambda q, sf: cast_back(q, sf, block=(1, 100)), ValueError, "block"),
        (lambda q, sf: cast_back(q, sf, block=(1, 128), out_dtype=torch.int32), TypeError, "out_dtype"),
    ],
    ids=["q_dtype", "q_device", "sf_shape", "block", "out_dtype"],
)
def test_bad_input_names_the_argument(call, error, argname):
    q = torch.randn(4, 256, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(error, match=f"^{argname}: expected"):
        call(q, torch.ones(4, 2, device="cuda"))


SPECIALIZATIONS = [  # (num_cols, block_m, block_n, packed, out_dtype): what the runtime dequantizes, then ragged
    (7168, 1, 128, False, "bfloat16"),
    (64, 1, 128, False, "float32"),
    (64, 1, 128, False, "bfloat16"),
    (300, 128, 128, True, "float32"),
    (7168, 128, 1, False, "float16"),
    (300, 1, 2, False, "bfloat16"),  # per-token blocks narrower than a vector: staged
]


def test_compiles_for_sm90a():
    with lowering.compile_only():
        for spec in SPECIALIZATIONS:
            assert "fp8" in lowering.kernel_source(get_cast_back_kernel(*spec)), spec
