"""The m-grouped FP8 GEMM kernel against the reference (GPU), and lowered and compiled for sm_90a
(CPU).

Tolerance: the kernel and the reference multiply the same e4m3 values; the kernel sums each
128-wide chunk on the tensor cores (whose FP8 accumulation keeps fewer bits than float32), scales
the chunk sum and adds it, the reference dequantizes first and sums in float32. Both round to
bfloat16 at the end, so they may differ by one bfloat16 ulp (``rtol = 2**-7``) plus the chunk
sums' rounding, well under ``2**-10`` of the output's largest magnitude (``atol``)."""

import pytest
import torch

import kernels.gemm as gemm
from kernels import lowering, quant
from kernels.gemm import grouped_mm_kernel, reference
from kernels.gemm.grouped_mm_kernel import get_grouped_fp8_mm_kernel, mn_major_rows, tile_experts
from kernels.testing import grouped_gemm_inputs, poison_allocator, spy

COUNTS = {
    "ragged": [256, 0, 384, 128, 0],
    "one_expert": [640],
    "segments_of_128": [128] * 6,
    "all_empty": [0, 0, 0],
}
# (K, N): DeepSeek-V3's x @ W13, h @ W2, and the data gradients dh @ W13^T, dy @ W2^T
WIDTHS = {"w13": (7168, 4096), "w2": (2048, 7168), "w13_dgrad": (4096, 7168), "w2_dgrad": (7168, 2048)}


def operands(counts, k, n, capacity, seed):
    x_PK, w_ENK, offsets_E = grouped_gemm_inputs(counts, k, n, capacity=capacity, device="cuda", seed=seed)
    a_PK, sa_PG = quant.per_token_cast(x_PK)
    b_ENK, sb_EJG = gemm.cast_weights(w_ENK)
    return a_PK, sa_PG, b_ENK, sb_EJG, offsets_E


def assert_matches_reference(got_PN, args):
    want_PN = reference.grouped_fp8_mm(*(t.cpu() for t in args))
    end = int(args[-1][-1]) if args[-1].numel() else 0
    got, want = got_PN[:end].float().cpu(), want_PN[:end].float()
    atol = 2**-10 * float(want.abs().max()) if end else 0.0
    torch.testing.assert_close(got, want, rtol=2**-7, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("counts", COUNTS)
def test_matches_reference(counts, block_n, seed):
    args = operands(COUNTS[counts], 512, 384, 100, seed)
    poison_allocator("cuda")
    assert_matches_reference(grouped_mm_kernel.grouped_fp8_mm(*args, block_n=block_n), args)


@pytest.mark.gpu
@pytest.mark.parametrize("width", WIDTHS)
def test_matches_reference_at_deepseek_v3_widths(width, seed):
    k, n = WIDTHS[width]
    args = operands([256, 0, 128, 384], k, n, 128, seed)
    poison_allocator("cuda")
    assert_matches_reference(grouped_mm_kernel.grouped_fp8_mm(*args), args)


@pytest.mark.gpu
def test_public_op_picks_the_kernel(monkeypatch, seed):
    calls = spy(monkeypatch, grouped_mm_kernel, "grouped_fp8_mm")
    args = operands([128, 256], 256, 256, 0, seed)
    assert_matches_reference(gemm.grouped_fp8_mm(*args), args)
    assert len(calls) == 1


@pytest.mark.gpu
def test_kernel_argument_errors_name_the_argument(seed):
    a_PK, sa_PG, b_ENK, sb_EJG, offsets_E = operands([128], 256, 256, 0, seed)
    with pytest.raises(ValueError, match="a_PK"):
        grouped_mm_kernel.grouped_fp8_mm(a_PK.cpu(), sa_PG, b_ENK, sb_EJG, offsets_E)
    with pytest.raises(ValueError, match="b_ENK"):
        grouped_mm_kernel.grouped_fp8_mm(a_PK[:, :200], sa_PG, b_ENK[:, :, :200], sb_EJG, offsets_E)
    with pytest.raises(ValueError, match="sa_PG"):
        grouped_mm_kernel.grouped_fp8_mm(a_PK, sa_PG.T, b_ENK, sb_EJG, offsets_E)
    with pytest.raises(ValueError, match="stages"):
        grouped_mm_kernel.grouped_fp8_mm(a_PK, sa_PG, b_ENK, sb_EJG, offsets_E, stages=grouped_mm_kernel.MAX_STAGES + 1)


def test_tile_experts_finds_each_tiles_expert():
    offsets_E = torch.tensor([256, 256, 384, 768], dtype=torch.int32)
    assert tile_experts(offsets_E, 1000).tolist() == [0, 0, 2, 3, 3, 3, -1, -1]
    assert tile_experts(torch.zeros(3, dtype=torch.int32), 300).tolist() == [-1, -1, -1]


def test_mn_major_rows_are_the_scales_transposed_with_rows_padded_to_4():
    sa_PG = torch.rand(301, 56)
    sa_GQ = mn_major_rows(sa_PG)
    assert sa_GQ.shape == (56, 304) and sa_GQ.is_contiguous() and torch.equal(sa_GQ[:, :301], sa_PG.T)


def test_compiles_for_sm90a():
    """DeepSeek-V3's widths (forward and data gradient) and a narrow tile: one m64n128k32 (m64n64k32)
    FP8 wgmma per 32 columns of a chunk a warpgroup, operands and scales by TMA."""
    with lowering.compile_only():
        for (k, n), block_n in [(WIDTHS["w13"], 128), (WIDTHS["w2"], 128), (WIDTHS["w2_dgrad"], 128),
                                ((256, 384), 64)]:
            source = lowering.kernel_source(get_grouped_fp8_mm_kernel(n, k, 64, block_n))
            assert f"kFloat8_e4m3, tl::DataType::kFloat32, 64, {block_n}, 32," in source, (k, n)
            assert source.count("tl::tma_load(") == 3 and "tma_store" in source, (k, n)
            assert "expert_M" in source and "warpgroup_reg_alloc" in source, (k, n)
