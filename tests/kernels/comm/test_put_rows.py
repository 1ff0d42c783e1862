"""put_rows: the reference against plain loops, its argument errors, the TileLang kernel against
the reference bit for bit (on one GPU: the "ranks" are separate allocations of one device,
reached through their address offsets as peers' copies are), and its sm_90a compile."""

import pytest
import torch

from kernels import lowering
from kernels.comm import PeerRegion, reference
from kernels.comm.put_rows_kernel import get_kernel_args, get_put_rows_kernel, put_rows
from kernels.testing import poison_allocator, random_bits


def destinations(n: int, world: int, rows: int, seed: int) -> torch.Tensor:
    """[n, world] distinct rows per rank (-1 for about a third), like a dispatch's slots."""
    g = torch.Generator().manual_seed(seed)
    dest = torch.stack([torch.randperm(rows, generator=g)[:n] for _ in range(world)], 1)
    return torch.where(torch.rand(n, world, generator=g) < 0.35, -1, dest).to(torch.int32)


def test_reference_matches_a_loop(seed):
    views = tuple(torch.zeros(20, 5) for _ in range(3))
    src = torch.randn(9, 5)
    dest = destinations(9, 3, 20, seed)
    reference.put_rows(src, dest, PeerRegion(views=views))
    want = [torch.zeros(20, 5) for _ in range(3)]
    for n in range(9):
        for w in range(3):
            if dest[n, w] >= 0:
                want[w][dest[n, w]] = src[n]
    for got, expected in zip(views, want):
        assert torch.equal(got, expected)


def test_argument_errors():
    region = PeerRegion(views=(torch.zeros(4, 3), torch.zeros(4, 3)))
    with pytest.raises(ValueError, match="src_NX: expected rows of the region's width 3"):
        reference.put_rows(torch.zeros(2, 4), torch.zeros(2, 2, dtype=torch.int32), region)
    with pytest.raises(TypeError, match="src_NX: expected dtype torch.float32"):
        reference.put_rows(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32), region)
    with pytest.raises(ValueError, match=r"dest_NW: expected shape \(2, 2\)"):
        reference.put_rows(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int32), region)
    with pytest.raises(TypeError, match="region: expected a PeerRegion"):
        reference.put_rows(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.int32), (torch.zeros(4, 3),))


def test_kernel_needs_peer_offsets():
    with pytest.raises(ValueError, match="region.delta_W"):
        put_rows(torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int32), PeerRegion(views=(torch.zeros(4, 3),)))


CASES = [  # (rows, width, dtype, world): dispatch's payloads at DeepSeek-V3 and tiny shapes
    (300, 7168, torch.uint8, 2),  # FP8 tokens
    (300, 56, torch.float32, 4),  # their scales
    (300, 16, torch.int32, 8),  # routes and weights, top-8
    (8, 1, torch.int32, 8),  # counts
    (257, 7168, torch.bfloat16, 2),
    (33, 160, torch.float32, 3),
    (0, 64, torch.bfloat16, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n,width,dtype,world", CASES)
def test_kernel_matches_reference_bit_for_bit(n, width, dtype, world, seed):
    rows = max(2 * n, 4)
    src = random_bits(n, width, dtype=dtype, device="cuda", seed=seed)
    dest = destinations(n, world, rows, seed).cuda()
    poison_allocator("cuda")
    start = [random_bits(rows, width, dtype=dtype, device="cuda", seed=seed + 1 + w) for w in range(world)]
    got = tuple(t.clone() for t in start)
    delta = torch.tensor([t.data_ptr() - got[0].data_ptr() for t in got], dtype=torch.int64, device="cuda")
    put_rows(src, dest, PeerRegion(views=got, delta_W=delta))
    want = tuple(t.clone() for t in start)
    reference.put_rows(src, dest, PeerRegion(views=want))
    torch.cuda.synchronize()
    for w in range(world):
        assert torch.equal(got[w].view(torch.uint8), want[w].view(torch.uint8)), w


@pytest.mark.gpu
def test_kernel_calls_of_one_signature_take_their_own_rows_and_regions(seed):
    """The launch is prepared once per signature (kernels.validate.per_signature): later calls of
    the same shapes, into the same region or another, still store their own rows."""
    n, width, world, rows = 40, 96, 2, 80
    regions = []
    for _ in range(2):
        got = tuple(torch.zeros(rows, width, dtype=torch.bfloat16, device="cuda") for _ in range(world))
        delta = torch.tensor([t.data_ptr() - got[0].data_ptr() for t in got], dtype=torch.int64, device="cuda")
        regions.append(PeerRegion(views=got, delta_W=delta))
    for call, region in enumerate((regions[0], regions[0], regions[1])):
        src = random_bits(n, width, dtype=torch.bfloat16, device="cuda", seed=seed + call)
        dest = destinations(n, world, rows, seed + call).cuda()
        want = tuple(t.clone() for t in region.views)
        put_rows(src, dest, region)
        reference.put_rows(src, dest, PeerRegion(views=want))
        for w in range(world):
            assert torch.equal(region.views[w].view(torch.uint8), want[w].view(torch.uint8)), (call, w)
    with pytest.raises(TypeError, match="src_NX: expected dtype torch.bfloat16"):
        put_rows(src.float(), dest, regions[1])  # after good calls, a bad one still raises


def test_compiles_for_sm90a():
    """Dispatch's payloads for 2, 4 and 8 ranks: FP8 rows of hidden 7168, bf16 rows, scales,
    routes, counts."""
    with lowering.compile_only():
        for row_bytes, world in ((7168, 2), (7168 * 2, 2), (56 * 4, 4), (16 * 4, 8), (4, 8)):
            args = get_kernel_args(row_bytes, world)
            source = lowering.kernel_source(get_put_rows_kernel(*args))
            assert "put_rows_kernel" in source and lowering.waits_first(source), args
