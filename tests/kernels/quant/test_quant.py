"""kernels.quant reference vs an independent, slow formulation (Python loops over blocks, float64
math, a hand-written round-to-nearest-even onto the e4m3 grid)."""

import math
import struct

import pytest
import torch

from kernels.quant import (
    cast_back,
    per_block_cast,
    per_channel_cast,
    per_token_cast,
    swiglu,
    swiglu_backward,
    swiglu_per_token_cast,
)

pytestmark = pytest.mark.usefixtures("seed")

E4M3 = torch.float8_e4m3fn


def f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", v))[0]


AMAX_FLOOR = f32(1e-4)


def e4m3_grid(v_f64: torch.Tensor) -> torch.Tensor:
    """Rounds float64 values with ``|v| <= 448`` to the nearest e4m3 value, ties to even."""
    _, e = torch.frexp(v_f64)  # v = m * 2**e with 0.5 <= |m| < 1
    exponent = (e - 1).clamp(min=-6)  # floor(log2 |v|); subnormals share the quantum of 2**-6
    quantum = torch.ldexp(torch.ones_like(v_f64), exponent - 3)  # 3 mantissa bits
    return torch.round(v_f64 / quantum) * quantum  # torch.round rounds half to even


def slow_cast(x: torch.Tensor, block: tuple[int, int], round_sf: bool):
    """Returns (q as float64 e4m3 values, sf float64, UE8M0 exponents or None), block by block."""
    block_m, block_n = block
    m, n = x.shape
    gm, gn = -(-m // block_m), -(-n // block_n)
    x64 = x.double()
    q = torch.empty(m, n, dtype=torch.float64)
    sf = torch.empty(gm, gn, dtype=torch.float64)
    exponents = torch.empty(gm, gn, dtype=torch.int64)
    for bi in range(gm):
        for bj in range(gn):
            rows, cols = slice(bi * block_m, (bi + 1) * block_m), slice(bj * block_n, (bj + 1) * block_n)
            blk = x64[rows, cols]
            amax = max(blk.abs().max().item(), AMAX_FLOOR)
            if round_sf:
                mantissa, e = math.frexp(f32(amax / 448))
                exponents[bi, bj] = e - 1 if mantissa == 0.5 else e  # exact ceil(log2)
                sf[bi, bj] = 2.0 ** exponents[bi, bj].item()
                scaled = blk / sf[bi, bj]
            else:
                sf[bi, bj] = f32(amax / 448)
                scaled = (blk * f32(448 / amax)).float().double()  # the float32 product
            q[rows, cols] = e4m3_grid(scaled.clamp(-448, 448))
    return q, sf, exponents if round_sf else None


def make_input(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows spanning six decades of magnitude, with one all-zero and one tiny (amax < 1e-4)
    region, so the amax floor is exercised whenever the tensor is big enough."""
    x = torch.randn(m, n) * torch.logspace(-3, 3, max(m, 1))[:m, None]
    x[: m // 3, : n // 4] = 0.0
    x[m // 3 : m // 2, n // 2 :] *= 1e-7
    return x.to(dtype)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


LAYOUTS = {
    "per_token": (per_token_cast, "group", lambda size: (1, size)),
    "per_block": (per_block_cast, "block", lambda size: (size, size)),
    "per_channel": (per_channel_cast, "block", lambda size: (size, 1)),
}
SHAPES = [  # (M or T, N or D, block size, input dtype)
    (0, 200, 128, torch.float32),
    (33, 100, 128, torch.bfloat16),
    (130, 300, 128, torch.float16),
    (200, 256, 64, torch.float32),
]


@pytest.mark.parametrize("round_sf", [False, True], ids=["fp32_sf", "ue8m0_sf"])
@pytest.mark.parametrize("m,n,size,dtype", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cast_matches_slow_formulation(layout, m, n, size, dtype, round_sf):
    op, size_arg, block_of = LAYOUTS[layout]
    x = make_input(m, n, dtype)
    q, sf = op(x, **{size_arg: size}, round_sf=round_sf)
    q_ref, sf_ref, _ = slow_cast(x, block_of(size), round_sf)
    assert q.dtype == E4M3 and q.shape == (m, n) and q.stride() == (n, 1)
    assert sf.dtype == torch.float32 and sf.shape == sf_ref.shape
    assert torch.equal(bytes_of(q), bytes_of(q_ref.to(E4M3)))
    assert torch.equal(sf.double(), sf_ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_scales_are_ue8m0_exponents(layout):
    op, size_arg, block_of = LAYOUTS[layout]
    x = make_input(150, 260, torch.bfloat16)
    q, sf_u8 = op(x, **{size_arg: 128}, round_sf=True, pack_sf=True)
    q_ref, _, exponents = slow_cast(x, block_of(128), round_sf=True)
    assert sf_u8.dtype == torch.uint8
    assert torch.equal(sf_u8.long(), exponents + 127)
    assert torch.equal(bytes_of(q), bytes_of(q_ref.to(E4M3)))


def test_amax_floor_for_zero_and_tiny_blocks():
    x = torch.randn(3, 256)
    x[0] = 0.0
    x[1, :128] = 1e-6 * torch.randn(128)  # amax below the 1e-4 floor
    q, sf = per_token_cast(x)
    floor_sf = f32(AMAX_FLOOR / 448)
    assert sf[0].tolist() == [floor_sf, floor_sf] and sf[1, 0].item() == floor_sf
    assert not bytes_of(q[0]).any()
    assert torch.equal(bytes_of(q[1, :128]), bytes_of(slow_cast(x[1:2, :128], (1, 128), False)[0].to(E4M3))[0])
    _, sf_u8 = per_token_cast(x, round_sf=True, pack_sf=True)
    assert sf_u8[0].tolist() == [127 - 22, 127 - 22]  # ceil(log2(1e-4 / 448)) = -22


def test_amax_element_and_ties_round_to_nearest_even():
    # With round_sf and amax = 448 * 2**5 the scale is exactly 2**5, so q = x / 32 exactly.
    x = 32.0 * torch.tensor([[448.0, -448.0, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -(2.0**-10)]])
    q, sf = per_token_cast(x, round_sf=True)
    assert sf.item() == 32.0
    # 448 -> 0x7E; 17 (between 16 and 18) -> 16 = 0x58; 19 -> 20 = 0x5A; 2**-10 -> 0;
    # 3 * 2**-10 -> 2 * 2**-9 = 0x02; -(2**-10) -> -0 = 0x80.
    assert bytes_of(q).tolist() == [[0x7E, 0xFE, 0x58, 0x5A, 0x00, 0x02, 0x80]]
    # Without rounding the amax element of every block maps to +-448 exactly.
    x = make_input(16, 384, torch.float32)
    q, _ = per_token_cast(x)
    amax_at = x.view(16, 3, 128).abs().argmax(dim=2)
    q_at_amax = q.float().view(16, 3, 128).gather(2, amax_at[..., None])
    nonzero = x.view(16, 3, 128).abs().amax(dim=2, keepdim=True) > 1e-4
    assert torch.equal(q_at_amax.abs()[nonzero], torch.full_like(q_at_amax[nonzero], 448.0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cast_back_matches_slow_dequantization(layout):
    op, size_arg, block_of = LAYOUTS[layout]
    block_m, block_n = block_of(128)
    x = make_input(140, 270, torch.bfloat16)
    q, sf = op(x, **{size_arg: 128}, round_sf=True)
    _, sf_u8 = op(x, **{size_arg: 128}, round_sf=True, pack_sf=True)
    expected = torch.empty(140, 270)
    for bi in range(sf.shape[0]):
        for bj in range(sf.shape[1]):
            rows, cols = slice(bi * block_m, (bi + 1) * block_m), slice(bj * block_n, (bj + 1) * block_n)
            expected[rows, cols] = q[rows, cols].float() * sf[bi, bj]
    out = cast_back(q, sf, block=(block_m, block_n), out_dtype=torch.float32)
    assert torch.equal(out, expected)
    assert torch.equal(cast_back(q, sf_u8, block=(block_m, block_n), out_dtype=torch.float32), expected)
    out_bf16 = cast_back(q, sf, block=(block_m, block_n))
    assert out_bf16.dtype == torch.bfloat16 and torch.equal(out_bf16, expected.bfloat16())


@pytest.mark.parametrize("round_sf", [False, True], ids=["fp32_sf", "ue8m0_sf"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_error_bound(layout, round_sf):
    """Per element ``|cast_back(cast(x)) - x| <= 2**-4 * |x| + 2**-9 * sf``: e4m3 keeps 3 mantissa
    bits (relative error <= 2**-4 on its normal range); below 2**-6 (subnormals) the step is 2**-9,
    so the absolute error there is <= 2**-10 in units of sf (the bound leaves 2x for the float32
    scale roundings)."""
    op, size_arg, block_of = LAYOUTS[layout]
    block_m, block_n = block_of(128)
    x = make_input(300, 260, torch.float32)
    q, sf = op(x, **{size_arg: 128}, round_sf=round_sf)
    out = cast_back(q, sf, block=(block_m, block_n), out_dtype=torch.float32)
    sf_MN = sf.repeat_interleave(block_m, 0).repeat_interleave(block_n, 1)[:300, :260]
    assert ((out - x).abs() <= 2.0**-4 * x.abs() + 2.0**-9 * sf_MN).all()


def swiglu_f64(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.bfloat16, 2.0**-8)])
def test_swiglu_matches_float64(dtype, rtol):
    x = (3 * torch.randn(37, 2 * 100)).to(dtype)
    y = swiglu(x)
    assert y.dtype == dtype and y.shape == (37, 100)
    torch.testing.assert_close(y.double(), swiglu_f64(x), rtol=rtol, atol=1e-6)
    assert swiglu(torch.randn(0, 8)).shape == (0, 4)


@pytest.mark.parametrize("round_sf", [False, True], ids=["fp32_sf", "ue8m0_sf"])
def test_swiglu_per_token_cast_quantizes_the_float32_result(round_sf):
    x = (3 * torch.randn(21, 2 * 300)).bfloat16()
    q, sf = swiglu_per_token_cast(x, round_sf=round_sf)
    gate, up = x.float().chunk(2, dim=1)
    q_ref, sf_ref, _ = slow_cast(torch.nn.functional.silu(gate) * up, (1, 128), round_sf)
    assert q.shape == (21, 300) and sf.shape == (21, 3)
    assert torch.equal(bytes_of(q), bytes_of(q_ref.to(E4M3)))
    assert torch.equal(sf.double(), sf_ref)
    _, sf_u8 = swiglu_per_token_cast(x, group=64, round_sf=True, pack_sf=True)
    assert sf_u8.dtype == torch.uint8 and sf_u8.shape == (21, 5)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2.0**-7)])
def test_swiglu_backward_matches_autograd(dtype, rtol):
    x = (3 * torch.randn(29, 2 * 96)).to(dtype)
    grad = torch.randn(29, 96).to(dtype)
    x64 = x.double().requires_grad_()
    swiglu_f64(x64).backward(grad.double())
    out = swiglu_backward(x, grad)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), x64.grad, rtol=rtol, atol=1e-5)


def _x():
    return torch.randn(4, 256)


ERRORS = {
    "x_not_tensor": (lambda: per_token_cast([[1.0]]), TypeError, "x_TD"),
    "x_int": (lambda: per_token_cast(torch.ones(4, 8, dtype=torch.int32)), TypeError, "x_TD"),
    "x_3d": (lambda: per_token_cast(torch.randn(2, 4, 8)), ValueError, "x_TD"),
    "group_zero": (lambda: per_token_cast(_x(), group=0), ValueError, "group"),
    "pack_without_round": (lambda: per_token_cast(_x(), pack_sf=True), ValueError, "pack_sf"),
    "block_x_fp8": (lambda: per_block_cast(_x().to(E4M3)), TypeError, "x_MN"),
    "block_negative": (lambda: per_block_cast(_x(), block=-128), ValueError, "block"),
    "channel_x_1d": (lambda: per_channel_cast(torch.randn(8)), ValueError, "x_MN"),
    "channel_pack_without_round": (lambda: per_channel_cast(_x(), pack_sf=True), ValueError, "pack_sf"),
    "cast_back_q_float": (lambda: cast_back(_x(), torch.ones(4, 2), block=(1, 128)), TypeError, "q"),
    "cast_back_sf_shape": (lambda: cast_back(_x().to(E4M3), torch.ones(4, 3), block=(1, 128)), ValueError, "sf"),
    "cast_back_sf_dtype": (
        lambda: cast_back(_x().to(E4M3), torch.ones(4, 2, dtype=torch.float16), block=(1, 128)),
        TypeError,
        "sf",
    ),
    "cast_back_block_int": (lambda: cast_back(_x().to(E4M3), torch.ones(1, 2), block=128), ValueError, "block"),
    "cast_back_block_zero": (lambda: cast_back(_x().to(E4M3), torch.ones(4, 2), block=(1, 0)), ValueError, "block"),
    "cast_back_out_dtype": (
        lambda: cast_back(_x().to(E4M3), torch.ones(4, 2), block=(1, 128), out_dtype=torch.int32),
        TypeError,
        "out_dtype",
    ),
    "swiglu_odd": (lambda: swiglu(torch.randn(4, 7)), ValueError, "x_TI2"),
    "swiglu_int": (lambda: swiglu(torch.ones(4, 8, dtype=torch.int64)), TypeError, "x_TI2"),
    "swiglu_cast_group": (lambda: swiglu_per_token_cast(_x(), group=0), ValueError, "group"),
    "swiglu_cast_pack": (lambda: swiglu_per_token_cast(_x(), pack_sf=True), ValueError, "pack_sf"),
    "swiglu_backward_x": (lambda: swiglu_backward(torch.randn(4, 7), torch.randn(4, 3)), ValueError, "x_TI2"),
    "swiglu_backward_grad_shape": (lambda: swiglu_backward(_x(), torch.randn(4, 256)), ValueError, "grad_TI"),
    "swiglu_backward_grad_dtype": (
        lambda: swiglu_backward(_x(), torch.ones(4, 128, dtype=torch.int32)),
        TypeError,
        "grad_TI",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_names_the_argument(case):
    call, error, argname = ERRORS[case]
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()
