"""put_tokens (dispatch's FP8 cast and rows stored into the peers' regions in one pass), alone and
with put_routes' stores in the same launch (a small batch's send): the reference against per-token
casts placed by hand, the TileLang kernel against the reference byte for
byte over whole heaps (on one GPU: each "rank" is one allocation holding both regions at the same
offsets, reached through its address offset as a symmetric heap's are), its argument errors and its
sm_90a compile."""

import pytest
import torch

from kernels import lowering
from kernels.comm import RouteRegions, TokenRegions, reference
from kernels.comm.put_tokens_kernel import get_put_tokens_kernel, put_tokens, put_tokens_and_routes
from kernels.quant.reference import per_token_cast
from kernels.testing import cast_input, peer_heaps, send_routes


def _heaps(world: int, rows: int, d: int, group: int = 128, *, device: str, seed: int):
    """``world`` heaps of random bytes holding q [rows, D] uint8 and sf [rows, ceil(D / group)]
    float32; their regions."""
    heaps, (q, sf) = peer_heaps(world, [((rows, d), torch.uint8), ((rows, -(-d // group)), torch.float32)],
                                device=device, seed=seed)
    return heaps, TokenRegions(q=q, sf=sf)


def test_reference_places_each_cast_row(seed):
    """Every byte of every heap: the cast rows (and scales) where their tokens go; nothing else touched."""
    t, d, world, e_local, k, t_max, me = 9, 300, 3, 4, 3, 11, 1
    x_TD = cast_input(t, d, dtype=torch.bfloat16, seed=seed)
    idx, _ = send_routes(t, k, world, e_local, seed=seed)
    _, regions = _heaps(world, world * t_max, d, device="cpu", seed=seed)
    _, want = _heaps(world, world * t_max, d, device="cpu", seed=seed)  # the same bytes, filled by hand
    reference.put_tokens(x_TD, idx, regions, num_local_experts=e_local, rank=me)
    placed = 0
    for i in range(t):
        q, sf = per_token_cast(x_TD[i:i + 1])
        for w in {int(e) // e_local for e in idx[i] if 0 <= e < world * e_local}:
            want.q.views[w][me * t_max + i], want.sf.views[w][me * t_max + i] = q[0].view(torch.uint8), sf[0]
            placed += 1
    assert 0 < placed < t * world
    for name in ("q", "sf"):
        for w in range(world):
            assert torch.equal(getattr(regions, name).views[w], getattr(want, name).views[w]), (name, w)


def test_bad_rank_or_too_many_tokens_are_errors():
    _, regions = _heaps(2, 6, 128, device="cpu", seed=0)
    idx, _ = send_routes(3, 2, 2, 3)
    with pytest.raises(ValueError, match="^rank: expected 0 <= rank < 2"):
        reference.put_tokens(torch.randn(3, 128), idx, regions, num_local_experts=3, rank=2)
    with pytest.raises(ValueError, match="^topk_idx_TK: expected at most max_tokens=3 tokens, got 4"):
        reference.put_tokens(torch.randn(4, 128), send_routes(4, 2, 2, 3)[0], regions, num_local_experts=3, rank=0)


CASES = [  # (tokens, hidden, dtype, world, top-k, E_local): dispatch at DeepSeek-V3's and tiny shapes
    (300, 7168, torch.bfloat16, 2, 8, 128),
    (257, 7168, torch.bfloat16, 8, 8, 32),
    (33, 300, torch.float16, 3, 6, 5),
    (40, 64, torch.float32, 2, 2, 4),
    (0, 7168, torch.bfloat16, 2, 8, 128),
]
GROUPS = [128, 8]  # 8: a scale group narrower than a 16-byte vector of e4m3


@pytest.mark.gpu
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("t,d,dtype,world,k,e_local", CASES)
def test_kernel_matches_reference_byte_for_byte(t, d, dtype, world, k, e_local, index_dtype, group, seed):
    t_max, me = max(t, 1) + (5 if t % 2 else 0), world - 1  # even T fill their block: rows up to W * T_max
    x_TD = cast_input(t, d, dtype=dtype, seed=seed, device="cuda")
    idx, _ = send_routes(t, k, world, e_local, seed=seed, device="cuda")
    got, got_regions = _heaps(world, world * t_max, d, group, device="cuda", seed=seed)
    want, want_regions = _heaps(world, world * t_max, d, group, device="cuda", seed=seed)
    put_tokens(x_TD, idx.to(index_dtype), got_regions, num_local_experts=e_local, rank=me, group=group)
    reference.put_tokens(x_TD, idx, want_regions, num_local_experts=e_local, rank=me, group=group)
    torch.cuda.synchronize()
    for w in range(world):
        assert torch.equal(got[w], want[w]), w


def _heaps_with_routes(world: int, rows: int, d: int, k: int, *, device: str, seed: int):
    """A heap a rank of random bytes holding the tokens' regions and the routes' (meta [rows, 2K],
    counts [W, 1] int32), at the same offsets in every heap."""
    heaps, (q, sf, meta, counts) = peer_heaps(world, [((rows, d), torch.uint8), ((rows, -(-d // 128)), torch.float32),
                                                      ((rows, 2 * k), torch.int32), ((world, 1), torch.int32)],
                                              device=device, seed=seed)
    return heaps, TokenRegions(q=q, sf=sf), RouteRegions(meta=meta, counts=counts)


@pytest.mark.gpu
@pytest.mark.parametrize("t,d,dtype,world,k,e_local", CASES)
def test_tokens_and_routes_in_one_launch_match_the_two_references(t, d, dtype, world, k, e_local, seed):
    """The small batch's send: ``put_routes`` and ``put_tokens`` in one kernel, the same bytes in
    every heap and the same way there and back (no tokens: only the counts go)."""
    t_max, me = max(t, 1) + (5 if t % 2 else 0), world - 1
    x_TD = cast_input(t, d, dtype=dtype, seed=seed, device="cuda")
    idx, weights = send_routes(t, k, world, e_local, seed=seed, device="cuda")
    got, got_tokens, got_routes = _heaps_with_routes(world, world * t_max, d, k, device="cuda", seed=seed)
    want, want_tokens, want_routes = _heaps_with_routes(world, world * t_max, d, k, device="cuda", seed=seed)
    got_way = put_tokens_and_routes(x_TD, idx, weights, got_tokens, got_routes, num_local_experts=e_local, rank=me)
    want_way = reference.put_tokens_and_routes(x_TD, idx, weights, want_tokens, want_routes,
                                               num_local_experts=e_local, rank=me)
    torch.cuda.synchronize()
    for w in range(world):
        assert torch.equal(got[w], want[w]), w
    for name, a, b in zip(("dest_TW", "home_TW"), got_way, want_way):
        assert a.dtype == torch.int32 and torch.equal(a, b), name


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    idx, _ = send_routes(4, 2, 2, 3, device="cuda")
    _, regions = _heaps(2, 8, 256, device="cuda", seed=0)
    x_TD = torch.randn(4, 256, device="cuda")
    with pytest.raises(ValueError, match="^topk_idx_TK: expected"):
        put_tokens(x_TD, idx[:3], regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match=r"^regions.q.views\[0\]: expected"):
        put_tokens(x_TD[:, :128], idx, regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match="^group: expected"):
        put_tokens(x_TD, idx, regions, num_local_experts=3, rank=0, group=96)
    with pytest.raises(ValueError, match="^rank: expected 0 <= rank < 2"):
        put_tokens(x_TD, idx, regions, num_local_experts=3, rank=2)
    _, small = _heaps(2, 6, 256, device="cuda", seed=0)
    with pytest.raises(ValueError, match="^x_TD: expected at most T_max = 3 tokens"):
        put_tokens(x_TD, idx, small, num_local_experts=3, rank=0)


def test_compiles_for_sm90a():
    """Dispatch's rows at DeepSeek-V3's shape (bf16 tokens, top-8) for 2 and 8 ranks with the
    router's int64 ids, the tiny model's (float32 tokens of 64, top-2), and scale groups of 8."""
    with lowering.compile_only():
        for spec in [(7168, "bfloat16", 128, 2, 8, "int64"), (7168, "bfloat16", 128, 8, 8, "int64"),
                     (64, "float32", 128, 2, 2, "int32"), (7168, "bfloat16", 8, 2, 8, "int32")]:
            source = lowering.kernel_source(get_put_tokens_kernel(*spec))
            assert "q_CE" in source and lowering.waits_first(source), spec
        for spec in [(7168, "bfloat16", 128, 2, 8, "int64"), (64, "float32", 128, 2, 2, "int32")]:  # with routes
            source = lowering.kernel_source(get_put_tokens_kernel(*spec, routes=True))
            assert "meta_F" in source and "counts_F" in source and lowering.waits_first(source), spec
            assert "device_assert_with_msg" in source, spec  # put_routes' check of the routes
