"""The per-token FP4 (e2m1) casts and the casts with e4m3 scales (reference): codes against a
brute-force nearest-even search over the grid, the nibble order, the scale conventions, the error
of a round trip, and bad input."""

import math

import pytest
import torch

from kernels.quant import (cast_back_e4m3_sf, cast_back_fp4, per_token_cast_e4m3_sf, per_token_cast_fp4,
                           per_token_cast_fp4_e4m3_sf)
from kernels.quant.reference import E2M1_VALUES, e2m1_codes, pack_e2m1, unpack_e2m1
from kernels.testing import cast_input

E4M3 = torch.float8_e4m3fn


def nearest_even_code(v: float) -> int:
    """The e2m1 code of ``v`` by search: the nearest grid magnitude (saturating), ties to the even code;
    the sign bit ``v``'s (-0.0 has it)."""
    mag = min(abs(v), 6.0)
    dist = [abs(mag - g) for g in E2M1_VALUES]
    best = min(dist)
    code = min((c for c in range(8) if dist[c] == best), key=lambda c: (c % 2, c))
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def test_codes_are_the_nearest_grid_value_ties_to_even(seed):
    grid = torch.tensor(E2M1_VALUES)
    midpoints = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, midpoints, midpoints + 1e-3, midpoints - 1e-3, torch.tensor([6.5, 1e9, float("inf")]),
                   torch.randn(2000) * 4])
    v = torch.cat([v, -v])
    got = e2m1_codes(v).tolist()
    assert got == [nearest_even_code(x) for x in v.tolist()]


def test_nibble_order_and_unpack():
    v = torch.tensor([[0.5, -6.0, 1.5, 0.0]])
    q = pack_e2m1(v)
    assert q.tolist() == [[0x01 | (0x0F << 4), 0x03]]  # element 2j low nibble, 2j + 1 high
    assert torch.equal(unpack_e2m1(q), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d,group", [(0, 64, 32), (33, 100, 32), (17, 64, 16), (5, 2, 32)])
def test_ue8m0_scales_and_round_trip(t, d, group, dtype, seed):
    x = cast_input(t, d, dtype=dtype, seed=seed)
    q, sf = per_token_cast_fp4(x, group=group)
    assert q.dtype == torch.uint8 and q.shape == (t, d // 2) and sf.dtype == torch.uint8
    assert sf.shape == (t, -(-d // group))
    scale = torch.pow(2.0, sf.float() - 127).repeat_interleave(group, 1)[:, :d]
    amax = x.float().abs().clamp(min=1e-4)
    # power-of-two scales, the smallest that fit the group's amax into +-6
    group_amax = torch.nn.functional.pad(amax, (0, -d % group)).view(t, sf.shape[1], group).amax(2)
    assert (group_amax / torch.pow(2.0, sf.float() - 127) <= 6).all()
    assert (group_amax / torch.pow(2.0, sf.float() - 128) > 6).all()
    y = cast_back_fp4(q, sf, group=group, out_dtype=torch.float32)
    # one grid step at the top of the grid is 2 (of 6): half of it, in the group's scale
    assert ((y - x.float()).abs() <= scale + 1e-30).all()


@pytest.mark.parametrize("t,d,group", [(33, 100, 16), (17, 64, 16), (4, 7168, 16), (3, 0, 16)])
def test_e4m3_scales_under_a_per_token_scale(t, d, group, seed):
    x = cast_input(t, d, dtype=torch.bfloat16, seed=seed)
    q, sf, gsf = per_token_cast_fp4_e4m3_sf(x, group=group)
    assert q.shape == (t, d // 2) and sf.dtype == E4M3 and sf.shape == (t, -(-d // group)) and gsf.shape == (t,)
    row = x.float().abs().amax(1) if d else torch.zeros(t)
    assert torch.equal(gsf, row.clamp(min=1e-4) / torch.full((t,), 448.0 * 6))
    if d:  # the largest group's scale is 448, exactly
        assert (sf.float().amax(1) == 448).all() and (sf.float() >= 2.0**-9).all()
    y = cast_back_fp4(q, sf, group=group, gsf_T=gsf, out_dtype=torch.float32)
    scale = (sf.float() * gsf[:, None]).repeat_interleave(group, 1)[:, :d]
    # within one grid step (2) of the group's scale; the scale itself rounded to e4m3 may make it
    # up to 2**-4 smaller than amax / 6, so values near amax saturate at 6 * scale (2**-4 of amax)
    bound = torch.maximum(scale, x.float().abs() * 2.0**-3)
    assert ((y - x.float()).abs() <= bound + 1e-30).all()


def test_fp8_with_e4m3_scales_round_trip(seed):
    x = cast_input(40, 300, dtype=torch.float32, seed=seed)
    q, sf, gsf = per_token_cast_e4m3_sf(x, group=128)
    assert q.dtype == E4M3 and sf.dtype == E4M3 and sf.shape == (40, 3) and gsf.dtype == torch.float32
    assert torch.equal(gsf, x.abs().amax(1).clamp(min=1e-4) / torch.full((40,), 448.0 * 448))
    y = cast_back_e4m3_sf(q, sf, gsf, group=128, out_dtype=torch.float32)
    scale = (sf.float() * gsf[:, None]).repeat_interleave(128, 1)[:, :300]
    # e4m3 keeps 3 mantissa bits (2**-4 relative), and its subnormals step by 2**-9 of the scale
    assert ((y - x).abs() <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-9) * 1.01 + 1e-30).all()


def test_fp4_with_e4m3_scales_is_more_accurate_than_ue8m0(seed):
    """What the two conventions buy on activation-like rows (the dispatch wire takes the better one)."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(seed))
    mx = cast_back_fp4(*per_token_cast_fp4(x), group=32, out_dtype=torch.float32)
    q, sf, gsf = per_token_cast_fp4_e4m3_sf(x)
    nv = cast_back_fp4(q, sf, group=16, gsf_T=gsf, out_dtype=torch.float32)
    assert (nv - x).norm() < (mx - x).norm()
    assert (nv - x).norm() / x.norm() < 0.12


@pytest.mark.parametrize(
    "call,error,argname",
    [
        (lambda x: per_token_cast_fp4(x[:, :5]), ValueError, "x_TD"),
        (lambda x: per_token_cast_fp4(x.int()), TypeError, "x_TD"),
        (lambda x: per_token_cast_fp4_e4m3_sf(x, group=0), ValueError, "group"),
        (lambda x: cast_back_fp4(*per_token_cast_fp4(x)[:1], torch.zeros(4, 3, dtype=torch.uint8), group=32),
         ValueError, "sf_TG"),
        (lambda x: cast_back_fp4(*per_token_cast_fp4_e4m3_sf(x)[:2], group=16), TypeError, "gsf_T"),
        (lambda x: cast_back_fp4(*per_token_cast_fp4(x), group=32, gsf_T=torch.ones(4)), ValueError, "gsf_T"),
        (lambda x: cast_back_e4m3_sf(*per_token_cast_e4m3_sf(x), group=128, out_dtype=torch.int8), TypeError,
         "out_dtype"),
    ],
    ids=["odd_width", "dtype", "group", "sf_shape", "gsf_missing", "gsf_with_ue8m0", "out_dtype"],
)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}: expected"):
        call(torch.randn(4, 64))


def test_public_ops_run_the_kernels_only_where_selected(stub_kernel, monkeypatch):
    """On the CPU the references run; where ``use_tilelang`` says so, the kernels (stubs here) for
    the groups and widths they take, the reference for the rest."""
    from kernels import quant

    x = torch.randn(4, 64)
    casts = stub_kernel(quant, "per_token_scaled_cast", "kernel")
    backs = stub_kernel(quant, "per_token_scaled_cast_back", "kernel back")
    q, sf = per_token_cast_fp4(x)
    assert cast_back_fp4(q, sf, group=32).shape == (4, 64) and not casts and not backs
    monkeypatch.setattr(quant, "use_tilelang", lambda device: True)
    assert per_token_cast_fp4(x) == "kernel" and casts[-1][1] == dict(group=32, fmt="e2m1", sf_format="ue8m0")
    assert per_token_cast_fp4_e4m3_sf(x) == "kernel" and casts[-1][1]["sf_format"] == "e4m3"
    assert per_token_cast_e4m3_sf(x) == "kernel" and casts[-1][1]["fmt"] == "e4m3" and len(casts) == 3
    assert cast_back_fp4(q, sf, group=32) == "kernel back" and len(backs) == 1
    # a group the kernel does not take, a row it cannot share out at most MAX_VECTORS vectors a
    # thread (2176 float32 columns: 544 vectors, 32 threads, 17 each): the reference
    assert per_token_cast_fp4(x, group=24)[0].shape == (4, 32)
    assert per_token_cast_fp4_e4m3_sf(torch.randn(2, 2176))[0].shape == (2, 1088) and len(casts) == 3
    assert per_token_cast_fp4_e4m3_sf(torch.randn(2, 16384)) == "kernel"
