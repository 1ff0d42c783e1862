"""The per-token e2m1 / e4m3-scaled cast kernels and their casts back against the reference, bit for
bit (codes, scales, per-token scales and dequantized values), every output written; and their
lowering to sm_90a on the CPU."""

import pytest
import torch

from kernels import lowering
from kernels.quant import reference
from kernels.quant.scaled_cast_back_kernel import get_per_token_scaled_cast_back_kernel, per_token_scaled_cast_back
from kernels.quant.scaled_cast_kernel import get_per_token_scaled_cast_kernel, per_token_scaled_cast
from kernels.testing import cast_input, poison_allocator

REFERENCES = {  # (fmt, sf_format) -> the reference cast
    ("e2m1", "ue8m0"): reference.per_token_cast_fp4,
    ("e2m1", "e4m3"): reference.per_token_cast_fp4_e4m3_sf,
    ("e4m3", "e4m3"): reference.per_token_cast_e4m3_sf,
}
CASES = [  # (T, D, group, input dtype)
    (0, 7168, 16, torch.bfloat16),
    (3, 64, 32, torch.float32),
    (37, 100, 16, torch.bfloat16),  # a ragged last group
    (33, 264, 16, torch.bfloat16),  # a tile past the row (512 columns): the float32 encoder
    (17, 512, 4, torch.bfloat16),  # whole tiles, groups narrower than a vector: the float32 encoder
    (130, 300, 128, torch.float16),
    (257, 7168, 16, torch.bfloat16),  # the dispatch wire at DeepSeek-V3's hidden
    (64, 7168, 32, torch.float32),
    (5, 2, 2, torch.float32),
    (9, 0, 16, torch.bfloat16),
]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,sf_format", list(REFERENCES), ids=["fp4_ue8m0", "fp4_e4m3_sf", "fp8_e4m3_sf"])
@pytest.mark.parametrize("t,d,group,dtype", CASES)
def test_cast_matches_reference_bit_for_bit(t, d, group, dtype, fmt, sf_format, seed):
    x = cast_input(t, d, dtype=dtype, seed=seed)
    poison_allocator("cuda")
    got = per_token_scaled_cast(x.cuda(), group=group, fmt=fmt, sf_format=sf_format)
    want = REFERENCES[fmt, sf_format](x, group=group)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(as_bytes(g.cpu()), as_bytes(w))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fmt,sf_format", list(REFERENCES), ids=["fp4_ue8m0", "fp4_e4m3_sf", "fp8_e4m3_sf"])
@pytest.mark.parametrize("t,d,group,dtype", CASES)
def test_cast_back_matches_reference_bit_for_bit(t, d, group, dtype, fmt, sf_format, out_dtype, seed):
    q, sf, *gsf = REFERENCES[fmt, sf_format](cast_input(t, d, dtype=dtype, seed=seed), group=group)
    gsf = gsf[0] if gsf else None
    poison_allocator("cuda")
    got = per_token_scaled_cast_back(q.cuda(), sf.cuda(), None if gsf is None else gsf.cuda(), group=group,
                                     out_dtype=out_dtype)
    if fmt == "e2m1":
        want = reference.cast_back_fp4(q, sf, group=group, gsf_T=gsf, out_dtype=out_dtype)
    else:
        want = reference.cast_back_e4m3_sf(q, sf, gsf, group=group, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (t, d)
    assert torch.equal(as_bytes(got.cpu()), as_bytes(want))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "call,error,argname",
    [
        (lambda x: per_token_scaled_cast(x.int(), group=16, fmt="e2m1", sf_format="e4m3"), TypeError, "x_TD"),
        (lambda x: per_token_scaled_cast(x.cpu(), group=16, fmt="e2m1", sf_format="e4m3"), ValueError, "x_TD"),
        (lambda x: per_token_scaled_cast(x[:, :5], group=16, fmt="e2m1", sf_format="e4m3"), ValueError, "x_TD"),
        (lambda x: per_token_scaled_cast(x, group=24, fmt="e2m1", sf_format="e4m3"), ValueError, "group"),
        (lambda x: per_token_scaled_cast(x, group=16, fmt="e4m3", sf_format="ue8m0"), ValueError, "fmt, sf_format"),
        (lambda x: per_token_scaled_cast_back(x, torch.ones(4, 16, device="cuda"), None, group=16), TypeError, "q"),
    ],
    ids=["dtype", "device", "odd_width", "group", "format", "q_dtype"],
)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}: expected"):
        call(torch.randn(4, 256, device="cuda"))


# The dispatch wire (e2m1, e4m3 scales over 16 columns) at DeepSeek-V3's hidden and the tiny
# model's, the other conventions, ragged widths.
SPECIALIZATIONS = [  # (num_cols, group, fmt, sf_format, dtype)
    (7168, 16, "e2m1", "e4m3", "bfloat16"),
    (64, 16, "e2m1", "e4m3", "float32"),
    (7168, 32, "e2m1", "ue8m0", "bfloat16"),
    (100, 32, "e2m1", "ue8m0", "float16"),
    (7168, 128, "e4m3", "e4m3", "bfloat16"),
    (300, 128, "e4m3", "e4m3", "float32"),
    (512, 4, "e2m1", "e4m3", "bfloat16"),
]


def test_compiles_for_sm90a():
    with lowering.compile_only():
        for num_cols, group, fmt, sf_format, dtype in SPECIALIZATIONS:
            cast = lowering.kernel_source(get_per_token_scaled_cast_kernel(num_cols, group, fmt, sf_format, dtype))
            back = lowering.kernel_source(get_per_token_scaled_cast_back_kernel(num_cols, group, fmt, sf_format, dtype))
            # Divisions rounded as the reference's (never a plain reciprocal multiply): IEEE divisions
            # under UE8M0 scales, the e4m3 scales' by a shared reciprocal with its remainder's
            # correction; bfloat16's UE8M0 exponents come from amax's bits, with no division
            no_division = (fmt, sf_format, dtype) == ("e2m1", "ue8m0", "bfloat16")
            assert ("__fdiv_rn" in cast) == (sf_format == "ue8m0" and not no_division), (num_cols, fmt, sf_format)
            assert ("= ep_div_by(" in cast) == (sf_format == "e4m3"), (num_cols, fmt, sf_format)
            assert ("fp8_e4" in back) == ("e4m3" in (fmt, sf_format)), (num_cols, fmt, sf_format)
            # bfloat16 rows under e4m3 scales: eight values a call where a vector lies in one group
            packed = (fmt, sf_format, dtype) == ("e2m1", "e4m3", "bfloat16") and group % 8 == 0
            assert ("ep_e2m1x8_bf16_scaled((&" in cast) == packed, (num_cols, group, fmt, sf_format, dtype)


def e2m1_edge_values() -> torch.Tensor:
    """float32 magnitudes at and one ulp either side of every e2m1 grid value and midpoint, a dense
    sweep of [0, 7], values past 6, subnormals and zeros, both signs."""
    grid = torch.tensor(reference.E2M1_VALUES)
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([6.5, 7.0, 1e3])])
    up, down = torch.nextafter(points, torch.tensor(1e9)), torch.nextafter(points, torch.tensor(0.0))
    tiny = torch.tensor([0.0, 1e-40, 1e-30, 0.24999])
    v = torch.cat([points, up, down, torch.linspace(0, 7, 4001), tiny])
    return torch.cat([v, -v])


def rows_under_six(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v`` laid out in rows of ``width`` that start with 6: the values within 6 in rows of their own
    (their amax is 6, a UE8M0 scale of exactly 1 and the codes the values' own), then those past it
    (a larger scale)."""
    small, large = v[v.abs() <= 6], v[v.abs() > 6]
    body = torch.cat([torch.nn.functional.pad(part, (0, -part.numel() % (width - 1))).view(-1, width - 1)
                      for part in (small, large)])
    return torch.cat([torch.full((body.shape[0], 1), 6.0, dtype=v.dtype), body], dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,sf_format", [("e2m1", "ue8m0"), ("e2m1", "e4m3")], ids=["fp4_ue8m0", "fp4_e4m3_sf"])
def test_e2m1_codes_at_every_edge(fmt, sf_format):
    """The edge values in rows of amax 6 (``rows_under_six``: a UE8M0 scale of exactly 1, the codes
    the values' own), those past 6 in rows of their own: the kernel's arithmetic encoding against
    the reference's count of the midpoints passed, byte for byte."""
    width = 512
    x = rows_under_six(e2m1_edge_values(), width)
    got = per_token_scaled_cast(x.cuda(), group=width, fmt=fmt, sf_format=sf_format)
    want = REFERENCES[fmt, sf_format](x, group=width)
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g.cpu()), as_bytes(w))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,sf_format", [("e2m1", "ue8m0"), ("e2m1", "e4m3")], ids=["fp4_ue8m0", "fp4_e4m3_sf"])
def test_e2m1_codes_at_every_bfloat16_edge(fmt, sf_format):
    """bfloat16 rows (the bfloat16x2 encoder under UE8M0 scales): the edge values as bfloat16, one
    bfloat16 ulp either side of every grid value and midpoint, subnormals and -0.0, under row scales
    2**j from 2**-12 to 2**40 (``rows_under_six``: the rows within 6 have the UE8M0 exponent j),
    and, where bfloat16 holds them, values at float32's underflow after the scale (+-2**(j - 150),
    2**(j - 149), 1.5 * 2**(j - 149), 2**(j - 148): code 0 or 8 by the value's sign, zero or not)."""
    v = e2m1_edge_values().to(torch.bfloat16)
    points = torch.tensor(reference.E2M1_VALUES[1:] + (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), dtype=torch.bfloat16)
    up = torch.nextafter(points, torch.tensor(1e9, dtype=torch.bfloat16))
    down = torch.nextafter(points, torch.tensor(0.0, dtype=torch.bfloat16))
    tiny = torch.tensor([2.0**-133, 2.0**-126, 1e-38, 3e-39, -0.0], dtype=torch.bfloat16)
    v = torch.cat([v, up, -up, down, -down, tiny, -tiny])
    width = 512
    rows = []
    for j in range(-12, 41, 4):
        rows.append(rows_under_six(v, width) * torch.tensor(2.0**j, dtype=torch.bfloat16))
        if j - 150 >= -133:  # bfloat16's least subnormal
            edge = torch.tensor([2.0**(j - 150), 2.0**(j - 149), 1.5 * 2.0**(j - 149), 2.0**(j - 148)])
            underflow = torch.cat([torch.tensor([6.0 * 2.0**j]), edge, -edge]).to(torch.bfloat16)
            rows.append(torch.nn.functional.pad(underflow, (0, width - underflow.numel()))[None])
    x = torch.cat(rows)
    got = per_token_scaled_cast(x.cuda(), group=width, fmt=fmt, sf_format=sf_format)
    want = REFERENCES[fmt, sf_format](x, group=width)
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g.cpu()), as_bytes(w))


def e4m3_scale_edge_rows(width: int = 512, group: int = 16) -> torch.Tensor:
    """bfloat16 rows at the edges of the two-level scales: groups whose e4m3 scale is subnormal and
    rounded down (their values past 6 after the scale, up to 9); groups whose scale is an e4m3 value
    that is not a power of two (1.125 to 448, over a per-token scale of a power of two), holding the
    e2m1 grid values and midpoints times that scale and one bfloat16 ulp either side; rows whose amax
    is past 2**126, under the 1e-4 floor, or zero."""
    rows = []
    for k in (-20, 0, 9):  # gsf = 2**k
        top = 2688.0 * 2.0**k
        amaxes = [top] + [top / 448 * 2.0**-9 * s for s in (1.0, 1.25, 1.49, 1.5, 2.4, 2.5, 3.49)]
        amaxes += [6 * 2.0**k * e for e in (1.125, 1.375, 1.75, 3.25, 5.5, 7.5, 13.0, 26.0, 104.0, 208.0)]
        row = torch.zeros(width)
        ramp = torch.tensor([1.0, -1.0, 0.99, -0.75, 0.5, 0.3, -0.1, 0.0, 0.9, 0.6, 0.2, -0.4, 0.01, 0.83, -0.66, 0.45])
        assert len(amaxes) <= width // group, "every listed scale gets a group of its own"
        for g, a in enumerate(amaxes):
            row[g * group:(g + 1) * group] = a * ramp[:group]
        rows.append(row)
        points = torch.tensor(reference.E2M1_VALUES[1:] + (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), dtype=torch.bfloat16)
        for e in (1.125, 1.375, 3.25, 13.0, 104.0):
            v = (points.float() * e * 2.0**k).bfloat16()
            v = torch.cat([v, torch.nextafter(v, torch.full_like(v, 1e30)), torch.nextafter(v, torch.zeros_like(v))])
            v = torch.cat([torch.tensor([6 * e * 2.0**k]), v.float(), -v.float()])  # the group's amax first
            body = torch.nn.functional.pad(v, (0, -v.numel() % (group - 1))).view(-1, group - 1)
            groups = torch.cat([torch.full((body.shape[0], 1), 6 * e * 2.0**k), body], dim=1).flatten()
            row = torch.zeros(width)
            row[:group] = top / 448 * 448  # the per-token scale: amax top
            row[group:group + groups.numel()] = groups[: width - group]
            rows.append(row)
    g = torch.Generator().manual_seed(0)
    # amax past 2**127 yet finite: bfloat16's largest is about 3.39e38, and a draw past 3.99 would be an
    # infinity, which the cast does not promise to match (its docstring)
    rows.append(torch.randn(width, generator=g).clamp(-3.9, 3.9) * 2.0**126)
    rows.append(torch.randn(width, generator=g) * 1e-6)
    rows.append(torch.zeros(width))
    return torch.stack(rows).bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_e4m3_scales_at_their_edges(fmt):
    """e4m3 scales at their edges (:func:`e4m3_scale_edge_rows`): the codes, the scales and the
    per-token scales byte for byte."""
    x = e4m3_scale_edge_rows()
    got = per_token_scaled_cast(x.cuda(), group=16, fmt=fmt, sf_format="e4m3")
    want = REFERENCES[fmt, "e4m3"](x, group=16)
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g.cpu()), as_bytes(w))
