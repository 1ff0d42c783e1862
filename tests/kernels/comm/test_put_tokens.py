"""put_tokens (dispatch's planning, FP8 cast, rows, metadata and counts stored into the peers'
regions in one pass): the reference against per-token casts placed by hand, the TileLang kernel against the
reference byte for byte over whole heaps (on one GPU: each "rank" is one allocation holding the four
regions at the same offsets, reached through its address offset as a symmetric heap's are), its
argument errors and its sm_90a compile."""

import pytest
import torch

from kernels import lowering
from kernels.comm import PeerRegion, TokenRegions, reference
from kernels.comm.put_tokens_kernel import get_put_tokens_kernel, put_tokens
from kernels.quant.reference import per_token_cast
from kernels.testing import cast_input, random_bits, send_routes

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


def test_reference_places_each_cast_row(seed):
    """Every byte of every heap: the cast rows where their tokens go, every token's routes to every
    rank, the count T; nothing else touched."""
    t, d, world, e_local, k, t_max, me = 9, 300, 3, 4, 3, 11, 1
    x_TD = cast_input(t, d, dtype=torch.bfloat16, seed=seed)
    idx, weights = send_routes(t, k, world, e_local, seed=seed)
    heaps, regions = _heaps(world, world * t_max, d, 2 * k, device="cpu", seed=seed)
    _, want = _heaps(world, world * t_max, d, 2 * k, device="cpu", seed=seed)  # the same bytes, filled by hand
    dest_TW, home_TW = reference.put_tokens(x_TD, idx, weights, regions, num_local_experts=e_local, rank=me)
    for i in range(t):
        q, sf = per_token_cast(x_TD[i:i + 1])
        ranks = {int(e) // e_local for e in idx[i] if 0 <= e < world * e_local}
        row = me * t_max + i
        for w in range(world):
            assert (int(dest_TW[i, w]), int(home_TW[i, w])) == ((row, w * t_max + i) if w in ranks else (-1, -1))
            want.meta.views[w][row] = torch.cat([idx[i], weights[i].view(torch.int32)])
            if w in ranks:
                want.q.views[w][row], want.sf.views[w][row] = q[0].view(torch.uint8), sf[0]
    for w in range(world):
        want.counts.views[w][me, 0] = t
    assert (dest_TW < 0).any() and (dest_TW >= 0).any()
    for name in ("q", "sf", "meta", "counts"):
        for w in range(world):
            assert torch.equal(getattr(regions, name).views[w], getattr(want, name).views[w]), (name, w)


@pytest.mark.parametrize("second", [4, 0])
def test_a_receiver_sees_only_the_last_call(second, seed):
    """Two calls into the same regions, the second with fewer tokens (or none) and other routes: what
    the receiver plans from is the second call alone (rows the first wrote, past the second's T or
    not sent to this rank, are not its rows)."""
    d, world, e_local, k, t_max, me = 256, 2, 4, 3, 9, 0
    _, regions = _heaps(world, world * t_max, d, 2 * k, device="cpu", seed=seed)
    args = dict(num_local_experts=e_local, rank=me)
    reference.put_tokens(cast_input(t_max, d, seed=seed), *send_routes(t_max, k, world, e_local, seed=seed), regions,
                         **args)
    idx, weights = send_routes(second, k, world, e_local, seed=seed + 1)
    reference.put_tokens(cast_input(second, d, seed=seed + 1), idx, weights, regions, **args)
    for w in range(world):
        plan = reference.plan_receive(regions.meta.views[w], regions.counts.views[w][:, 0], num_local_experts=e_local,
                                      rank=w, max_tokens=t_max)
        mine = (idx >= w * e_local) & (idx < (w + 1) * e_local)
        back = torch.full((t_max, world), -1, dtype=torch.int32)
        back[:second, me] = torch.where(mine.any(1), w * t_max + torch.arange(second, dtype=torch.int32), -1)
        block = slice(me * t_max, (me + 1) * t_max)
        assert torch.equal(plan.local_idx_RK[block][:second], torch.where(mine, idx - w * e_local, -1))
        assert (plan.local_idx_RK[block][second:] == -1).all()
        assert torch.equal(plan.back_RW[block], back)


def test_bad_rank_or_too_many_tokens_are_errors():
    _, regions = _heaps(2, 6, 128, 4, device="cpu", seed=0)
    idx, weights = send_routes(3, 2, 2, 3)
    with pytest.raises(ValueError, match="^rank: expected 0 <= rank < 2"):
        reference.put_tokens(torch.randn(3, 128), idx, weights, regions, num_local_experts=3, rank=2)
    with pytest.raises(ValueError, match="^topk_idx_TK: expected at most max_tokens=3 tokens, got 4"):
        reference.put_tokens(torch.randn(4, 128), *send_routes(4, 2, 2, 3), regions, num_local_experts=3, rank=0)


CASES = [  # (tokens, hidden, dtype, world, top-k, E_local): dispatch at DeepSeek-V3's and tiny shapes
    (300, 7168, torch.bfloat16, 2, 8, 128),
    (257, 7168, torch.bfloat16, 8, 8, 32),
    (33, 300, torch.float16, 3, 6, 5),
    (40, 64, torch.float32, 2, 2, 4),
    (0, 7168, torch.bfloat16, 2, 8, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("t,d,dtype,world,k,e_local", CASES)
def test_kernel_matches_reference_byte_for_byte(t, d, dtype, world, k, e_local, index_dtype, seed):
    t_max, me = max(t, 1) + (5 if t % 2 else 0), world - 1  # even T fill their block: rows up to W * T_max
    x_TD = cast_input(t, d, dtype=dtype, seed=seed, device="cuda")
    idx, weights = send_routes(t, k, world, e_local, seed=seed, device="cuda")
    got, got_regions = _heaps(world, world * t_max, d, 2 * k, device="cuda", seed=seed)
    want, want_regions = _heaps(world, world * t_max, d, 2 * k, device="cuda", seed=seed)
    got_plan = put_tokens(x_TD, idx.to(index_dtype), weights, got_regions, num_local_experts=e_local, rank=me)
    want_plan = reference.put_tokens(x_TD, idx, weights, want_regions, num_local_experts=e_local, rank=me)
    torch.cuda.synchronize()
    for w in range(world):
        assert torch.equal(got[w], want[w]), w
    for got_rows, want_rows in zip(got_plan, want_plan):
        assert torch.equal(got_rows, want_rows)


@pytest.mark.gpu
def test_bad_input_names_the_argument():
    idx, weights = send_routes(4, 2, 2, 3, device="cuda")
    _, regions = _heaps(2, 8, 256, 4, device="cuda", seed=0)
    x_TD = torch.randn(4, 256, device="cuda")
    with pytest.raises(ValueError, match="^topk_idx_TK: expected"):
        put_tokens(x_TD, idx[:3], weights, regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match="^topk_weights_TK: expected"):
        put_tokens(x_TD, idx, weights[:, :1], regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match=r"^regions.meta.views\[0\]: expected"):
        put_tokens(x_TD, idx[:, :1], weights[:, :1], regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match=r"^regions.q.views\[0\]: expected"):
        put_tokens(x_TD[:, :128], idx, weights, regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match="^group: expected"):
        put_tokens(x_TD, idx, weights, regions, num_local_experts=3, rank=0, group=96)
    with pytest.raises(ValueError, match="^rank: expected 0 <= rank < 2"):
        put_tokens(x_TD, idx, weights, regions, num_local_experts=3, rank=2)
    _, small = _heaps(2, 6, 256, 4, device="cuda", seed=0)
    with pytest.raises(ValueError, match="^x_TD: expected at most T_max = 3 tokens"):
        put_tokens(x_TD, idx, weights, small, num_local_experts=3, rank=0)


def test_compiles_for_sm90a():
    """Dispatch's send at DeepSeek-V3's shape (bf16 tokens, top-8) for 2 and 8 ranks with the
    router's int64 ids, and the tiny model's (float32 tokens of 64, top-2)."""
    with lowering.compile_only():
        for spec in [(7168, "bfloat16", 128, 2, 8, "int64"), (7168, "bfloat16", 128, 8, 8, "int64"),
                     (64, "float32", 128, 2, 2, "int32")]:
            source = lowering.kernel_source(get_put_tokens_kernel(*spec))
            assert "q_CE" in source and lowering.waits_first(source), spec
