"""reduce_sum_home (a combine's home side, the own rows reduced into the sum of the returned ones):
the reference against what it replaces (``reduce_put`` storing the own rows home, then the
unit-weight sum) and a loop, the TileLang kernel against the reference bit for bit, argument
errors, and its sm_90a compile."""

import pytest
import torch

from kernels import lowering
from kernels.comm import PeerRegion
from kernels.comm import reference as comm_reference
from kernels.reduce import reference
from kernels.reduce.weighted_reduce_kernel import get_reduce_sum_home_kernel, reduce_sum_home
from kernels.quant.reference import per_token_cast
from kernels.testing import poison_allocator, reduce_routes


def _inputs(t: int, k: int, p: int, d: int, world: int, rank: int, dtype: torch.dtype, seed: int, device="cpu",
            index_dtype=torch.int32):
    """Expert outputs [P, D], the own rows' routes [T, K], a region of W * T rows of returned rows
    (block w: rank w's), and ``home_TW`` (token t's row from rank w at ``w * T + t``; about a
    third of the tokens lack a row from a given rank, this one included)."""
    g = torch.Generator().manual_seed(seed)
    y_PD = torch.randn(p, d, generator=g).to(dtype)
    pos_TK, weights_TK = reduce_routes(t, k, p, seed=seed)
    rows_SD = torch.randn(world * t, d, generator=g).to(dtype)
    home_TW = torch.arange(world, dtype=torch.int32) * t + torch.arange(t, dtype=torch.int32)[:, None]
    home_TW[torch.rand(t, world, generator=g) < 0.3] = -1
    home_TW[:, rank][pos_TK.eq(-1).all(1)] = -1  # no route here: nothing reduced for the token
    return [x.to(device) for x in (y_PD, pos_TK, weights_TK, rows_SD, home_TW.to(index_dtype))]


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 1)])
def test_reference_is_reduce_put_home_then_the_sum(world, rank, seed):
    t, d = 10, 6
    y_PD, pos_TK, weights_TK, rows_SD, home_TW = _inputs(t, 3, 20, d, world, rank, torch.bfloat16, seed)
    got = reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank=rank)

    stored = rows_SD.clone()
    dest_TW = torch.full((t, 1), -1, dtype=torch.int32)
    dest_TW[:, 0] = home_TW[:, rank]
    comm_reference.reduce_put(y_PD, pos_TK, weights_TK, dest_TW, PeerRegion(views=(stored,)))
    assert torch.equal(got.view(torch.int16), reference.weighted_reduce(stored, home_TW, None).view(torch.int16))

    want = torch.zeros(t, d)
    for i in range(t):
        for w in range(world):
            if home_TW[i, w] < 0:
                continue
            if w == rank:
                row = sum(weights_TK[i, j] * y_PD[pos_TK[i, j]].float() for j in range(3) if pos_TK[i, j] >= 0)
                want[i] += torch.as_tensor(row).to(torch.bfloat16).float()
            else:
                want[i] += rows_SD[home_TW[i, w]].float()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def _fp8(rows_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returned rows as combine's FP8 transport stores them: e4m3 and per-token 1 x 128 scales."""
    return per_token_cast(rows_SD, group=128)


@pytest.mark.parametrize("world,rank", [(2, 0), (3, 1)])
def test_fp8_reference_dequantizes_the_returned_rows_in_rank_order(world, rank, seed):
    """The own row in y's dtype, each returned row ``q.float() * sf``, summed in float32 in rank
    order; a ragged last scale group (D = 160)."""
    t, d = 10, 160
    y_PD, pos_TK, weights_TK, rows_SD, home_TW = _inputs(t, 3, 20, d, world, rank, torch.bfloat16, seed)
    q_SD, sf_SG = _fp8(rows_SD)
    got = reference.reduce_sum_home(y_PD, pos_TK, weights_TK, q_SD, home_TW, rank=rank, sf_SG=sf_SG)
    assert got.dtype == torch.bfloat16
    own_TD = reference.weighted_reduce(y_PD, pos_TK, weights_TK)
    scale_SD = sf_SG.repeat_interleave(128, 1)[:, :d]
    want = torch.zeros(t, d)
    for i in range(t):
        for w in range(world):
            if home_TW[i, w] >= 0:
                want[i] += own_TD[i].float() if w == rank else q_SD[home_TW[i, w]].float() * scale_SD[home_TW[i, w]]
    assert torch.equal(got, want.to(torch.bfloat16))


CASES = [  # (tokens, K, P, D, dtype, world, rank, index dtype): DeepSeek-V3's home side and tiny ones
    (300, 8, 900, 7168, torch.bfloat16, 2, 1, torch.int32),
    (129, 8, 700, 7168, torch.bfloat16, 8, 5, torch.int64),
    (33, 2, 40, 64, torch.float32, 3, 0, torch.int32),
    (40, 4, 50, 100, torch.float16, 2, 1, torch.int32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [False, None])  # the own rows in registers, or staged where 16 bytes
@pytest.mark.parametrize("t,k,p,d,dtype,world,rank,index_dtype", CASES)
def test_kernel_matches_reference_bit_for_bit(t, k, p, d, dtype, world, rank, index_dtype, staged, seed):
    inputs = _inputs(t, k, p, d, world, rank, dtype, seed, device="cuda", index_dtype=index_dtype)
    poison_allocator("cuda")
    got = reduce_sum_home(*inputs, rank=rank, staged=staged)
    want = reference.reduce_sum_home(*inputs, rank=rank)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,p,d,dtype,world,rank,index_dtype", CASES[:2] + [
    (33, 4, 40, 160, torch.float32, 3, 0, torch.int32), (40, 4, 50, 4096, torch.float16, 2, 1, torch.int32)])
@pytest.mark.parametrize("staged", [False, None])
def test_fp8_kernel_matches_reference_bit_for_bit(t, k, p, d, dtype, world, rank, index_dtype, staged, seed):
    y_PD, pos_TK, weights_TK, rows_SD, home_TW = _inputs(t, k, p, d, world, rank, dtype, seed, device="cuda",
                                                         index_dtype=index_dtype)
    q_SD, sf_SG = _fp8(rows_SD)
    poison_allocator("cuda")
    got = reduce_sum_home(y_PD, pos_TK, weights_TK, q_SD, home_TW, rank=rank, sf_SG=sf_SG, staged=staged)
    want = reference.reduce_sum_home(y_PD, pos_TK, weights_TK, q_SD, home_TW, rank=rank, sf_SG=sf_SG)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
def test_no_tokens_returns_without_a_host_sync():
    y_PD, pos_TK, weights_TK, rows_SD, home_TW = _inputs(6, 2, 8, 64, 2, 0, torch.bfloat16, 0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = reduce_sum_home(y_PD, pos_TK[:0], weights_TK[:0], rows_SD, home_TW[:0], rank=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.shape == (0, 64) and got.dtype == torch.bfloat16 and got.is_cuda


def test_bad_input_names_the_argument():
    y_PD, pos_TK, weights_TK, rows_SD, home_TW = _inputs(4, 2, 8, 64, 2, 0, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="^rank: expected a column of home_TW's 2, got 2"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank=2)
    with pytest.raises(ValueError, match=r"^rows_SD: expected shape \('\*', 64\)"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD[:, :32], home_TW, rank=0)
    with pytest.raises(ValueError, match=r"^home_TW: expected shape \(4, '\*'\)"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW[:3], rank=0)
    with pytest.raises(TypeError, match="^home_TW: expected dtype"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW.float(), rank=0)
    with pytest.raises(TypeError, match="^y_PD: expected dtype"):
        reference.reduce_sum_home(y_PD.to(torch.float8_e4m3fn), pos_TK, weights_TK, rows_SD, home_TW, rank=0)
    with pytest.raises(TypeError, match="^rows_SD: expected dtype"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD.int(), home_TW, rank=0)
    q_SD, sf_SG = _fp8(rows_SD)
    with pytest.raises(TypeError, match="^sf_SG: expected a torch.Tensor, got NoneType"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, q_SD, home_TW, rank=0)
    with pytest.raises(ValueError, match="^sf_SG: expected None with torch.bfloat16 rows_SD"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank=0, sf_SG=sf_SG)
    with pytest.raises(ValueError, match=r"^sf_SG: expected shape \(8, 1\)"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, q_SD, home_TW, rank=0, sf_SG=sf_SG[:4])
    beyond = home_TW.clone()
    beyond[0, 1] = rows_SD.shape[0]  # a returned row past the region
    with pytest.raises(ValueError, match=r"^home_TW: expected entries in -1 or \[0, 8\)"):
        reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, beyond, rank=0)


def test_compiles_for_sm90a():
    """DeepSeek-V3's home side for 2 and 8 ranks, and the tiny model's; chained, one store."""
    with lowering.compile_only():
        for spec in [(7168, 8, "bfloat16", "bfloat16", 2), (7168, 8, "bfloat16", "bfloat16", 8),
                     (64, 2, "float32", "float32", 2)]:
            source = lowering.kernel_source(get_reduce_sum_home_kernel(*spec))
            assert "__fmul_rn" in source and lowering.waits_first(source), spec
        # FP8 rows home: dequantized in the sum
        source = lowering.kernel_source(get_reduce_sum_home_kernel(7168, 8, "bfloat16", "bfloat16", 2, "float8_e4m3fn"))
        assert "fp8_e4" in source and lowering.waits_first(source)
        # the own rows staged in shared memory, plain and signalled
        for signalled in (False, True):
            source = lowering.kernel_source(get_reduce_sum_home_kernel(7168, 8, "bfloat16", "bfloat16", 2,
                                                                       signalled=signalled, staged=None))
            assert "cp_async_wait<0>" in source and lowering.waits_first(source), signalled
