"""kernels.reduce reference vs a slow per-token, per-route loop accumulating in float32."""

import pytest
import torch

from kernels.reduce import weighted_reduce

pytestmark = pytest.mark.usefixtures("seed")

E4M3 = torch.float8_e4m3fn


def slow_weighted_reduce(y_PD, pos_TK, weights_TK, sf_PG=None, group=128):
    """float32 result; route k = 0 .. K-1 added in order, each term rounded to float32 first."""
    t, k = pos_TK.shape
    out = torch.zeros(t, y_PD.shape[1])
    for token in range(t):
        for route in range(k):
            row = int(pos_TK[token, route])
            if row == -1:
                continue
            y_D = y_PD[row].float()
            if sf_PG is not None:
                for g in range(sf_PG.shape[1]):
                    scale = sf_PG[row, g].item()
                    scale = 2.0 ** (scale - 127) if sf_PG.dtype == torch.uint8 else scale
                    y_D[g * group : (g + 1) * group] *= scale
            out[token] = out[token] + weights_TK[token, route] * y_D
    return out


def make_routes(t, k, p, index_dtype=torch.int64):
    """Random rows with about a third of the routes masked and every fifth token fully masked."""
    pos_TK = torch.randint(0, p, (t, k), dtype=index_dtype) if p else torch.full((t, k), -1, dtype=index_dtype)
    pos_TK[torch.rand(t, k) < 0.3] = -1
    pos_TK[::5] = -1
    weights_TK = torch.rand(t, k)
    return pos_TK, weights_TK


@pytest.mark.parametrize(
    "t,k,p,d,dtype,index_dtype",
    [
        (37, 6, 120, 300, torch.float32, torch.int64),
        (20, 8, 50, 100, torch.bfloat16, torch.int32),
        (9, 2, 30, 64, torch.float16, torch.int64),
        (0, 4, 10, 32, torch.bfloat16, torch.int32),
        (6, 3, 0, 32, torch.float32, torch.int64),
    ],
)
def test_matches_slow_loop(t, k, p, d, dtype, index_dtype):
    y_PD = torch.randn(p, d).to(dtype)
    pos_TK, weights_TK = make_routes(t, k, p, index_dtype)
    expected = slow_weighted_reduce(y_PD, pos_TK, weights_TK)
    out = weighted_reduce(y_PD, pos_TK, weights_TK, out_dtype=torch.float32)
    assert out.shape == (t, d)
    assert torch.equal(out, expected)
    out_default = weighted_reduce(y_PD, pos_TK, weights_TK)
    assert out_default.dtype == dtype and torch.equal(out_default, expected.to(dtype))


def test_no_weights_sum_the_rows():
    """``weights_TK=None`` (combine's home sum) is the sum with weights of 1, bit for bit."""
    y_PD = torch.randn(30, 64).bfloat16()
    pos_TK, _ = make_routes(20, 4, 30, torch.int32)
    out = weighted_reduce(y_PD, pos_TK, None, out_dtype=torch.float32)
    assert torch.equal(out, slow_weighted_reduce(y_PD, pos_TK, torch.ones(pos_TK.shape)))


def test_masked_routes_contribute_nothing():
    y_PD = torch.randn(4, 16)
    pos_TK = torch.tensor([[-1, -1, -1], [2, -1, 0], [-1, 3, -1]])
    weights_TK = torch.tensor([[1.0, 2.0, 3.0], [0.5, float("nan"), 0.25], [9.0, 1.0, float("inf")]])
    out = weighted_reduce(y_PD, pos_TK, weights_TK)
    assert torch.equal(out[0], torch.zeros(16))
    assert torch.equal(out[1], 0.5 * y_PD[2] + 0.25 * y_PD[0])
    assert torch.equal(out[2], y_PD[3])


@pytest.mark.parametrize("packed", [False, True], ids=["fp32_sf", "ue8m0_sf"])
@pytest.mark.parametrize("d,group", [(300, 128), (256, 64)])
def test_fp8_rows_are_dequantized_first(d, group, packed):
    p, g = 40, -(-d // group)
    y_PD = (4 * torch.randn(p, d)).to(E4M3)
    sf_PG = torch.randint(115, 135, (p, g), dtype=torch.uint8) if packed else torch.rand(p, g) + 0.01
    pos_TK, weights_TK = make_routes(25, 4, p)
    out = weighted_reduce(y_PD, pos_TK, weights_TK, sf_PG=sf_PG, group=group)
    expected = slow_weighted_reduce(y_PD, pos_TK, weights_TK, sf_PG, group)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())
    out_f32 = weighted_reduce(y_PD, pos_TK, weights_TK, sf_PG=sf_PG, group=group, out_dtype=torch.float32)
    assert torch.equal(out_f32, expected)


def _y():
    return torch.randn(8, 256)


def _routes():
    return torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)


ERRORS = {
    "y_int": (lambda: weighted_reduce(torch.ones(8, 4, dtype=torch.int32), *_routes()), TypeError, "y_PD"),
    "y_1d": (lambda: weighted_reduce(torch.randn(8), *_routes()), ValueError, "y_PD"),
    "pos_float": (lambda: weighted_reduce(_y(), torch.zeros(3, 2), torch.ones(3, 2)), TypeError, "pos_TK"),
    "pos_too_big": (
        lambda: weighted_reduce(_y(), torch.full((3, 2), 8), torch.ones(3, 2)),
        ValueError,
        "pos_TK",
    ),
    "pos_below_minus_one": (
        lambda: weighted_reduce(_y(), torch.full((3, 2), -2), torch.ones(3, 2)),
        ValueError,
        "pos_TK",
    ),
    "weights_shape": (
        lambda: weighted_reduce(_y(), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 3)),
        ValueError,
        "weights_TK",
    ),
    "weights_bf16": (
        lambda: weighted_reduce(_y(), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2).bfloat16()),
        TypeError,
        "weights_TK",
    ),
    "fp8_without_sf": (lambda: weighted_reduce(_y().to(E4M3), *_routes()), ValueError, "sf_PG"),
    "sf_with_bf16_y": (
        lambda: weighted_reduce(_y().bfloat16(), *_routes(), sf_PG=torch.ones(8, 2)),
        ValueError,
        "sf_PG",
    ),
    "sf_shape": (lambda: weighted_reduce(_y().to(E4M3), *_routes(), sf_PG=torch.ones(8, 3)), ValueError, "sf_PG"),
    "sf_dtype": (
        lambda: weighted_reduce(_y().to(E4M3), *_routes(), sf_PG=torch.ones(8, 2, dtype=torch.int32)),
        TypeError,
        "sf_PG",
    ),
    "group_zero": (lambda: weighted_reduce(_y(), *_routes(), group=0), ValueError, "group"),
    "out_dtype": (lambda: weighted_reduce(_y(), *_routes(), out_dtype=torch.int64), TypeError, "out_dtype"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_names_the_argument(case):
    call, error, argname = ERRORS[case]
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()
