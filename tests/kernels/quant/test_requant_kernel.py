"""The requantization kernel against the reference: bit-exact e4m3 bytes and scales for every
pair of layouts and scale mode, and for the lossless per-block cast; outputs start as poison."""

import pytest
import torch

from kernels import lowering
from kernels.quant import reference
from kernels.quant.requant_kernel import get_requant_kernel, requant
from kernels.testing import cast_input, poison_allocator, spy

BLOCKS = {"per_token": (1, 128), "per_block": (128, 128), "per_channel": (128, 1), "per_token_64": (1, 64)}
SHAPES = [(0, 7168), (1, 64), (37, 300), (200, 7168 + 64), (257, 2048)]  # (M, N)
SF_MODES = {"fp32_sf": (False, False), "ue8m0_sf": (True, False), "packed_sf": (True, True)}


def fp8_input(m: int, n: int, block: tuple[int, int], round_sf: bool, pack_sf: bool, seed: int):
    x = cast_input(m, n, dtype=torch.float32, seed=seed)
    q, sf = reference._blockwise_cast(x, block, round_sf=round_sf, pack_sf=pack_sf)
    return q.cuda(), sf.cuda()


def assert_same_cast(got, want):
    (q, sf), (q_ref, sf_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and sf.dtype == sf_ref.dtype and sf.shape == sf_ref.shape
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))
    assert torch.equal(sf.cpu().view(torch.uint8), sf_ref.cpu().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("sf_mode", SF_MODES)
@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("dst", BLOCKS)
@pytest.mark.parametrize("src", BLOCKS)
def test_matches_reference_bit_for_bit(src, dst, m, n, sf_mode, seed):
    round_sf, pack_sf = SF_MODES[sf_mode]
    in_block, out_block = BLOCKS[src], BLOCKS[dst]
    q_in, sf_in = fp8_input(m, n, in_block, round_sf, pack_sf, seed)
    poison_allocator("cuda")
    got = requant(q_in, sf_in, in_block=in_block, out_block=out_block, round_sf=round_sf, pack_sf=pack_sf)
    want = reference.requant(q_in.cpu(), sf_in.cpu(), in_block=in_block, out_block=out_block, round_sf=round_sf,
                             pack_sf=pack_sf)
    assert_same_cast(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("pack_sf", [False, True], ids=["fp32_sf", "packed_sf"])
@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("src", ["per_token", "per_channel", "per_token_64"])
def test_lossless_matches_reference_bit_for_bit(src, m, n, pack_sf, seed):
    in_block = BLOCKS[src]
    q_in, sf_in = fp8_input(m, n, in_block, True, pack_sf, seed)
    poison_allocator("cuda")
    got = requant(q_in, sf_in, in_block=in_block, out_block=(128, 128), round_sf=True, pack_sf=pack_sf, lossless=True)
    want = reference.per_block_cast_lossless(q_in.cpu(), sf_in.cpu(), in_block=in_block, pack_sf=pack_sf)
    assert_same_cast(got, want)


@pytest.mark.gpu
def test_public_ops_pick_the_kernel(monkeypatch, seed):
    from kernels import quant

    calls = spy(monkeypatch, quant, "requant_kernel")
    q_in, sf_in = fp8_input(256, 7168, (1, 128), True, False, seed)
    assert_same_cast(quant.requant(q_in, sf_in, in_block=(1, 128), out_block=(128, 128), round_sf=True),
                     reference.requant(q_in.cpu(), sf_in.cpu(), in_block=(1, 128), out_block=(128, 128), round_sf=True))
    assert_same_cast(quant.per_block_cast_lossless(q_in, sf_in, in_block=(1, 128)),
                     reference.per_block_cast_lossless(q_in.cpu(), sf_in.cpu(), in_block=(1, 128)))
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "call,error,argname",
    [
        (lambda q, sf: requant(q.float(), sf, in_block=(1, 128), out_block=(1, 128), round_sf=False, pack_sf=False),
         TypeError, "q"),
        (lambda q, sf: requant(q.cpu(), sf, in_block=(1, 128), out_block=(1, 128), round_sf=False, pack_sf=False),
         ValueError, "q"),
        (lambda q, sf: requant(q, sf, in_block=(1, 100), out_block=(1, 128), round_sf=False, pack_sf=False),
         ValueError, "in_block"),
        (lambda q, sf: requant(q, sf, in_block=(1, 128), out_block=(1, 1), round_sf=False, pack_sf=False),
         ValueError, "out_block"),
        (lambda q, sf: requant(q, sf[:, :1], in_block=(1, 128), out_block=(1, 128), round_sf=False, pack_sf=False),
         ValueError, "sf"),
        (lambda q, sf: requant(q, sf, in_block=(1, 128), out_block=(1, 128), round_sf=False, pack_sf=True),
         ValueError, "pack_sf"),
    ],
    ids=["q_dtype", "q_device", "in_block", "out_block", "sf_shape", "pack_without_round"],
)
def test_bad_input_names_the_argument(call, error, argname):
    q = torch.randn(4, 256, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(error, match=f"^{argname}: expected"):
        call(q, torch.ones(4, 2, device="cuda"))


SPECIALIZATIONS = [  # (num_cols, in_block, out_block, in_packed, round_sf, pack_sf, lossless)
    (7168, (1, 128), (128, 128), False, True, False, False),  # a weight-gradient operand's per-block scales
    (7168, (1, 128), (128, 1), False, False, False, False),  # per-token to per-channel (transposed GEMM)
    (7168, (128, 128), (1, 128), True, True, True, False),
    (300, (128, 1), (1, 128), False, True, False, False),  # ragged
    (7168, (1, 128), (128, 128), True, True, True, True),  # lossless
    (2048, (1, 64), (128, 128), False, True, False, True),
]


def test_compiles_for_sm90a():
    with lowering.compile_only():
        for spec in SPECIALIZATIONS:
            source = lowering.kernel_source(get_requant_kernel(*spec))
            assert "requant_kernel(" in source and "fp8_e4" in source, spec
