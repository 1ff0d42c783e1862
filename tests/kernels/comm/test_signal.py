"""The barrier a kernel passes itself (``kernels.comm.Signal``; a small combine's home sum): on
one GPU, "ranks" whose heaps are separate allocations reached through their address offsets (as
in test_reduce_put), each rank's kernel on a stream of its own, signalling every peer's flag and
waiting for theirs, with the same bits as the kernel without a signal; the one-CTA barrier; sm_90a
compile, the wait before the loads it guards."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import lowering
from kernels.comm import Signal
from kernels.signal_kernel import barrier_alone, get_barrier_kernel
from kernels.reduce.weighted_reduce_kernel import get_reduce_sum_home_kernel, reduce_sum_home
from kernels.testing import reduce_routes


def signals(world: int, timeout_ns: int = 120 * 10**9) -> list[Signal]:
    """Every rank's Signal over flags in allocations of their own (zero), a stream a rank."""
    flat = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(world)]
    delta_W = torch.tensor([f.data_ptr() - flat[0].data_ptr() for f in flat], dtype=torch.int64, device="cuda")
    return [Signal(flags_W=flat[0][:world], own_W=flat[w][:world], delta_W=delta_W,
                   epoch_1=torch.zeros(1, dtype=torch.int32, device="cuda"),
                   tickets_1=torch.zeros(1, dtype=torch.int32, device="cuda"), rank=w, timeout_ns=timeout_ns,
                   report_2=torch.zeros(2, dtype=torch.int32, pin_memory=True)) for w in range(world)]


def on_streams(world: int, call) -> list:
    """``call(w)`` for every rank at once, each on a stream of its own (a rank waits for the
    others' signals, so one stream would wait forever)."""
    streams = [torch.cuda.Stream() for _ in range(world)]
    results = []
    for w, stream in enumerate(streams):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            results.append(call(w))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return results


def assert_counted(sigs: list[Signal], barriers: int) -> None:
    world = len(sigs)
    for w, s in enumerate(sigs):
        assert s.epoch_1.item() == barriers and s.tickets_1.item() == 0, w
        assert s.own_W.tolist() == [barriers if v != w else 0 for v in range(world)], w


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_home_sum_waits_for_its_peers_rows(world, seed):
    """Each rank stores its block of every peer's returned rows (poisoned before) after a sleep
    that is longer the lower its rank, then runs its home sum: the last rank starts first, so a
    home sum that read before its peers' signals would sum poison."""
    t, k, p, d = 24, 8, 100, 7168  # 96 CTAs a rank: every rank's kernel resident at once
    g = torch.Generator().manual_seed(seed)
    ys = [torch.randn(p, d, generator=g).to(torch.bfloat16).cuda() for _ in range(world)]
    truth = [torch.randn(world * t, d, generator=g).to(torch.bfloat16).cuda() for _ in range(world)]
    rows = [torch.empty_like(x) for x in truth]
    pos_TK, weights_TK = (x.cuda() for x in reduce_routes(t, k, p, seed=seed))
    home_TW = torch.arange(world, dtype=torch.int32, device="cuda") * t + torch.arange(t, device="cuda")[:, None]
    home_TW[::5, 0] = -1
    want = [reduce_sum_home(ys[w], pos_TK, weights_TK, truth[w], home_TW, rank=w) for w in range(world)]
    sigs = signals(world)

    def rank_call(w):
        torch.cuda._sleep((world - w) * 2_000_000)
        for v in range(world):
            if v != w:
                rows[v][w * t:(w + 1) * t].copy_(truth[v][w * t:(w + 1) * t])
        return reduce_sum_home(ys[w], pos_TK, weights_TK, rows[w], home_TW, rank=w, signal=sigs[w])

    for barriers in (1, 2):  # the epochs count on, the tickets start from 0 again
        for x in rows:
            x.view(torch.int16).fill_(-1)  # NaN
        torch.cuda.synchronize()
        got = on_streams(world, rank_call)
        for w in range(world):
            assert torch.equal(got[w].view(torch.int16), want[w].view(torch.int16)), (barriers, w)
        assert_counted(sigs, barriers)


@pytest.mark.gpu
def test_one_cta_barrier():
    """What a call without rows (or a reference fallback) passes the barrier with."""
    sigs = signals(3)
    for barriers in (1, 2):
        on_streams(3, lambda w: barrier_alone(sigs[w]))
        assert_counted(sigs, barriers)


GIVE_UP = """
import time, torch
from kernels.signal_kernel import barrier_alone
from test_signal import signals
sig = signals(2, timeout_ns=300_000_000)[0]  # rank 0's, whose peer never runs
start = time.monotonic()
barrier_alone(sig)
try:
    torch.cuda.synchronize()
except Exception as exc:
    print("error", type(exc).__name__, round(time.monotonic() - start, 1), "report", sig.report_2.tolist())
"""


@pytest.mark.gpu
def test_a_wait_for_a_silent_peer_gives_up_and_says_which():
    """A barrier whose peer never signals traps after the signal's timeout, having written the peer
    and the epoch into its host-mapped report (read after the trap: host memory, no CUDA call). In
    a process of its own: the trap ends its CUDA context."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    done = subprocess.run([sys.executable, "-c", GIVE_UP], env=env, capture_output=True, text=True, timeout=300)
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    match = re.fullmatch(r"error \w+ ([\d.]+) report \[2, 1\]", line)
    assert match, line
    assert float(match[1]) < 60  # the timeout, not forever (the first call also compiles the kernel)


def test_compiles_for_sm90a():
    """The one-CTA barrier; reduce_sum_home passing it (bf16 and FP8 rows): the signal before the
    own rows' reduce, the wait before every load of a returned row."""
    with lowering.compile_only():
        for world in (2, 8):
            source = lowering.kernel_source(get_barrier_kernel(world))
            assert "st.release.sys" in source and "ld.acquire.sys" in source and lowering.waits_first(source)
        for rows_dtype in ("bfloat16", "float8_e4m3fn"):
            source = lowering.kernel_source(get_reduce_sum_home_kernel(7168, 8, "bfloat16", "bfloat16", 2, rows_dtype,
                                                                       128, True))
            body = source[source.index("cudaGridDependencySynchronize"):]
            first_load = re.search(r"rows_SD(\[| \+)", body).start()
            assert lowering.waits_first(source)
            assert body.index("ep_signal_sys(") < body.index("y_PD") and body.index("ep_wait_sys(") < first_load
