"""plan_send / put_routes / plan_receive: the references against a plain loop over tokens and
rows (put_routes: every byte of every heap), and the TileLang kernels against the references (same
values, same bytes) on fresh random routes; sm_90a compile."""

import os
import subprocess
import sys

import pytest
import torch

from kernels import lowering
from kernels.comm import RouteRegions, reference
from kernels.comm.plan_kernel import (ROUTES_MESSAGE, get_plan_receive_kernel, get_put_routes_kernel, plan_receive,
                                      put_routes)
from kernels.testing import peer_heaps, send_routes


def _heaps(world: int, t_max: int, k: int, *, device: str = "cpu", seed: int = 0):
    """``world`` heaps of random bytes holding meta [W * T_max, 2K] and counts [W, 1] int32; their regions."""
    heaps, (meta, counts) = peer_heaps(world, [((world * t_max, 2 * k), torch.int32), ((world, 1), torch.int32)],
                                       device=device, seed=seed)
    return heaps, RouteRegions(meta=meta, counts=counts)


def test_send_plan_matches_a_loop(seed):
    world, e_local, me, t_max = 3, 2, 1, 20
    idx, w = send_routes(17, 3, world, e_local, seed=seed)
    plan = reference.plan_send(idx, w, num_local_experts=e_local, world=world, rank=me, max_tokens=t_max)
    for t in range(17):
        ranks = {int(e) // e_local for e in idx[t] if 0 <= e < world * e_local}
        for r in range(world):
            want = (me * t_max + t, r * t_max + t) if r in ranks else (-1, -1)
            assert (int(plan.dest_TW[t, r]), int(plan.home_TW[t, r])) == want
    assert torch.equal(plan.meta_TM[:, :3], idx) and torch.equal(plan.meta_TM[:, 3:].view(torch.float32), w)


def test_send_plan_rejects_more_tokens_than_the_rows():
    idx, w = send_routes(6, 2, 2, 3)
    with pytest.raises(ValueError, match="^topk_idx_TK: expected at most max_tokens=5 tokens, got 6"):
        reference.plan_send(idx, w, num_local_experts=3, world=2, rank=0, max_tokens=5)


def test_put_routes_places_every_route(seed):
    """Every byte of both regions on every rank: every token's routes to every rank at its fixed
    row, the count T at row ``rank``, nothing else touched; the way there and back is plan_send's."""
    t, world, e_local, k, t_max, me = 9, 3, 4, 3, 11, 1
    idx, weights = send_routes(t, k, world, e_local, seed=seed)
    _, regions = _heaps(world, t_max, k, seed=seed)
    _, want = _heaps(world, t_max, k, seed=seed)  # the same bytes, filled by hand
    dest_TW, home_TW = reference.put_routes(idx, weights, regions, num_local_experts=e_local, rank=me)
    plan = reference.plan_send(idx, weights, num_local_experts=e_local, world=world, rank=me, max_tokens=t_max)
    assert torch.equal(dest_TW, plan.dest_TW) and torch.equal(home_TW, plan.home_TW)
    for w in range(world):
        for i in range(t):
            want.meta.views[w][me * t_max + i] = torch.cat([idx[i], weights[i].view(torch.int32)])
        want.counts.views[w][me, 0] = t
        for name in ("meta", "counts"):
            assert torch.equal(getattr(regions, name).views[w], getattr(want, name).views[w]), (name, w)


@pytest.mark.parametrize("second", [4, 0])
def test_a_receiver_sees_only_the_last_call(second, seed):
    """Two calls into the same regions, the second with fewer tokens (or none) and other routes: what
    the receiver plans from is the second call alone (rows the first wrote, past the second's T or
    not sent to this rank, are not its rows)."""
    world, e_local, k, t_max, me = 2, 4, 3, 9, 0
    _, regions = _heaps(world, t_max, k, seed=seed)
    reference.put_routes(*send_routes(t_max, k, world, e_local, seed=seed), regions, num_local_experts=e_local, rank=me)
    idx, weights = send_routes(second, k, world, e_local, seed=seed + 1)
    reference.put_routes(idx, weights, regions, num_local_experts=e_local, rank=me)
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


def test_put_routes_errors_name_the_argument():
    _, regions = _heaps(2, 3, 2)
    idx, weights = send_routes(3, 2, 2, 3)
    with pytest.raises(ValueError, match="^rank: expected 0 <= rank < 2"):
        reference.put_routes(idx, weights, regions, num_local_experts=3, rank=2)
    with pytest.raises(ValueError, match="^topk_idx_TK: expected at most max_tokens=3 tokens, got 4"):
        reference.put_routes(*send_routes(4, 2, 2, 3), regions, num_local_experts=3, rank=0)


def test_receive_plan_matches_a_loop(seed):
    world, e_local, me, t_max, k = 3, 2, 2, 5, 3
    idx, w = send_routes(world * t_max, k, world, e_local, seed=seed)
    idx[0], idx[1] = torch.tensor([0, 1, -1]), torch.tensor([4, -1, 0])  # row 0 sent, but with no route here
    meta = torch.cat([idx, w.view(torch.int32)], 1)
    count = torch.tensor([5, 0, 3], dtype=torch.int32)
    plan = reference.plan_receive(meta, count, num_local_experts=e_local, rank=me, max_tokens=t_max)
    for r in range(world * t_max):
        src, i = divmod(r, t_max)
        valid = i < count[src]
        mine = [valid and me * e_local <= idx[r, j] < (me + 1) * e_local for j in range(k)]
        for j in range(k):
            assert int(plan.local_idx_RK[r, j]) == (int(idx[r, j]) - me * e_local if mine[j] else -1)
            assert float(plan.weights_RK[r, j]) == (float(w[r, j]) if mine[j] else 0.0)
        assert plan.back_RW[r].tolist() == [me * t_max + i if any(mine) and c == src else -1 for c in range(world)]
    assert plan.back_RW[0].tolist() == [-1] * world and plan.back_RW[1].tolist() == [me * t_max + 1, -1, -1]


def test_send_plan_takes_the_routers_int64_ids(seed):
    idx, w = send_routes(40, 4, 3, 5, seed=seed)
    args = dict(num_local_experts=5, world=3, rank=2, max_tokens=50)
    want, got = reference.plan_send(idx, w, **args), reference.plan_send(idx.long(), w, **args)
    for name in ("dest_TW", "home_TW", "meta_TM"):
        assert getattr(got, name).dtype == torch.int32 and torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("bad,match", [(15, r"entries in -1 or \[0, 15\), got values in \[-1, 15\]"),
                                       (-2, r"entries in -1 or \[0, 15\), got values in \[-2, "),
                                       (2**32 + 3, r"entries in -1 or \[0, 15\), got values in \[-1, 4294967299\]"),
                                       ("repeat", r"distinct experts per token, token 3 has")])
def test_send_plan_rejects_bad_routes(bad, match):
    """An expert past the last (in int32 or past it), below -1, or twice for one token: an error
    naming the routes, where the ids would otherwise go nowhere or overflow a receiver's buffer."""
    idx, w = send_routes(6, 4, 3, 5)
    idx = idx.long()
    idx[3] = torch.tensor([2, 7, 2, -1]) if bad == "repeat" else torch.tensor([bad, 1, 2, -1])
    with pytest.raises(ValueError, match="^topk_idx_TK: expected " + match):
        reference.plan_send(idx, w, num_local_experts=5, world=3, rank=0, max_tokens=6)


BAD_ROUTES_SCRIPT = """
import sys, torch
from kernels.comm import RouteRegions, TokenRegions, put_routes, put_tokens_and_routes
from kernels.testing import peer_heaps, send_routes
kernel, bad, token = sys.argv[1], sys.argv[2], int(sys.argv[3])
idx, w = send_routes(300, 4, 2, 5, device="cuda")
idx[token] = torch.tensor([1, 3, 1, -1] if bad == "repeat" else [int(bad), 0, -1, 2])
_, (q, sf, meta, counts) = peer_heaps(2, [((600, 256), torch.uint8), ((600, 2), torch.float32),
                                          ((600, 8), torch.int32), ((2, 1), torch.int32)], device="cuda")
routes = RouteRegions(meta=meta, counts=counts)
if kernel == "put_routes":
    put_routes(idx, w, routes, num_local_experts=5, rank=0)
else:
    x = torch.randn(300, 256, dtype=torch.bfloat16, device="cuda")
    put_tokens_and_routes(x, idx, w, TokenRegions(q=q, sf=sf), routes, num_local_experts=5, rank=0)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["put_routes", "put_tokens_and_routes"])
@pytest.mark.parametrize("bad,token", [("10", 0), ("-2", 299), ("repeat", 257), ("9", 5)])
def test_kernels_stop_on_bad_routes(kernel, bad, token):
    """The kernels' device-side check of the routes: the process stops at its next sync with the
    routes' message (a fresh process each: a device-side assert leaves the CUDA context unusable).
    "9" is a valid id (the last expert): that run must succeed."""
    run = subprocess.run([sys.executable, "-c", BAD_ROUTES_SCRIPT, kernel, bad, str(token)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "EP_KERNELS": "tilelang"})
    if bad == "9":
        assert run.returncode == 0, run.stderr[-2000:]
    else:
        assert run.returncode != 0 and "device-side assert" in run.stderr, run.stderr[-2000:]
        assert ROUTES_MESSAGE in run.stdout + run.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("t,k,world,e_local", [(0, 8, 2, 128), (1, 8, 2, 4), (4096, 8, 2, 128), (5000, 8, 8, 32),
                                               (300, 4, 3, 5), (2049, 6, 1, 16), (1024, 8, 8, 32), (1025, 8, 2, 128),
                                               (300, 3, 3, 5)])  # odd K: 8-byte route vectors
def test_kernels_match_reference(t, k, world, e_local, index_dtype, seed):
    me, t_max = world - 1, max(t, 1) + 3
    idx, w = send_routes(t, k, world, e_local, seed=seed, device="cuda")
    got_heaps, got_regions = _heaps(world, t_max, k, device="cuda", seed=seed)
    want_heaps, want_regions = _heaps(world, t_max, k, device="cuda", seed=seed)
    got = put_routes(idx.to(index_dtype), w, got_regions, num_local_experts=e_local, rank=me)
    want = reference.put_routes(idx, w, want_regions, num_local_experts=e_local, rank=me)
    assert all(torch.equal(g, h) for g, h in zip(got, want))
    torch.cuda.synchronize()
    for r in range(world):
        assert torch.equal(got_heaps[r], want_heaps[r]), r
    meta = torch.randint(-3, world * e_local + 2, (world * t_max, 2 * k), dtype=torch.int32, device="cuda")
    count = torch.randint(0, t_max + 1, (world,), dtype=torch.int32, device="cuda")
    got = plan_receive(meta, count, num_local_experts=e_local, rank=me, max_tokens=t_max)
    want = reference.plan_receive(meta, count, num_local_experts=e_local, rank=me, max_tokens=t_max)
    assert torch.equal(got.local_idx_RK, want.local_idx_RK) and torch.equal(got.back_RW, want.back_RW)
    assert torch.equal(got.weights_RK.view(torch.int32), want.weights_RK.view(torch.int32))


@pytest.mark.gpu
def test_put_routes_kernel_errors_name_the_argument():
    idx, weights = send_routes(4, 2, 2, 3, device="cuda")
    _, regions = _heaps(2, 4, 2, device="cuda")
    with pytest.raises(ValueError, match="^topk_weights_TK: expected"):
        put_routes(idx, weights[:, :1], regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match=r"^regions.meta.views\[0\]: expected"):
        put_routes(idx[:, :1], weights[:, :1], regions, num_local_experts=3, rank=0)
    with pytest.raises(ValueError, match="^rank: expected 0 <= rank < 2"):
        put_routes(idx, weights, regions, num_local_experts=3, rank=2)
    _, small = _heaps(2, 3, 2, device="cuda")
    with pytest.raises(ValueError, match="^topk_idx_TK: expected at most max_tokens=3 tokens, got 4"):
        put_routes(idx, weights, small, num_local_experts=3, rank=0)
    wide_idx, wide_weights = send_routes(4, 17, 2, 9, device="cuda")
    _, wide = _heaps(2, 4, 17, device="cuda")
    with pytest.raises(ValueError, match="^topk_idx_TK: expected at most 16 routes a token"):
        put_routes(wide_idx, wide_weights, wide, num_local_experts=9, rank=0)


def _chained(name: str, kernel) -> bool:
    """The kernel is there, and waits for the one before it (kernels.pdl) before anything else."""
    source = lowering.kernel_source(kernel)
    return name in source and lowering.waits_first(source)


def test_compiles_for_sm90a():
    """2 and 8 ranks, top-8 (DeepSeek-V3); the tiny model's 2 ranks, top-2; top-3 (8-byte route
    vectors); the router's int32 and int64 ids."""
    with lowering.compile_only():
        for world, k in ((2, 8), (8, 8), (2, 2), (3, 3)):
            for index_dtype in ("int32", "int64"):
                source = lowering.kernel_source(get_put_routes_kernel(world, k, index_dtype))
                assert lowering.waits_first(source) and "device_assert_with_msg" in source, (world, k)
            assert _chained("plan_receive_kernel", get_plan_receive_kernel(world, k))
