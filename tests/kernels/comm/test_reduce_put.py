"""reduce_put (combine's weighted reduce stored straight into the peers' regions): the reference
against a plain loop, the TileLang kernel against the reference bit for bit (on one GPU: the
"ranks" are separate allocations reached through their address offsets, as in test_put_rows), its
argument errors and its sm_90a compile."""

import pytest
import torch

from kernels import lowering
from kernels.comm import PeerRegion, TokenRegions, reference
from kernels.quant.reference import per_token_cast
from kernels.reduce.reference import weighted_reduce
from kernels.comm.reduce_put_kernel import get_weighted_reduce_put_kernel, reduce_put
from kernels.testing import poison_allocator, random_bits, reduce_routes


def _inputs(r: int, k: int, p: int, d: int, world: int, dtype: torch.dtype, seed: int, device="cpu"):
    """Expert outputs [P, D], routes of R received rows, and one home row each (-1 for some):
    a received row returns to one rank, as in a combine."""
    g = torch.Generator().manual_seed(seed)
    y_PD = torch.randn(p, d, generator=g).to(dtype)
    pos_RK, weights_RK = reduce_routes(r, k, p, seed=seed)
    dest_RW = torch.full((r, world), -1, dtype=torch.int32)
    home = torch.randint(0, world, (r,), generator=g)
    slot = torch.randperm(max(2 * r, 4), generator=g)[:r].to(torch.int32)
    dest_RW[torch.arange(r), home] = torch.where(torch.rand(r, generator=g) < 0.3, -1, slot)
    return [t.to(device) for t in (y_PD, pos_RK, weights_RK, dest_RW)]


@pytest.mark.parametrize("skip", [False, True])
def test_reference_matches_a_loop(skip, seed):
    y_PD, pos_RK, weights_RK, dest_RW = _inputs(12, 3, 20, 5, 3, torch.float32, seed)
    busiest = int(dest_RW.ge(0).sum(0).argmax())  # a rank with rows to leave out
    skip_rank = busiest if skip else -1
    views = tuple(torch.zeros(30, 5) for _ in range(3))
    reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW, PeerRegion(views=views), skip_rank=skip_rank)
    assert (views[busiest] != 0).any() != skip
    want = [torch.zeros(30, 5) for _ in range(3)]
    for r in range(12):
        row = torch.zeros(5)
        for k in range(3):
            if pos_RK[r, k] >= 0:
                row += weights_RK[r, k] * y_PD[pos_RK[r, k]]
        for w in range(3):
            if dest_RW[r, w] >= 0 and w != skip_rank:
                want[w][dest_RW[r, w]] = row
    for got, expected in zip(views, want):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_fp8_reference_is_the_cast_of_the_reduced_rows(seed):
    """Into ``TokenRegions``: the reduced rows (in y's dtype) cast per token, bytes and scales at
    the rows ``dest_RW`` names; a ragged last scale group (D = 160)."""
    y_PD, pos_RK, weights_RK, dest_RW = _inputs(12, 3, 20, 160, 2, torch.bfloat16, seed)
    regions = TokenRegions(q=PeerRegion(views=tuple(torch.zeros(30, 160, dtype=torch.uint8) for _ in range(2))),
                           sf=PeerRegion(views=tuple(torch.zeros(30, 2) for _ in range(2))))
    reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW, regions, skip_rank=1)
    q_RD, sf_RG = per_token_cast(weighted_reduce(y_PD, pos_RK, weights_RK), group=128)
    rows = (dest_RW[:, 0] >= 0).nonzero().squeeze(1)
    assert rows.numel() and torch.equal(regions.q.views[0][dest_RW[rows, 0]], q_RD[rows].view(torch.uint8))
    assert torch.equal(regions.sf.views[0][dest_RW[rows, 0]], sf_RG[rows])
    assert not regions.q.views[1].any() and not regions.sf.views[1].any()  # skip_rank's


CASES = [  # (received rows, K, P, D, dtype, world): combine at DeepSeek-V3 and tiny shapes
    (300, 8, 900, 7168, torch.bfloat16, 2),
    (257, 8, 700, 7168, torch.bfloat16, 8),
    (33, 2, 40, 64, torch.float32, 3),
    (40, 4, 50, 100, torch.float16, 2),
    (0, 8, 16, 7168, torch.bfloat16, 2),
]


# (CTA threads at most, rows staged): bf16 rows home as shipped, and the CTAs that FP8 rows home ship with
BUILDS = [(1024, False), (256, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("max_threads,staged", BUILDS)
@pytest.mark.parametrize("skip_rank", [-1, 1])
@pytest.mark.parametrize("r,k,p,d,dtype,world", CASES)
def test_kernel_matches_reference_bit_for_bit(r, k, p, d, dtype, world, skip_rank, max_threads, staged, seed):
    y_PD, pos_RK, weights_RK, dest_RW = _inputs(r, k, p, d, world, dtype, seed, device="cuda")
    rows = max(2 * r, 4)
    poison_allocator("cuda")
    start = [random_bits(rows, d, dtype=dtype, device="cuda", seed=seed + 1 + w) for w in range(world)]
    got = tuple(t.clone() for t in start)
    delta = torch.tensor([t.data_ptr() - got[0].data_ptr() for t in got], dtype=torch.int64, device="cuda")
    reduce_put(y_PD, pos_RK, weights_RK, dest_RW, PeerRegion(views=got, delta_W=delta), skip_rank=skip_rank,
               max_threads=max_threads, staged=staged)
    want = tuple(t.clone() for t in start)
    reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW, PeerRegion(views=want), skip_rank=skip_rank)
    torch.cuda.synchronize()
    for w in range(world):
        assert torch.equal(got[w].view(torch.uint8), want[w].view(torch.uint8)), w


FP8_CASES = [  # (received rows, K, P, D, dtype, world): 16 / 32 lanes a scale group, a ragged last one
    (300, 8, 900, 7168, torch.bfloat16, 2),
    (257, 8, 700, 7168, torch.bfloat16, 8),
    (33, 4, 40, 160, torch.float32, 3),
    (40, 4, 50, 4096, torch.float16, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("max_threads,staged", BUILDS)
@pytest.mark.parametrize("r,k,p,d,dtype,world", FP8_CASES)
def test_fp8_kernel_matches_reference_bit_for_bit(r, k, p, d, dtype, world, max_threads, staged, seed):
    y_PD, pos_RK, weights_RK, dest_RW = _inputs(r, k, p, d, world, dtype, seed, device="cuda")
    rows, groups = max(2 * r, 4), -(-d // 128)
    poison_allocator("cuda")
    # one buffer a rank holding both regions, as a heap does (one delta_W for both)
    start = [random_bits(rows, d + 4 * groups, dtype=torch.uint8, device="cuda", seed=seed + 1 + w).view(-1)
             for w in range(world)]

    flat = [t.clone() for t in start]
    q_views = tuple(f[:rows * d].view(rows, d) for f in flat)
    sf_views = tuple(f[rows * d:].view(torch.float32).view(rows, groups) for f in flat)
    delta = torch.tensor([b.data_ptr() - flat[0].data_ptr() for b in flat], dtype=torch.int64, device="cuda")
    reduce_put(y_PD, pos_RK, weights_RK, dest_RW, TokenRegions(q=PeerRegion(views=q_views, delta_W=delta),
                                                               sf=PeerRegion(views=sf_views, delta_W=delta)), skip_rank=0,
               max_threads=max_threads, staged=staged)
    want = [t.clone() for t in start]
    reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW,
                         TokenRegions(q=PeerRegion(views=tuple(f[:rows * d].view(rows, d) for f in want)),
                                      sf=PeerRegion(views=tuple(f[rows * d:].view(torch.float32).view(rows, groups)
                                                                for f in want))), skip_rank=0)
    torch.cuda.synchronize()
    for w in range(world):
        assert torch.equal(flat[w], want[w]), w


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    y_PD, pos_RK, weights_RK, dest_RW = _inputs(4, 2, 8, 64, 2, torch.bfloat16, 0, device="cuda")
    views = tuple(torch.zeros(8, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    region = PeerRegion(views=views, delta_W=torch.zeros(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="^region.delta_W: expected"):
        reduce_put(y_PD, pos_RK, weights_RK, dest_RW, PeerRegion(views=views))
    with pytest.raises(ValueError, match="^dest_RW: expected"):
        reduce_put(y_PD, pos_RK, weights_RK, dest_RW[:, :1], region)
    with pytest.raises(ValueError, match="^region.views"):
        reduce_put(y_PD[:, :32], pos_RK, weights_RK, dest_RW, region)
    with pytest.raises(ValueError, match="^max_threads: expected a multiple of 32 from 32 to 1024, got 100"):
        reduce_put(y_PD, pos_RK, weights_RK, dest_RW, region, max_threads=100)
    with pytest.raises(ValueError, match="^skip_rank: expected -1 \\(none\\) or a rank below 2, got 2"):
        reduce_put(y_PD, pos_RK, weights_RK, dest_RW, region, skip_rank=2)


def test_reference_rejects_bad_skip_rank_and_region():
    y_PD, pos_RK, weights_RK, dest_RW = _inputs(4, 2, 8, 16, 2, torch.float32, 0)
    region = PeerRegion(views=tuple(torch.zeros(8, 16) for _ in range(2)))
    for bad in (2, -2, True):
        with pytest.raises(ValueError, match=f"^skip_rank: expected -1 \\(none\\) or a rank below 2, got {bad}"):
            reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW, region, skip_rank=bad)
    with pytest.raises(TypeError, match="^region: expected a PeerRegion"):
        reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW, None, skip_rank=1)
    with pytest.raises(ValueError, match="^dest_RW: expected a 2-D tensor"):
        reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW[:, 0], region, skip_rank=1)


def test_compiles_for_sm90a():
    """Combine's reduce at DeepSeek-V3's shape for 2 and 8 ranks, and the tiny model's."""
    with lowering.compile_only():
        for spec in [(7168, 8, "bfloat16", "bfloat16", 128, False, 2), (7168, 8, "bfloat16", "bfloat16", 128, False, 8),
                     (64, 2, "float32", "float32", 128, False, 2)]:
            source = lowering.kernel_source(get_weighted_reduce_put_kernel(*spec))
            assert "__fmul_rn" in source and lowering.waits_first(source), spec
        for spec in [(7168, 8, "bfloat16", "bfloat16", 128, False, 2, 1024, 128),  # FP8 rows home, 1024 threads
                     (160, 4, "float32", "float32", 128, False, 3, 1024, 128)]:
            source = lowering.kernel_source(get_weighted_reduce_put_kernel(*spec))
            assert "__shfl_xor_sync" in source and lowering.waits_first(source), spec
        for fp8_group in (0, 128):  # 256-thread CTAs staging their rows
            source = lowering.kernel_source(get_weighted_reduce_put_kernel(7168, 8, "bfloat16", "bfloat16", 128, False, 2,
                                                                           256, fp8_group, None))
            assert "cp_async_wait<0>" in source and lowering.waits_first(source), fp8_group
