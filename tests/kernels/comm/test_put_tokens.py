"""put_tokens (dispatch's FP8 cast, rows, metadata and counts stored into the peers' regions in one
pass): the reference against per-token casts placed by hand, the TileLang kernel against the
reference byte for byte over whole heaps (on one GPU: each "rank" is one allocation holding the four
regions at the same offsets, reached through its address offset as a symmetric heap's are), its
argument errors and its sm_90a compile."""

import pytest
import torch

from kernels import lowering
from kernels.comm import PeerRegion, TokenRegions, reference
from kernels.comm.put_tokens_kernel import get_put_tokens_kernel, put_tokens
from kernels.quant.reference import per_token_cast
from kernels.testing import cast_input, random_bits

ALIGN = 256


def _heaps(world: int, rows: int, d: int, x: int, *, device: str, seed: int):
    """``world`` heaps of random bytes, each holding q [rows, D] uint8, sf [rows, G] float32, meta
    [rows, X] int32 and counts [W, 1] int32 at the same offsets; the TokenRegions over them."""
    g = -(-d // 128)
    shapes = [((rows, d), torch.uint8), ((rows, g), torch.float32), ((rows, x), torch.int32), ((world, 1), torch.int32)]
    offsets, size = [], 0
    for (r, c), dtype in shapes:
        offsets.append(size)
        size += -(-r * c * dtype.itemsize // ALIGN) * ALIGN
    heaps = [random_bits(1, size, dtype=torch.uint8, device=device, seed=seed + w).view(-1) for w in range(world)]
    delta = None
    if device == "cuda":
        delta = torch.tensor([h.data_ptr() - heaps[0].data_ptr() for h in heaps], dtype=torch.int64, device=device)
    regions = [PeerRegion(views=tuple(h[o:o + r * c * dt.itemsize].view(dt).view(r, c) for h in heaps), delta_W=delta)
               for ((r, c), dt), o in zip(shapes, offsets)]
    return heaps, TokenRegions(*regions)


def _sends(t: int, world: int, rows: int, x: int, seed: int):
    """Destination rows (distinct per rank, about a third -1), metadata rows and counts."""
    g = torch.Generator().manual_seed(seed)
    dest = torch.stack([torch.randperm(rows, generator=g)[:t] for _ in range(world)], 1) if t else torch.empty(0, world)
    dest_TW = torch.where(torch.rand(t, world, generator=g) < 0.35, -1, dest).to(torch.int32)
    meta_TX = torch.randint(-2**31, 2**31 - 1, (t, x), generator=g, dtype=torch.int64).to(torch.int32)
    return dest_TW, meta_TX, (dest_TW >= 0).sum(0, dtype=torch.int32)


def test_reference_places_each_cast_row(seed):
    t, d, world, rows, x = 9, 300, 3, 20, 4
    x_TD = cast_input(t, d, dtype=torch.bfloat16, seed=seed)
    dest_TW, meta_TX, count_W = _sends(t, world, rows, x, seed)
    _, regions = _heaps(world, rows, d, x, device="cpu", seed=seed)
    reference.put_tokens(x_TD, dest_TW, meta_TX, count_W, regions, rank=1)
    for i in range(t):
        q, sf = per_token_cast(x_TD[i:i + 1])
        for w in range(world):
            row = int(dest_TW[i, w])
            if row >= 0:
                assert torch.equal(regions.q.views[w][row], q[0].view(torch.uint8))
                assert torch.equal(regions.sf.views[w][row], sf[0])
                assert torch.equal(regions.meta.views[w][row], meta_TX[i])
    for w in range(world):
        assert int(regions.counts.views[w][1, 0]) == int(count_W[w])


CASES = [  # (tokens, hidden, dtype, world, metadata words): dispatch at DeepSeek-V3's and tiny shapes
    (300, 7168, torch.bfloat16, 2, 16),
    (257, 7168, torch.bfloat16, 8, 16),
    (33, 300, torch.float16, 3, 12),
    (40, 64, torch.float32, 2, 4),
    (0, 7168, torch.bfloat16, 2, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t,d,dtype,world,x", CASES)
def test_kernel_matches_reference_byte_for_byte(t, d, dtype, world, x, seed):
    rows = max(2 * t, 4)
    x_TD = cast_input(t, d, dtype=dtype, seed=seed, device="cuda")
    dest_TW, meta_TX, count_W = (a.cuda() for a in _sends(t, world, rows, x, seed))
    got, got_regions = _heaps(world, rows, d, x, device="cuda", seed=seed)
    want, want_regions = _heaps(world, rows, d, x, device="cuda", seed=seed)
    put_tokens(x_TD, dest_TW, meta_TX, count_W, got_regions, rank=world - 1)
    reference.put_tokens(x_TD, dest_TW, meta_TX, count_W, want_regions, rank=world - 1)
    torch.cuda.synchronize()
    for w in range(world):
        assert torch.equal(got[w], want[w]), w


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    dest_TW, meta_TX, count_W = (a.cuda() for a in _sends(4, 2, 8, 4, 0))
    _, regions = _heaps(2, 8, 256, 4, device="cuda", seed=0)
    x_TD = torch.randn(4, 256, device="cuda")
    with pytest.raises(ValueError, match="^dest_TW: expected"):
        put_tokens(x_TD, dest_TW[:, :1], meta_TX, count_W, regions, rank=0)
    with pytest.raises(ValueError, match="^meta_TX: expected"):
        put_tokens(x_TD, dest_TW, meta_TX[:3], count_W, regions, rank=0)
    with pytest.raises(ValueError, match=r"^regions.q.views\[0\]: expected"):
        put_tokens(x_TD[:, :128], dest_TW, meta_TX, count_W, regions, rank=0)
    with pytest.raises(ValueError, match="^group: expected"):
        put_tokens(x_TD, dest_TW, meta_TX, count_W, regions, rank=0, group=96)


def test_compiles_for_sm90a():
    """Dispatch's send at DeepSeek-V3's shape (bf16 tokens, top-8: 16 metadata words) for 2 and 8
    ranks, and the tiny model's (float32 tokens of 64, top-2)."""
    with lowering.compile_only():
        for spec in [(7168, "bfloat16", 128, 2, 16), (7168, "bfloat16", 128, 8, 16), (64, "float32", 128, 2, 4)]:
            source = lowering.kernel_source(get_put_tokens_kernel(*spec))
            assert "q_CE" in source and lowering.waits_first(source), spec
