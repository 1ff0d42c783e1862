"""Requantization between scale layouts and the lossless per-block cast (kernels.quant.reference):
against a float64 dequantization cast again by the public casts, and the exactness each states."""

import pytest
import torch

from kernels.quant import cast_back, per_block_cast, per_block_cast_lossless, per_channel_cast, per_token_cast, requant
from kernels.testing import cast_input

pytestmark = pytest.mark.usefixtures("seed")

E4M3 = torch.float8_e4m3fn
CASTS = {  # layout: (its cast of a float tensor with 128-sided blocks, its block)
    "per_token": (lambda x, **kw: per_token_cast(x, **kw), (1, 128)),
    "per_block": (lambda x, **kw: per_block_cast(x, **kw), (128, 128)),
    "per_channel": (lambda x, **kw: per_channel_cast(x, **kw), (128, 1)),
}
SF_MODES = {"fp32_sf": (False, False), "ue8m0_sf": (True, False), "packed_sf": (True, True)}


def dequantize_f64(q: torch.Tensor, sf: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q * sf`` per element in float64 (exact: 4 significant bits times 24), then to float32."""
    sf64 = (2.0 ** (sf.double() - 127)) if sf.dtype == torch.uint8 else sf.double()
    sf_MN = sf64.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: q.shape[0], : q.shape[1]]
    return (q.double() * sf_MN).float()


@pytest.mark.parametrize("sf_mode", SF_MODES)
@pytest.mark.parametrize("dst", CASTS)
@pytest.mark.parametrize("src", CASTS)
def test_requant_is_the_cast_of_the_float32_dequantization(src, dst, sf_mode):
    round_sf, pack_sf = SF_MODES[sf_mode]
    src_cast, in_block = CASTS[src]
    dst_cast, out_block = CASTS[dst]
    q_in, sf_in = src_cast(cast_input(200, 300, dtype=torch.float32), round_sf=round_sf, pack_sf=pack_sf)
    q, sf = requant(q_in, sf_in, in_block=in_block, out_block=out_block, round_sf=round_sf, pack_sf=pack_sf)
    q_ref, sf_ref = dst_cast(dequantize_f64(q_in, sf_in, in_block), round_sf=round_sf, pack_sf=pack_sf)
    assert q.dtype == E4M3 and q.shape == (200, 300) and sf.dtype == sf_ref.dtype
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)


def exponents(sf: torch.Tensor) -> torch.Tensor:
    return sf.long() - 127 if sf.dtype == torch.uint8 else torch.frexp(sf)[1].long() - 1


def shifted_e4m3(q_in, e_in_MN, e_out_MN) -> torch.Tensor:
    """``q * 2**(e_in - e_out)`` in float64, rounded once to e4m3 (nearest even)."""
    return (q_in.double() * torch.pow(2.0, (e_in_MN - e_out_MN).double())).to(E4M3)


def expand(t: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    return t.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


@pytest.mark.parametrize("pack_sf", [False, True], ids=["fp32_sf", "packed_sf"])
def test_ue8m0_requant_shifts_each_value_by_its_scales_exponents(pack_sf):
    """With power-of-two scales on both sides each value is ``q * 2**(e_in - e_out)``, rounded once,
    and the out-scale never exceeds its block's largest in-scale."""
    x = cast_input(256, 384, dtype=torch.float32)
    q_in, sf_in = per_token_cast(x, round_sf=True, pack_sf=pack_sf)
    q, sf = requant(q_in, sf_in, in_block=(1, 128), out_block=(128, 128), round_sf=True, pack_sf=pack_sf)
    e_in, e_out = exponents(sf_in), exponents(sf)
    assert (e_out <= e_in.view(2, 128, 3).amax(dim=1)).all()
    expected = shifted_e4m3(q_in, expand(e_in, (1, 128), q.shape), expand(e_out, (128, 128), q.shape))
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def representable_e4m3(m: int, n: int, spread: int) -> torch.Tensor:
    """Random e4m3 values (no NaN) with those below ``2**(spread - 6)`` zeroed, so that every
    nonzero value stays normal when shifted down by up to ``spread`` binary places."""
    codes = torch.randint(0, 256, (m, n), dtype=torch.uint8)
    q = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes).view(E4M3).float()
    return torch.where(q.abs() >= 2.0 ** (spread - 6), q, 0.0).to(E4M3)


@pytest.mark.parametrize("in_block", [(1, 128), (128, 1), (32, 32)])
def test_lossless_round_trip_is_exact_on_representable_input(in_block):
    m, n = 300, 260
    q_in = representable_e4m3(m, n, spread=4)
    sf_in = (torch.randint(-20, -16 + 1, (-(-m // in_block[0]), -(-n // in_block[1]))) + 127).to(torch.uint8)
    q, sf = per_block_cast_lossless(q_in, sf_in, in_block=in_block, pack_sf=True)
    e_in = exponents(sf_in).float()
    max_in = torch.nn.functional.max_pool2d(
        expand(e_in, in_block, (m, n))[None, None], 128, ceil_mode=True)[0, 0].long()
    assert torch.equal(exponents(sf), max_in)  # the out-scale: the block's largest in-scale
    before = cast_back(q_in, sf_in, block=in_block, out_dtype=torch.float32)
    after = cast_back(q, sf, block=(128, 128), out_dtype=torch.float32)
    assert torch.equal(after, before) and before.ne(0).any()
    _, sf_f32 = per_block_cast_lossless(q_in, (2.0 ** (sf_in.float() - 127)), in_block=in_block)
    assert torch.equal(sf_f32, 2.0 ** (sf.float() - 127))


def test_lossless_rounds_a_value_shifted_below_the_grid_to_nearest_even():
    """Two rows of one block, the first's scale 2**3 above the second's: the second's values move
    down three places; those with bits below 2**-9 there round to nearest even."""
    q_in = torch.zeros(2, 128)
    q_in[0, 0] = 448.0
    q_in[1, :4] = torch.tensor([2.0**-6, 3 * 2.0**-9, 2.0**-9 * 12, 1.0])  # -> 2**-9, 3/8 -> 0, 12/8 -> 2, exact
    sf_in = torch.tensor([[2.0**3], [1.0]])
    q, sf = per_block_cast_lossless(q_in.to(E4M3), sf_in, in_block=(1, 128))
    assert sf.tolist() == [[8.0]]
    assert q[1, :4].float().tolist() == [2.0**-9, 0.0, 2 * 2.0**-9, 1.0 / 8]
    assert q[0, 0].float().item() == 448.0


ERRORS = {
    "in_block": (lambda q, sf: requant(q, sf, in_block=(1, 0), out_block=(128, 128)), ValueError, "in_block"),
    "out_block": (lambda q, sf: requant(q, sf, in_block=(1, 128), out_block=128), ValueError, "out_block"),
    "sf_shape": (lambda q, sf: requant(q, sf[:, :1], in_block=(1, 128), out_block=(128, 128)), ValueError, "sf"),
    "q_dtype": (lambda q, sf: requant(q.float(), sf, in_block=(1, 128), out_block=(1, 128)), TypeError, "q"),
    "pack": (lambda q, sf: requant(q, sf, in_block=(1, 128), out_block=(1, 128), pack_sf=True), ValueError, "pack_sf"),
    "lossless_block": (lambda q, sf: per_block_cast_lossless(q, sf, in_block=(1, 128), block=0), ValueError, "block"),
    "lossless_in_block": (lambda q, sf: per_block_cast_lossless(q, sf, in_block=(1,)), ValueError, "in_block"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_names_the_argument(case):
    call, error, argname = ERRORS[case]
    with pytest.raises(error, match=f"^{argname}: expected"):
        call(torch.randn(4, 256).to(E4M3), torch.ones(4, 2))
