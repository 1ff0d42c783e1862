"""The fused SwiGLU + FP8 cast with SiLU read from a table (many bfloat16 tokens): the table's rule
over every bfloat16 gate, and the kernel against the tile kernel and the reference on the GPU.

The lookup kernel computes the same float32 values as the tile kernel (the table holds the IEEE
chain's results; outside the band a product the chain gives exactly), so the two are compared
byte for byte; the reference as in ``test_swiglu_kernel.py`` (one e4m3 step)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import lowering
from kernels.quant import reference, swiglu_kernel
from kernels.quant.swiglu_kernel import get_swiglu_forward_kernel, swiglu_per_token_cast
from kernels.quant.swiglu_lookup_kernel import (
    BAND_KEYS,
    KEY_HIGH,
    KEY_LOW,
    MIN_TOKENS,
    get_swiglu_lookup_cast_kernel,
    lookup_ctas,
)
from kernels.testing import poison_allocator, spy, swiglu_input


def bfloat16_of(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of 16-bit patterns read as bfloat16."""
    return bits.to(torch.int16).view(torch.bfloat16).float()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_band_rule_gives_every_bfloat16_silu(device):
    """The kernel's table and lookup, written in torch: for all 65536 gates (NaNs, infinities,
    zeros, subnormals included), ``g * factor + value`` of the entry of ``g``'s magnitude clamped
    to the band equals SiLU (float32) bit for bit, NaN for NaN."""
    e = torch.arange(2 * BAND_KEYS, device=device)
    key, negative = KEY_LOW + e // 2, e % 2
    end = (key == KEY_LOW) | (key == KEY_HIGH)
    factor = torch.where(key == KEY_LOW, 0.5, torch.where(key == KEY_HIGH, 1.0 - negative.float(), 0.0))
    value = torch.where(end, torch.tensor(-0.0, device=device), F.silu(bfloat16_of((negative << 15) | key)))
    g = bfloat16_of(torch.arange(65536, device=device))
    band = torch.fmin(torch.fmax(g.abs(), torch.tensor(2.0**-25, device=device)), torch.tensor(127.5, device=device))
    entry = ((band.view(torch.int32) >> 16) - KEY_LOW) * 2 + torch.signbit(g).long()
    got, want = g * factor[entry] + value[entry], F.silu(g)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), g[~same][:8].tolist()


def tile_kernel_cast(x_TI2, group, round_sf, pack_sf, weights_T=None):
    """The tile kernel's bytes (the path the lookup kernel replaces)."""
    t, inter = x_TI2.shape[0], x_TI2.shape[1] // 2
    kernel = get_swiglu_forward_kernel(inter, "bfloat16", group, True, round_sf, pack_sf, False, False,
                                       weighted=weights_T is not None)
    q = torch.empty((t, inter), dtype=torch.float8_e4m3fn, device=x_TI2.device)
    sf = torch.empty((t, inter // group), dtype=torch.uint8 if pack_sf else torch.float32, device=x_TI2.device)
    weights = weights_T if weights_T is not None else torch.empty(t, device=x_TI2.device)
    kernel(x_TI2, q, sf, torch.empty(1, dtype=torch.int32, device=x_TI2.device), weights)
    return q, sf


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
def test_every_bfloat16_gate_casts_as_the_tile_kernel():
    """All 65536 gate bit patterns (32 rows of 2048), random ups: the lookup kernel's bytes and
    scales are the tile kernel's."""
    x_TI2 = torch.randn(32, 4096, device="cuda").to(torch.bfloat16)
    x_TI2[:, :2048] = bfloat16_of(torch.arange(65536, device="cuda")).to(torch.bfloat16).view(32, 2048)
    kernel = get_swiglu_lookup_cast_kernel(2048, 128, False, False, lookup_ctas(x_TI2.device))
    q = torch.empty((32, 2048), dtype=torch.float8_e4m3fn, device="cuda")
    sf = torch.empty((32, 16), device="cuda")
    kernel(x_TI2, q, sf, torch.empty(32, device="cuda"))
    q_tile, sf_tile = tile_kernel_cast(x_TI2, 128, False, False)
    assert_same_bytes(q, q_tile)
    assert_same_bytes(sf, sf_tile)


SF_MODES = {"fp32_sf": (False, False), "ue8m0_sf": (True, False), "packed_sf": (True, True)}


@pytest.mark.gpu
@pytest.mark.parametrize("sf_mode", SF_MODES)
@pytest.mark.parametrize("t,inter,group,weighted", [
    (MIN_TOKENS, 2048, 128, False), (MIN_TOKENS + 3, 7168, 256, False), (MIN_TOKENS + 1, 2048, 64, True),
    (MIN_TOKENS, 1536, 32, False),
])
def test_many_tokens_take_the_lookup_kernel(monkeypatch, t, inter, group, weighted, sf_mode, seed):
    """From ``MIN_TOKENS`` tokens the public op runs the lookup kernel (groups of 4 to 32 threads,
    a ragged last warp, weights), giving the tile kernel's bytes, and the reference's within one
    e4m3 step."""
    round_sf, pack_sf = SF_MODES[sf_mode]
    x_TI2, _ = swiglu_input(t, inter, device="cuda", seed=seed)
    weights_T = torch.rand(t, device="cuda") + 0.1 if weighted else None
    calls = spy(monkeypatch, swiglu_kernel, "get_swiglu_lookup_cast_kernel")
    poison_allocator("cuda")
    q, sf = swiglu_per_token_cast(x_TI2, group=group, round_sf=round_sf, pack_sf=pack_sf, weights_T=weights_T)
    assert len(calls) == 1
    q_tile, sf_tile = tile_kernel_cast(x_TI2, group, round_sf, pack_sf, weights_T)
    assert_same_bytes(q, q_tile)
    assert_same_bytes(sf, sf_tile)
    q_ref, sf_ref = reference.swiglu_per_token_cast(x_TI2, group=group, round_sf=round_sf, pack_sf=pack_sf,
                                                    weights_T=weights_T)
    ordinal = [torch.where(v.view(torch.uint8) >= 0x80, -(v.view(torch.uint8) & 0x7F).int(), v.view(torch.uint8).int())
               for v in (q, q_ref)]
    assert int((ordinal[0] - ordinal[1]).abs().max()) <= 1


def test_compiles_for_sm90a():
    """Groups of 4 to 32 threads (a shuffle round per halving), each scale format, weighted or not:
    the table is built with the IEEE chain and read as (factor, value) pairs."""
    with lowering.compile_only():
        for inter, group, round_sf, pack_sf, weighted in [(2048, 128, False, False, False), (7168, 256, True, False, False),
                                                          (2048, 64, True, True, True), (1536, 32, False, False, False)]:
            source = lowering.kernel_source(get_swiglu_lookup_cast_kernel(inter, group, round_sf, pack_sf, 132, weighted))
            assert "expf" in source and "__fdiv_rn" in source and "__fmaf_rn" in source
            assert source.count("__shfl_xor_sync") == (group // 8).bit_length() - 1, group
            assert ("weights_T[" in source) == weighted
