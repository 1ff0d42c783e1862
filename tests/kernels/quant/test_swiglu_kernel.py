"""The SwiGLU kernels (forward, forward fused with the per-token FP8 cast, backward) against the
reference run on the same GPU (CUDA's ``expf`` and the CPU's vectorized ``exp`` may differ by an
ulp, so the CPU reference is not the yardstick here).

Tolerances: the kernels evaluate the reference's float32 operations in the same order with IEEE
rounding, so they are expected to match bit for bit; the tests allow one ulp of the output dtype
(swiglu, backward), and for the fused cast one e4m3 step per byte and a float32 ulp on the scales,
in case an ``expf`` differs by an ulp. Every output element is checked; outputs start as poison."""

import pytest
import torch

from kernels import lowering
from kernels.quant import reference
from kernels.quant.swiglu_kernel import (
    get_swiglu_backward_kernel,
    get_swiglu_forward_kernel,
    swiglu,
    swiglu_backward,
    swiglu_per_token_cast,
)
from kernels.testing import assert_poisoned, poison_allocator, swiglu_input

SHAPES = [(0, 2048), (1, 64), (37, 100), (128, 2048), (130, 300), (257, 2048), (64, 7168 + 64)]  # (T, I)
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def assert_within_one_ulp(out, expected):
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.stride() == expected.stride()
    torch.testing.assert_close(out, expected, rtol=ULP[out.dtype], atol=1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", SHAPES)
def test_forward_matches_reference(t, inter, dtype, seed):
    x_TI2, _ = swiglu_input(t, inter, dtype=dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    assert_within_one_ulp(swiglu(x_TI2), reference.swiglu(x_TI2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", SHAPES)
def test_backward_matches_reference(t, inter, dtype, seed):
    x_TI2, grad_TI = swiglu_input(t, inter, dtype=dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    assert_within_one_ulp(swiglu_backward(x_TI2, grad_TI), reference.swiglu_backward(x_TI2, grad_TI))


@pytest.mark.gpu
@pytest.mark.parametrize("t,inter,wanted", [(300, 2048, 0), (300, 2048, 129), (300, 300, 299), (300, 64, 37)])
def test_rows_past_the_wanted_ones_are_skipped(t, inter, wanted, seed):
    """``rows``: forward and backward equal the reference on the first ``rows[0]`` rows (a
    layout's rows in use, read on the device); the capacity rows past them are not computed: those
    past the CTA holding the last wanted row (at most 8 rows a CTA, ``blockwise_tile``) keep the
    poison."""
    x_TI2, grad_TI = swiglu_input(t, inter, dtype=torch.bfloat16, device="cuda", seed=seed)
    rows = torch.tensor([wanted], dtype=torch.int32, device="cuda")
    poison_allocator("cuda")
    y_TI, grad_TI2 = swiglu(x_TI2, rows=rows), swiglu_backward(x_TI2, grad_TI, rows=rows)
    assert_within_one_ulp(y_TI[:wanted], reference.swiglu(x_TI2)[:wanted])
    assert_within_one_ulp(grad_TI2[:wanted], reference.swiglu_backward(x_TI2, grad_TI)[:wanted])
    untouched = -(-wanted // 8) * 8
    assert_poisoned("y_TI's skipped rows", y_TI[untouched:])
    assert_poisoned("grad_TI2's skipped rows", grad_TI2[untouched:])


def test_rows_must_be_one_int32_on_the_device():
    x_TI2, _ = swiglu_input(4, 64, dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(TypeError, match="rows: expected dtype torch.int32"):
        reference.swiglu(x_TI2, rows=torch.tensor([4]))
    with pytest.raises(ValueError, match="rows"):
        reference.swiglu_backward(x_TI2, x_TI2[:, :64], rows=torch.tensor([4, 4], dtype=torch.int32))


def e4m3_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 codes lie between two e4m3 tensors, elementwise (+0 and -0 are 0 apart)."""
    def ordinal(t):
        code = t.view(torch.uint8).int()
        magnitude = code & 0x7F
        return torch.where(code >= 0x80, -magnitude, magnitude)

    return (ordinal(a) - ordinal(b)).abs()


SF_MODES = {"fp32_sf": (False, False), "ue8m0_sf": (True, False), "packed_sf": (True, True)}


@pytest.mark.gpu
@pytest.mark.parametrize("sf_mode", SF_MODES)
@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("t,inter", SHAPES)
def test_fused_cast_matches_reference(t, inter, group, sf_mode, seed):
    round_sf, pack_sf = SF_MODES[sf_mode]
    x_TI2, _ = swiglu_input(t, inter, dtype=torch.bfloat16, device="cuda", seed=seed)
    poison_allocator("cuda")
    q, sf = swiglu_per_token_cast(x_TI2, group=group, round_sf=round_sf, pack_sf=pack_sf)
    q_ref, sf_ref = reference.swiglu_per_token_cast(x_TI2, group=group, round_sf=round_sf, pack_sf=pack_sf)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and sf.dtype == sf_ref.dtype and sf.shape == sf_ref.shape
    steps = e4m3_steps_apart(q, q_ref)
    assert steps.numel() == 0 or int(steps.max()) <= 1
    if pack_sf:
        assert torch.equal(sf, sf_ref)
    else:
        torch.testing.assert_close(sf, sf_ref, rtol=2.0**-23, atol=0)


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="^x_TI2: expected"):
        swiglu(torch.randn(4, 7, device="cuda"))
    with pytest.raises(ValueError, match="^x_TI2: expected"):
        swiglu(torch.randn(4, 8))
    with pytest.raises(ValueError, match="^grad_TI: expected"):
        swiglu_backward(torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda"))
    with pytest.raises(ValueError, match="^group: expected"):
        swiglu_per_token_cast(torch.randn(4, 8, device="cuda"), group=100)
    with pytest.raises(ValueError, match="^pack_sf: expected"):
        swiglu_per_token_cast(torch.randn(4, 8, device="cuda"), pack_sf=True)


def test_compiles_for_sm90a():
    """The runtime's SwiGLU widths: the tiny model's expert (64) and dense (128) MLPs in float32 and
    bfloat16, DeepSeek's expert intermediate 2048 in bfloat16 (plain and fused with the cast), a
    ragged width, and the one-row (few tokens) variants, including I = 64 fused with the cast. Each
    as the runtime calls it: with a row limit (the experts pass a layout's rows) CTAs past it skip;
    without one (the public ops' rows=None; the fused cast has none) rows_1 is never read."""

    def check(source, limited, spec):
        assert "expf" in source and (("rows_1[0]" in source) if limited else ("rows_1" not in source)), spec

    with lowering.compile_only():
        for spec, limited in [
            ((64, "float32", 128, False, False, False, False), True),
            ((128, "bfloat16", 128, False, False, False, False), False),
            ((2048, "bfloat16", 128, False, False, False, False), True),
            ((2048, "bfloat16", 128, True, True, True, False), False),
            ((300, "float16", 128, True, False, False, False), False),
            ((2048, "bfloat16", 128, True, False, False, True), False),  # one-row tiles (few tokens)
            ((300, "float16", 128, False, False, False, True), True),
            # few tokens at I = 64 fused with the cast (the GPU tests' T = 1): rows narrower than a
            # warp of vectors keep the default tile (one-row tiles failed to lower in v2)
            *[((64, "bfloat16", group, True, *sf, True), False) for group in (128, 64) for sf in SF_MODES.values()],
            ((64, "float32", 64, True, False, False, True), False),
        ]:
            check(lowering.kernel_source(get_swiglu_forward_kernel(*spec, limited)), limited, spec)
        # few tokens: FEW_TOKENS_VEC values a thread without the cast (512 threads for 1024 columns),
        # with it a scale group a warp (groups of 128: 4 values a thread, 512 threads a 2048-wide row;
        # of 64: 2, 512), its amax one redux.sync
        for cast, group, threads in [(False, 128, 512), (True, 128, 512), (True, 64, 512)]:
            source = lowering.kernel_source(get_swiglu_forward_kernel(2048, "bfloat16", group, cast, False, False, True,
                                                                      False))
            assert f"__launch_bounds__({threads}, 1)" in source and ("__reduce_max_sync" in source) == cast, (cast, group)
        for spec, limited in [((64, "float32", "float32"), True), ((128, "bfloat16", "bfloat16"), False),
                              ((2048, "bfloat16", "bfloat16"), True)]:
            check(lowering.kernel_source(get_swiglu_backward_kernel(*spec, limited)), limited, spec)


OPTIONS = {"weighted": (True, None), "clamped": (False, 2.5), "weighted_clamped": (True, 2.5)}


@pytest.mark.gpu
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("t,inter", [(1, 64), (130, 300), (257, 2048)])
def test_weights_and_clamp_match_reference(t, inter, option, seed):
    """Per-row weights and the clamp, forward (plain and fused with the cast) and backward, against
    the reference on the same GPU (tolerances as above; the weights' gradient is a sum over I taken
    in another order, so it is compared to float32 rounding of such a sum)."""
    weighted, clamp = OPTIONS[option]
    x_TI2, grad_TI = swiglu_input(t, inter, dtype=torch.bfloat16, device="cuda", seed=seed)
    weights_T = torch.rand(t, device="cuda") + 0.1 if weighted else None
    options = dict(weights_T=weights_T, clamp=clamp)
    poison_allocator("cuda")
    assert_within_one_ulp(swiglu(x_TI2, **options), reference.swiglu(x_TI2, **options))
    q, sf = swiglu_per_token_cast(x_TI2, round_sf=True, **options)
    q_ref, sf_ref = reference.swiglu_per_token_cast(x_TI2, round_sf=True, **options)
    assert int(e4m3_steps_apart(q, q_ref).max()) <= 1 and torch.equal(sf, sf_ref)
    out, expected = swiglu_backward(x_TI2, grad_TI, **options), reference.swiglu_backward(x_TI2, grad_TI, **options)
    if not weighted:
        assert_within_one_ulp(out, expected)
        return
    assert_within_one_ulp(out[0], expected[0])
    assert out[1].dtype == torch.float32 and out[1].shape == (t,)
    torch.testing.assert_close(out[1], expected[1], rtol=1e-5, atol=1e-5 * inter)


def test_weights_and_clamp_compile_for_sm90a():
    """The options in each kernel: the weight read only when weighted, the clamp's limit a constant."""
    with lowering.compile_only():
        for (weighted, clamp), cast, one_row in [((True, 7.0), True, False), ((True, None), False, True),
                                                 ((False, 7.0), False, False), ((True, 7.0), True, True)]:
            source = lowering.kernel_source(get_swiglu_forward_kernel(
                2048, "bfloat16", 128, cast, True, False, one_row, False, weighted=weighted, clamp=clamp))
            assert ("weights_T[" in source) == weighted and ("7.000000e+00" in source) == (clamp is not None)
        for (weighted, clamp), inter in [((True, 7.0), 300), ((True, None), 2048), ((False, 7.0), 64)]:
            source = lowering.kernel_source(get_swiglu_backward_kernel(inter, "bfloat16", "bfloat16", True, weighted, clamp))
            assert ("grad_w_TN[" in source) == weighted and ("7.000000e+00" in source) == (clamp is not None)
