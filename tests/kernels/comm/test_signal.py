"""The split barrier (``kernels.comm.Signal``) that combine's kernels arrive on and wait on: on one
GPU, "ranks" whose heaps are separate allocations reached through their address offsets (as in
test_reduce_put), each rank's reduce_put arriving (its last CTA storing the epoch into every peer's
flag) and its reduce_sum_home waiting, with the same bits as the kernels without a signal; the
one-CTA arrive and wait; sm_90a compile, the wait before the returned rows' loads."""

import re

import pytest
import torch

from kernels import lowering
from kernels.comm import PeerRegion, Signal
from kernels.comm.signal_kernel import arrive_alone, get_signal_kernel, wait_alone
from kernels.reduce.weighted_reduce_kernel import (get_reduce_sum_home_kernel, get_weighted_reduce_put_kernel,
                                                   reduce_put, reduce_sum_home)
from kernels.testing import random_bits, reduce_routes


def heaps(world: int, rows: int, d: int, seed: int):
    """Per rank one allocation: ``rows`` returned rows of bf16 (random bytes), then W int32 flags
    (zero). Returns the regions' views, every rank's Signal and the shared offsets."""
    flat = [torch.cat([random_bits(rows, d, dtype=torch.bfloat16, device="cuda", seed=seed + w).view(torch.uint8)
                       .view(-1), torch.zeros(4 * world, dtype=torch.uint8, device="cuda")]) for w in range(world)]
    delta_W = torch.tensor([f.data_ptr() - flat[0].data_ptr() for f in flat], dtype=torch.int64, device="cuda")
    views = tuple(f[:rows * d * 2].view(torch.bfloat16).view(rows, d) for f in flat)
    flags = [f[rows * d * 2:].view(torch.int32) for f in flat]
    signals = [Signal(flags_W=flags[0], own_W=flags[w], delta_W=delta_W, epoch_1=torch.zeros(1, dtype=torch.int32,
                      device="cuda"), tickets_1=torch.zeros(1, dtype=torch.int32, device="cuda"), rank=w)
               for w in range(world)]
    return views, signals, delta_W


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_combine_arrives_and_waits_with_the_same_bits(world, seed):
    t, k, p, d = 300, 8, 900, 7168  # many CTAs take tickets
    g = torch.Generator().manual_seed(seed)
    ys = [torch.randn(p, d, generator=g).to(torch.bfloat16).cuda() for _ in range(world)]
    pos_TK, weights_TK = (x.cuda() for x in reduce_routes(t, k, p, seed=seed))
    # rank w's received row r returns to row w * t + r of rank (w + 1) % W; rank w's own rows stay
    dest_RW = torch.full((t, world), -1, dtype=torch.int32, device="cuda")
    home_TW = torch.arange(world, dtype=torch.int32, device="cuda") * t + torch.arange(t, device="cuda")[:, None]
    views, signals, delta_W = heaps(world, world * t, d, seed)
    plain, _, _ = heaps(world, world * t, d, seed)
    for rounds in (1, 2):  # the epochs count on, the tickets start from 0 again
        for w in range(world):
            dest = dest_RW.clone()
            dest[:, (w + 1) % world] = w * t + torch.arange(t, dtype=torch.int32, device="cuda")
            reduce_put(ys[w], pos_TK, weights_TK, dest, PeerRegion(views=views, delta_W=delta_W), skip_rank=w,
                       signal=signals[w])
            plain_delta = torch.tensor([v.data_ptr() - plain[0].data_ptr() for v in plain], dtype=torch.int64,
                                       device="cuda")
            reduce_put(ys[w], pos_TK, weights_TK, dest, PeerRegion(views=plain, delta_W=plain_delta), skip_rank=w)
        for w in range(world):
            got = reduce_sum_home(ys[w], pos_TK, weights_TK, views[w], home_TW, rank=w, signal=signals[w])
            want = reduce_sum_home(ys[w], pos_TK, weights_TK, plain[w], home_TW, rank=w)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rounds, w)
        torch.cuda.synchronize()
        for w, s in enumerate(signals):
            assert s.epoch_1.item() == rounds and s.tickets_1.item() == 0, w
            assert s.own_W.tolist() == [rounds if v != w else 0 for v in range(world)], w
        for w in range(world):
            assert torch.equal(views[w].view(torch.int16), plain[w].view(torch.int16)), w


@pytest.mark.gpu
def test_one_cta_arrive_and_wait():
    """What a call without rows (or a reference fallback) arrives and waits with."""
    _, signals, _ = heaps(3, 1, 8, 0)
    for s in signals:
        arrive_alone(s)
    for s in signals:
        wait_alone(s)  # returns: every peer arrived (a missing one would trap after TIMEOUT_S)
    torch.cuda.synchronize()
    assert [s.own_W.tolist() for s in signals] == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    assert [s.epoch_1.item() for s in signals] == [1, 1, 1]


def test_compiles_for_sm90a():
    """The one-CTA kernels, reduce_put arriving (bf16 and FP8 rows), reduce_sum_home waiting
    (bf16 and FP8 rows): the wait precedes every load of a returned row."""
    with lowering.compile_only():
        for world in (2, 8):
            for waits in (False, True):
                source = lowering.kernel_source(get_signal_kernel(world, waits))
                assert ("ld.acquire.sys" if waits else "st.release.sys") in source and lowering.waits_first(source)
        for fp8_group in (0, 128):
            source = lowering.kernel_source(get_weighted_reduce_put_kernel(7168, 8, "bfloat16", "bfloat16", 128, False,
                                                                           2, 1024, fp8_group, True))
            assert "ep_ticket_sys(" in source and "ep_signal_sys(" in source and lowering.waits_first(source)
        for rows_dtype in ("bfloat16", "float8_e4m3fn"):
            source = lowering.kernel_source(get_reduce_sum_home_kernel(7168, 8, "bfloat16", "bfloat16", 2, rows_dtype,
                                                                       128, True))
            body = source[source.index("cudaGridDependencySynchronize"):]
            first_load = re.search(r"rows_SD(\[| \+)", body).start()
            assert lowering.waits_first(source) and body.index("ep_wait_sys(") < first_load
