"""Scales to and from the MN-major TMA-aligned layout (kernels.transpose reference) against a
slow element-by-element formulation: strides, padding, packed words bit for bit, round trips."""

import pytest
import torch

from kernels.quant import per_token_cast
from kernels.transpose import sf_to_mn_major, sf_to_row_major

pytestmark = pytest.mark.usefixtures("seed")

SHAPES = [(1, 1), (5, 56), (128, 57), (130, 3), (0, 8)]  # (M, G)


def ue8m0_scales(m: int, g: int) -> torch.Tensor:
    return (torch.randint(-30, 30, (m, g)) + 127).to(torch.uint8)


def storage_of(sf_mn: torch.Tensor) -> torch.Tensor:
    """The ``[W, align(M, 4)]`` memory under an MN-major view (padding included)."""
    m, w = sf_mn.shape
    return torch.as_strided(sf_mn, (w, -(-m // 4) * 4), (sf_mn.stride(1), 1))


def slow_words(exponents_MG: torch.Tensor) -> torch.Tensor:
    m, g = exponents_MG.shape
    words = torch.zeros(m, -(-g // 4), dtype=torch.int32)
    for row in range(m):
        for w in range(words.shape[1]):
            word = sum(int(exponents_MG[row, k]) << (8 * (k - 4 * w)) for k in range(4 * w, min(4 * w + 4, g)))
            words[row, w] = word - (1 << 32) if word >= 1 << 31 else word
    return words


@pytest.mark.parametrize("m,g", SHAPES)
def test_float_scales_transpose_into_padded_columns(m, g):
    sf_MG = torch.rand(m, g) + 0.5
    out = sf_to_mn_major(sf_MG)
    m_aligned = -(-m // 4) * 4
    assert out.dtype == torch.float32 and out.shape == (m, g)
    assert m == 0 or out.stride() == (1, m_aligned)
    assert torch.equal(out, sf_MG)
    if m:
        assert not storage_of(out)[:, m:].any()
    assert torch.equal(sf_to_row_major(out, groups=g), sf_MG)


@pytest.mark.parametrize("m,g", SHAPES)
def test_exponents_pack_four_to_a_little_endian_word(m, g):
    exponents_MG = ue8m0_scales(m, g)
    out = sf_to_mn_major(exponents_MG, pack_ue8m0=True)
    assert out.dtype == torch.int32 and out.shape == (m, -(-g // 4))
    assert m == 0 or out.stride() == (1, -(-m // 4) * 4)
    assert torch.equal(out, slow_words(exponents_MG))
    if m:
        assert not storage_of(out)[:, m:].any()
    back = sf_to_row_major(out, groups=g)
    assert back.dtype == torch.uint8 and back.is_contiguous() and torch.equal(back, exponents_MG)
    # float32 powers of two pack to the same words; unpacked uint8 scales become 2**e
    powers = torch.pow(2.0, exponents_MG.float() - 127)
    assert torch.equal(sf_to_mn_major(powers, pack_ue8m0=True), out)
    assert torch.equal(sf_to_mn_major(exponents_MG), powers)


def test_round_trip_of_a_casts_packed_scales():
    _, sf_u8 = per_token_cast(torch.randn(33, 7168), round_sf=True, pack_sf=True)
    words = sf_to_mn_major(sf_u8, pack_ue8m0=True)
    assert words.shape == (33, 14) and torch.equal(sf_to_row_major(words, groups=56), sf_u8)
    # any strides on the way back: a row-major copy of the words reads the same
    assert torch.equal(sf_to_row_major(words.contiguous(), groups=56), sf_u8)


ERRORS = {
    "mn_dtype": (lambda: sf_to_mn_major(torch.ones(4, 4, dtype=torch.float16)), TypeError, "sf_MG"),
    "mn_ndim": (lambda: sf_to_mn_major(torch.ones(4)), ValueError, "sf_MG"),
    "row_dtype": (lambda: sf_to_row_major(torch.ones(4, 4, dtype=torch.uint8), groups=4), TypeError, "sf_mn"),
    "row_words": (lambda: sf_to_row_major(torch.ones(4, 2, dtype=torch.int32), groups=4), ValueError, "sf_mn"),
    "row_groups": (lambda: sf_to_row_major(torch.ones(4, 4), groups=0), ValueError, "groups"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_names_the_argument(case):
    call, error, argname = ERRORS[case]
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()
