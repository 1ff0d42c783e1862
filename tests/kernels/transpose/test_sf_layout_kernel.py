"""The scale-layout kernels against the reference: the same values, strides and (zero) padding bit
for bit; outputs start as poison."""

import pytest
import torch

from kernels import lowering
from kernels.transpose import reference
from kernels.transpose.sf_layout_kernel import (
    MAX_GROUPS,
    get_sf_to_mn_major_kernel,
    get_sf_to_row_major_kernel,
    sf_to_mn_major,
    sf_to_row_major,
)
from kernels.testing import poison_allocator, spy

SHAPES = [(0, 56), (1, 1), (3, 56), (130, 57), (4096 + 3, 56), (300, MAX_GROUPS)]  # (M, G)
INPUTS = ["float32", "uint8"]


def scales(m: int, g: int, dtype: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    exponents = (torch.randint(-30, 30, (m, g), generator=gen) + 127).to(torch.uint8)
    if dtype == "uint8":
        return exponents.cuda()
    return (torch.pow(2.0, exponents.float() - 127) * (1 + torch.rand(m, g, generator=gen) / 2)).cuda()


def storage_of(sf_mn: torch.Tensor) -> torch.Tensor:
    m, w = sf_mn.shape
    return torch.as_strided(sf_mn, (w, -(-m // 4) * 4), (sf_mn.stride(1), 1))


@pytest.mark.gpu
@pytest.mark.parametrize("pack", [False, True], ids=["float32", "packed"])
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("m,g", SHAPES)
def test_matches_reference_bit_for_bit(m, g, dtype, pack, seed):
    sf_MG = scales(m, g, dtype, seed)
    poison_allocator("cuda")
    out = sf_to_mn_major(sf_MG, pack_ue8m0=pack)
    expected = reference.sf_to_mn_major(sf_MG.cpu(), pack_ue8m0=pack)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if m:
        assert out.stride() == expected.stride()
        assert torch.equal(storage_of(out).cpu().view(torch.uint8), storage_of(expected).view(torch.uint8))
    back = sf_to_row_major(out, groups=g)
    expected_back = reference.sf_to_row_major(expected, groups=g)
    assert back.dtype == expected_back.dtype and back.is_contiguous()
    assert torch.equal(back.cpu().view(torch.uint8), expected_back.view(torch.uint8))
    # the way back from a row-major copy (other strides) reads the same
    assert torch.equal(sf_to_row_major(out.contiguous(), groups=g).cpu().view(torch.uint8),
                       expected_back.view(torch.uint8))


@pytest.mark.gpu
def test_public_ops_pick_the_kernels(monkeypatch, seed):
    from kernels import transpose

    to_mn = spy(monkeypatch, transpose.sf_layout_kernel, "sf_to_mn_major")
    to_row = spy(monkeypatch, transpose.sf_layout_kernel, "sf_to_row_major")
    sf_MG = scales(64, 56, "uint8", seed)
    assert torch.equal(transpose.sf_to_row_major(transpose.sf_to_mn_major(sf_MG, pack_ue8m0=True), groups=56), sf_MG)
    assert len(to_mn) == 1 and len(to_row) == 1


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="^groups: expected"):
        sf_to_mn_major(torch.ones(4, MAX_GROUPS + 1, device="cuda"))
    with pytest.raises(ValueError, match="^sf_MG: expected"):
        sf_to_mn_major(torch.ones(4, 4))
    with pytest.raises(ValueError, match="^sf_mn: expected"):
        sf_to_row_major(torch.ones(4, 2, dtype=torch.int32, device="cuda"), groups=9)


def test_compiles_for_sm90a():
    """DeepSeek-V3's 56 groups (K = 7168) from float32 and uint8 scales, packed and not, a ragged
    57, and the most groups a CTA stages."""
    with lowering.compile_only():
        for groups, dtype, pack in [(56, "float32", False), (56, "float32", True), (56, "uint8", True),
                                    (57, "uint8", False), (MAX_GROUPS, "float32", True)]:
            assert "sf_WM" in lowering.kernel_source(get_sf_to_mn_major_kernel(groups, dtype, pack))
        for groups, packed in [(56, True), (57, True), (56, False), (MAX_GROUPS, False)]:
            assert "sf_MG" in lowering.kernel_source(get_sf_to_row_major_kernel(groups, packed))
