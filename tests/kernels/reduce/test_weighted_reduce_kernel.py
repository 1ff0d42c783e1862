"""The weighted reduce kernel (plain and fused with FP8 dequantization) against the reference.

Tolerance: none. The kernel rounds every product and every sum to float32 in the reference's order
k = 0 .. K-1 (explicit IEEE operations, no FMA), so outputs are compared bit for bit; every
output element is checked, and outputs start as poison."""

import sys

import pytest
import torch

from kernels import lowering
from kernels.reduce import reference
from kernels.reduce.weighted_reduce_kernel import (
    get_weighted_reduce_kernel,
    reduce_tile,
    reduce_vector_bytes,
    weighted_reduce,
)
from kernels.testing import fp8_rows, poison_allocator, reduce_routes

CASES = [  # (T, K, P, D, y dtype, index dtype, out dtype)
    (0, 8, 64, 7168, torch.bfloat16, torch.int32, torch.bfloat16),
    (37, 6, 120, 300, torch.float32, torch.int64, torch.float32),
    (20, 8, 50, 100, torch.bfloat16, torch.int32, torch.bfloat16),
    (9, 2, 30, 64, torch.float16, torch.int64, torch.float32),
    (6, 3, 0, 32, torch.float32, torch.int32, torch.float32),
    (130, 8, 700, 7168, torch.bfloat16, torch.int32, torch.bfloat16),
    (65, 4, 200, 7168 + 64, torch.float32, torch.int32, torch.bfloat16),
    (5, 3, 20, 7, torch.bfloat16, torch.int32, torch.bfloat16),  # 2-byte vectors: too narrow to stage
]


def assert_same_bits(out, expected):
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.stride() == expected.stride()
    assert torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,p,d,dtype,index_dtype,out_dtype", CASES)
def test_matches_reference_bit_for_bit(t, k, p, d, dtype, index_dtype, out_dtype, seed):
    y_PD = torch.randn(p, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    pos_TK, weights_TK = reduce_routes(t, k, p, dtype=index_dtype, seed=seed)
    poison_allocator("cuda")
    out = weighted_reduce(y_PD.cuda(), pos_TK.cuda(), weights_TK.cuda(), out_dtype=out_dtype)
    assert_same_bits(out, reference.weighted_reduce(y_PD, pos_TK, weights_TK, out_dtype=out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,p,d,dtype,index_dtype,out_dtype", CASES[1:3] + CASES[5:])
def test_weights_of_one_match_reference_bit_for_bit(t, k, p, d, dtype, index_dtype, out_dtype, seed):
    """``weights_TK=None``: the kernel compiled without weights, against the reference's sum."""
    y_PD = torch.randn(p, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    pos_TK, _ = reduce_routes(t, k, p, dtype=index_dtype, seed=seed)
    poison_allocator("cuda")
    out = weighted_reduce(y_PD.cuda(), pos_TK.cuda(), None, out_dtype=out_dtype)
    assert_same_bits(out, reference.weighted_reduce(y_PD, pos_TK, None, out_dtype=out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["fp32_sf", "packed_sf"])
@pytest.mark.parametrize("t,k,p,d,group", [(25, 4, 40, 300, 128), (33, 8, 90, 256, 64), (200, 8, 600, 7168, 128)])
def test_fp8_dequantization_matches_reference(t, k, p, d, group, packed, seed):
    q_PD, sf_PG = fp8_rows(p, d, group=group, packed=packed, seed=seed)
    pos_TK, weights_TK = reduce_routes(t, k, p, seed=seed)
    for out_dtype in (torch.bfloat16, torch.float32):
        poison_allocator("cuda")
        out = weighted_reduce(
            q_PD.cuda(), pos_TK.cuda(), weights_TK.cuda(), sf_PG=sf_PG.cuda(), group=group, out_dtype=out_dtype
        )
        expected = reference.weighted_reduce(q_PD, pos_TK, weights_TK, sf_PG=sf_PG, group=group, out_dtype=out_dtype)
        assert_same_bits(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kwargs,error,argname",
    [
        (dict(y_PD=torch.ones(8, 4, dtype=torch.int32)), TypeError, "y_PD"),
        (dict(y_PD=torch.randn(8, 256)), ValueError, "y_PD"),
        (dict(weights_TK=torch.ones(3, 2).bfloat16()), TypeError, "weights_TK"),
        (dict(out_dtype=torch.int64), TypeError, "out_dtype"),
        (dict(sf_PG=torch.ones(8, 2)), ValueError, "sf_PG"),
    ],
    ids=["y_dtype", "y_device", "weights_dtype", "out_dtype", "sf_with_bf16_y"],
)
def test_bad_input_names_the_argument(kwargs, error, argname):
    """Shapes, dtypes and devices; not values (a host sync): see the out-of-range test."""
    args = dict(y_PD=torch.randn(8, 256), pos_TK=torch.zeros(3, 2, dtype=torch.int64), weights_TK=torch.ones(3, 2))
    args.update(kwargs)
    device = "cpu" if argname == "y_PD" and error is ValueError else "cuda"
    args = {name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in args.items()}
    with pytest.raises(error, match=f"^{argname}: expected"):
        weighted_reduce(args.pop("y_PD"), args.pop("pos_TK"), args.pop("weights_TK"), **args)


SPECIALIZATIONS = [  # (num_cols, topk, y, index, out, group, packed): combine and dispatch-backward in
    # the runtime (int32 positions, y's own dtype out) at hidden 7168 and 64, then the fused FP8 path
    (7168, 8, "bfloat16", "int32", "bfloat16", 128, False),
    (64, 2, "float32", "int32", "float32", 128, False),
    (64, 2, "bfloat16", "int32", "bfloat16", 128, False),
    (7168, 8, "float8_e4m3fn", "int32", "bfloat16", 128, False),
    (7168, 8, "float8_e4m3fn", "int32", "bfloat16", 128, True),
    (300, 6, "float32", "int64", "float32", 128, False),
    (7168, 8, "float8_e4m3fn", "int32", "bfloat16", 128, False, False, 8),  # a small batch's e4m3 rows
    (7, 2, "bfloat16", "int32", "bfloat16", 128, False),  # an odd width: 2-byte vectors, in registers
]
HOME_SUMS = [  # combine's home sum (weights of 1, int32 rows): two ranks at hidden 7168, the tiny model's 64
    (7168, 2, "bfloat16", "int32", "bfloat16", 128, False, True),
    (64, 2, "float32", "int32", "float32", 128, False, True),
]


def test_compiles_for_sm90a():
    """Each specialization as ``weighted_reduce`` launches it: rows staged in shared memory by
    ``cp.async`` where a thread's vector is 16 bytes, in registers where it is narrower (8 bytes of
    a small batch's e4m3 rows, 2 of an odd bf16 width, which ``cp.async`` cannot move)."""
    with lowering.compile_only():
        for spec in SPECIALIZATIONS + HOME_SUMS:
            num_cols, y_dtype, vector_bytes = spec[0], spec[2], spec[8] if len(spec) > 8 else 16
            y_bytes = torch.empty(0, dtype=getattr(torch, y_dtype)).element_size()
            staged = reduce_tile(num_cols, y_bytes, vector_bytes=vector_bytes)[0] * y_bytes == 16
            source = lowering.kernel_source(get_weighted_reduce_kernel(*spec))
            assert lowering.waits_first(source) and ("cp_async" in source) == staged, spec
            # the home sums have no product left: the rows are added as they are
            assert ("__fmul_rn" in source) == (spec not in HOME_SUMS), spec


def test_small_batches_of_e4m3_rows_take_8_bytes_a_thread(monkeypatch):
    """16 bytes a thread, but 8 for e4m3 rows while the 16-byte grid would hold under 30% of an
    H100's thread slots (132 SMs x 2048: hidden 7168 gives 448 threads a token, so up to 181 tokens)."""
    monkeypatch.setattr(sys.modules[reduce_vector_bytes.__module__], "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert [reduce_vector_bytes(t, 7168, 1, cpu) for t in (1, 128, 181, 182, 16384)] == [8, 8, 8, 16, 16]
    assert reduce_vector_bytes(128, 7168, 2, cpu) == 16  # bf16 rows: 16 at every size


@pytest.mark.gpu
def test_rows_out_of_range_read_as_masked(seed):
    """Values are not checked on the host: a row past P adds nothing, as -1 does."""
    y_PD = torch.randn(8, 256, device="cuda")
    pos_TK = torch.tensor([[0, 8], [100, 3], [-1, 7]], dtype=torch.int32, device="cuda")
    weights_TK = torch.rand(3, 2, device="cuda")
    masked_TK = torch.where(pos_TK < 8, pos_TK, -1)
    assert torch.equal(weighted_reduce(y_PD, pos_TK, weights_TK), reference.weighted_reduce(y_PD, masked_TK, weights_TK))
