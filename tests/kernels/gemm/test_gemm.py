"""The FP8 grouped GEMMs' references (the specification) on the CPU: against float matmuls within
FP8's error and against the dequantized operands' float64 matmul within the output's rounding;
their argument checks; the weight cast and the K-major copies; which implementation the public
ops pick."""

import pytest
import torch

import kernels.gemm as gemm
from kernels import quant
from kernels.gemm import grouped_mm_kernel, reference, wgrad_kernel
from kernels.testing import grouped_gemm_inputs

COUNTS = {"ragged": [256, 0, 128, 384], "one_expert": [512], "empty_first_last": [0, 128, 128, 0]}
FP8_ERROR = 0.05  # relative L2 error of a product of two e4m3 casts (each ~0.026, per kernels/quant)


def fp8_operands(counts, k, n, capacity, seed):
    x_PK, w_ENK, offsets_E = grouped_gemm_inputs(counts, k, n, capacity=capacity, seed=seed)
    a_PK, sa_PG = quant.per_token_cast(x_PK)
    b_ENK, sb_EJG = gemm.cast_weights(w_ENK)
    return (x_PK, w_ENK), (a_PK, sa_PG, b_ENK, sb_EJG, offsets_E)


def segments(offsets_E):
    ends = offsets_E.tolist()
    return list(zip([0] + ends[:-1], ends))


def rel_error(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("counts", COUNTS)
def test_forward_is_the_float_matmul_within_fp8_error(counts, seed):
    (x_PK, w_ENK), operands = fp8_operands(COUNTS[counts], 256, 384, 37, seed)
    out_PN = gemm.grouped_fp8_mm(*operands)
    assert out_PN.dtype == torch.bfloat16 and out_PN.shape == (x_PK.shape[0], 384)
    want_PN = torch.zeros(out_PN.shape, dtype=torch.float64)
    for e, (start, end) in enumerate(segments(operands[-1])):
        want_PN[start:end] = x_PK[start:end].double() @ w_ENK[e].double().T
    assert rel_error(out_PN, want_PN) < FP8_ERROR
    end = operands[-1][-1]
    assert not out_PN[end:].any()  # capacity rows: zeros in the reference


def test_forward_is_the_dequantized_matmul_rounded_once(seed):
    """The reference's only errors past the casts are float32 sums (at most ``2**-16`` of the sum of
    the products' magnitudes over K = 384) and the bfloat16 rounding (``2**-8`` of the result)."""
    _, (a_PK, sa_PG, b_ENK, sb_EJG, offsets_E) = fp8_operands(COUNTS["ragged"], 384, 256, 0, seed)
    out_PN = reference.grouped_fp8_mm(a_PK, sa_PG, b_ENK, sb_EJG, offsets_E)
    a_deq = quant.cast_back(a_PK, sa_PG, block=(1, 128), out_dtype=torch.float32).double()
    for e, (start, end) in enumerate(segments(offsets_E)):
        b_deq = quant.cast_back(b_ENK[e], sb_EJG[e], block=(128, 128), out_dtype=torch.float32).double()
        want = a_deq[start:end] @ b_deq.T
        bound = 2**-8 * want.abs() + 2**-16 * (a_deq[start:end].abs() @ b_deq.abs().T)
        assert ((out_PN[start:end].double() - want).abs() <= bound).all(), e


def test_data_gradient_takes_the_transposed_weight_cast(seed):
    """``cast_weights`` once: its transpose is the transposed weights' cast, byte for byte, so
    ``dy @ W`` runs on the forward's weight cast."""
    x_PK, w_ENK, _ = grouped_gemm_inputs([128, 256], 256, 384, seed=seed)
    q_ENK, sf_EJG = gemm.cast_weights(w_ENK)
    q_EKN, sf_EGJ = gemm.cast_weights(w_ENK.transpose(1, 2).contiguous())
    assert torch.equal(q_ENK.transpose(1, 2).contiguous().view(torch.uint8), q_EKN.view(torch.uint8))
    assert torch.equal(sf_EJG.transpose(1, 2), sf_EGJ)
    q_ref, sf_ref = quant.per_block_cast(w_ENK[1])
    assert torch.equal(q_ENK[1].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf_EJG[1], sf_ref)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", COUNTS)
def test_wgrad_is_the_float_matmul_within_fp8_error(counts, out_dtype, seed):
    x_PK, _, offsets_E = grouped_gemm_inputs(COUNTS[counts], 256, 128, capacity=50, seed=seed)
    dy_PN = grouped_gemm_inputs(COUNTS[counts], 384, 128, capacity=50, seed=seed + 1)[0]
    qx, sx_CM = quant.per_channel_cast(x_PK)
    qdy, sdy_CN = quant.per_channel_cast(dy_PN)
    a_MR, b_NR = gemm.k_major(qx), gemm.k_major(qdy)
    out_EMN = gemm.grouped_fp8_mm_wgrad(a_MR, sx_CM, b_NR, sdy_CN, offsets_E, out_dtype=out_dtype)
    assert out_EMN.dtype == out_dtype and out_EMN.shape == (len(COUNTS[counts]), 256, 384)
    for e, (start, end) in enumerate(segments(offsets_E)):
        want = x_PK[start:end].double().T @ dy_PN[start:end].double()
        if end == start:
            assert not out_EMN[e].any()
        else:
            assert rel_error(out_EMN[e], want) < FP8_ERROR, e


def test_k_major_pads_rows_to_128():
    q_PM = torch.randn(300, 256).to(reference.E4M3)
    q_MR = gemm.k_major(q_PM)
    assert q_MR.shape == (256, 384) and q_MR.is_contiguous()
    assert torch.equal(q_MR[:, :300].view(torch.uint8), q_PM.T.view(torch.uint8))
    assert not q_MR[:, 300:].view(torch.uint8).any()
    assert gemm.k_major(q_PM[:256]).shape == (256, 256)


def forward_args(seed=0):
    return fp8_operands([128, 128], 256, 128, 0, seed)[1]


def wgrad_args():
    q = torch.zeros(256, 128).to(reference.E4M3)
    sf = torch.ones(2, 128)
    return gemm.k_major(q), sf, gemm.k_major(q), sf, torch.tensor([128, 256], dtype=torch.int32)


@pytest.mark.parametrize(
    "position,value,error,argname",
    [
        (0, lambda a: a.float(), TypeError, "a_PK"),
        (1, lambda sa: sa[:, :1], ValueError, "sa_PG"),
        (2, lambda b: b[:, :, :128], ValueError, "b_ENK"),
        (3, lambda sb: sb.double(), TypeError, "sb_EJG"),
        (4, lambda o: o.long(), TypeError, "offsets_E"),
        (4, lambda o: o[:1], ValueError, "offsets_E"),
        (4, lambda o: o - 1, ValueError, "offsets_E"),  # not multiples of 128
        (4, lambda o: o.flip(0), ValueError, "offsets_E"),  # decreasing
        (4, lambda o: o * 2, ValueError, "offsets_E"),  # past the rows
    ],
)
def test_forward_argument_errors_name_the_argument(position, value, error, argname):
    args = list(forward_args())
    args[position] = value(args[position])
    with pytest.raises(error, match=argname):
        gemm.grouped_fp8_mm(*args)


@pytest.mark.parametrize(
    "position,value,error,argname",
    [
        (0, lambda a: a.view(torch.uint8), TypeError, "a_MR"),
        (1, lambda sa: sa[:1], ValueError, "sa_CM"),
        (2, lambda b: b[:, :128], ValueError, "b_NR"),
        (3, lambda sb: sb[:, :64], ValueError, "sb_CN"),
        (4, lambda o: o + 128, ValueError, "offsets_E"),  # past the rows
        (4, lambda o: o.view(1, 2), ValueError, "offsets_E"),
    ],
)
def test_wgrad_argument_errors_name_the_argument(position, value, error, argname):
    args = list(wgrad_args())
    args[position] = value(args[position])
    with pytest.raises(error, match=argname):
        gemm.grouped_fp8_mm_wgrad(*args)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm.grouped_fp8_mm_wgrad(*wgrad_args(), out_dtype=torch.float16)


def test_ops_pick_the_kernel_for_multiples_of_128(monkeypatch, stub_kernel):
    """Where ``use_tilelang`` says so, shapes the kernels take go to them and others to the reference."""
    monkeypatch.setattr(gemm, "use_tilelang", lambda device: True)
    forward = stub_kernel(grouped_mm_kernel, "grouped_fp8_mm", "kernel")
    wgrad = stub_kernel(wgrad_kernel, "grouped_fp8_mm_wgrad", "kernel")
    assert gemm.grouped_fp8_mm(*forward_args()) == "kernel"
    assert gemm.grouped_fp8_mm_wgrad(*wgrad_args()) == "kernel"
    assert len(forward) == len(wgrad) == 1
    narrow = fp8_operands([128], 256, 64, 0, 0)[1]  # N = 64: the reference
    assert gemm.grouped_fp8_mm(*narrow).shape == (128, 64)
    assert len(forward) == 1
