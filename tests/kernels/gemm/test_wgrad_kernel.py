"""The k-grouped FP8 weight-gradient kernel against the reference (GPU), and lowered and
compiled for sm_90a (CPU).

Tolerance: the same products as the reference, summed per 128-row chunk on the tensor cores
(FP8 accumulation keeps fewer bits than float32), scaled, then added in float32; the reference
dequantizes first and sums in float32: ``rtol = 2**-9`` and ``atol = 2**-10`` of the output's
largest magnitude for float32, one bfloat16 ulp (``rtol = 2**-7``) for bfloat16."""

import pytest
import torch

import kernels.gemm as gemm
from kernels import lowering, quant
from kernels.gemm import reference, wgrad_kernel
from kernels.gemm.wgrad_kernel import get_grouped_fp8_mm_wgrad_kernel
from kernels.testing import grouped_gemm_inputs, poison_allocator, spy

COUNTS = {
    "ragged": [256, 0, 384, 128, 0],
    "one_expert": [640],
    "segments_of_128": [128] * 6,
    "all_empty": [0, 0, 0],
}
# (M, N) of a weight's gradient: DeepSeek-V3's W13 [7168, 4096] and W2 [2048, 7168]
WIDTHS = {"w13": (7168, 4096), "w2": (2048, 7168)}
TOLERANCE = {torch.float32: (2**-9, 2**-10), torch.bfloat16: (2**-7, 2**-10)}


def operands(counts, m, n, capacity, seed):
    """The K-major casts of an input ``x_PM`` and an output gradient ``dy_PN``."""
    x_PM, _, offsets_E = grouped_gemm_inputs(counts, m, 128, capacity=capacity, device="cuda", seed=seed)
    dy_PN = grouped_gemm_inputs(counts, n, 128, capacity=capacity, device="cuda", seed=seed + 1)[0]
    (qx, sx_CM), (qdy, sdy_CN) = quant.per_channel_cast(x_PM), quant.per_channel_cast(dy_PN)
    return gemm.k_major(qx), sx_CM, gemm.k_major(qdy), sdy_CN, offsets_E


def assert_matches_reference(got_EMN, args, out_dtype=torch.float32):
    want = reference.grouped_fp8_mm_wgrad(*(t.cpu() for t in args), out_dtype=out_dtype).float()
    rtol, atol = TOLERANCE[out_dtype]
    assert got_EMN.dtype == out_dtype
    torch.testing.assert_close(got_EMN.float().cpu(), want, rtol=rtol, atol=atol * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("counts", COUNTS)
def test_matches_reference(counts, block_n, out_dtype, seed):
    args = operands(COUNTS[counts], 256, 384, 100, seed)
    poison_allocator("cuda")
    got = wgrad_kernel.grouped_fp8_mm_wgrad(*args, out_dtype=out_dtype, block_n=block_n)
    assert_matches_reference(got, args, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("width", WIDTHS)
def test_matches_reference_at_deepseek_v3_widths(width, seed):
    m, n = WIDTHS[width]
    args = operands([256, 0, 128, 384], m, n, 128, seed)
    poison_allocator("cuda")
    assert_matches_reference(wgrad_kernel.grouped_fp8_mm_wgrad(*args), args)


@pytest.mark.gpu
def test_public_op_picks_the_kernel(monkeypatch, seed):
    calls = spy(monkeypatch, wgrad_kernel, "grouped_fp8_mm_wgrad")
    args = operands([128, 256], 256, 256, 0, seed)
    assert_matches_reference(gemm.grouped_fp8_mm_wgrad(*args), args)
    assert len(calls) == 1


@pytest.mark.gpu
def test_kernel_argument_errors_name_the_argument(seed):
    a_MR, sa_CM, b_NR, sb_CN, offsets_E = operands([128], 256, 256, 0, seed)
    with pytest.raises(ValueError, match="a_MR"):
        wgrad_kernel.grouped_fp8_mm_wgrad(a_MR[:, :120], sa_CM, b_NR[:, :120], sb_CN, offsets_E)
    with pytest.raises(ValueError, match="sb_CN"):
        wgrad_kernel.grouped_fp8_mm_wgrad(a_MR, sa_CM, b_NR, sb_CN.T, offsets_E)
    with pytest.raises(TypeError, match="out_dtype"):
        wgrad_kernel.grouped_fp8_mm_wgrad(a_MR, sa_CM, b_NR, sb_CN, offsets_E, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="stages"):
        wgrad_kernel.grouped_fp8_mm_wgrad(a_MR, sa_CM, b_NR, sb_CN, offsets_E, stages=0)


def test_compiles_for_sm90a():
    """DeepSeek-V3's weight gradients in float32 and bfloat16 and a narrow tile: a dynamic chunk
    count per expert, four TMA loads a chunk."""
    with lowering.compile_only():
        for (m, n), out_dtype, block_n in [(WIDTHS["w13"], "float32", 128), (WIDTHS["w2"], "bfloat16", 128),
                                           ((256, 384), "float32", 64)]:
            source = lowering.kernel_source(get_grouped_fp8_mm_wgrad_kernel(m, n, 64, out_dtype, block_n))
            assert f"kFloat8_e4m3, tl::DataType::kFloat32, 64, {block_n}, 32," in source, (m, n)
            assert source.count("tl::tma_load(") == 4 and "offsets_E[((int)blockIdx.z)]" in source, (m, n)
