"""ep_runtime.compat.deep_ep's low-latency API behaves as DeepEP's (the checks of DeepEP's own
test_low_latency.py, written out here, against a layout computed from every rank's routes): packed
rows by local expert and source rank, recv_count and its cumulative statistics, the handle's source
tokens and layout ranges, FP8 data and scales (float32, power-of-two, UE8M0 packed, column-major)
bit for bit with the reference cast and within e4m3's error, combine equal to the weighted sum of
the experts' rows (plain, into ``out``, zero-copy), the receive hook; and bad arguments named."""

import pytest
import torch
from deepep_low_latency_workers import MODES, low_latency_checks

from ep_runtime.compat.low_latency import packed_rows, route_slots, routes_ok
from launch.local import launch_local

CHECKS = ["hook", "counts", "layout", "src_info", "rows", "combine", "zero-copy out"]
ERRORS = ["too many tokens", "hidden for fp8", "ue8m0 unrounded", "hook and async", "stats dtype", "wait stats",
          "logfmt", "combine rows", "combine weights", "out shape", "zero-copy of another shape", "shrink"]


def test_low_latency_matches_deepep_semantics():
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = launch_local(low_latency_checks, 24, 1024, 8, 3, 26, nproc=2)
    want = {f"error: {name}" for name in ERRORS}
    if not torch.cuda.is_available():  # a GPU asserts on the device instead
        want.add("error: id past the experts")
    for x_name in ("rank", "rand"):
        for mode in MODES:
            for hook in ("", " hook"):
                tag = f"{x_name} {mode}{hook}"
                want |= {f"{tag}: {c}" for c in CHECKS}
                want |= {f"{tag}: scales column-major"} if mode != "bf16" else set()
                want |= {f"{tag}: by source"} if x_name == "rank" and mode in ("bf16", "fp8") else set()
    for rank, passed in results.items():
        assert set(passed) == want, (rank, sorted(want - set(passed)))


def test_slots_round_trip():
    """A route's message slot on the sender is the slot the receiver maps to its packed row: by
    expert, then token, within each rank's block; masked routes have none."""
    topk_idx = torch.tensor([[3, 0, -1], [1, 2, 0], [-1, -1, -1], [2, 3, 1]])
    slots = route_slots(topk_idx, num_experts=4, world=2, capacity=6)
    # rank 0 (experts 0, 1): (t0, e0) (t1, e0) (t1, e1) (t3, e1); rank 1: (t1, e2) (t3, e2) (t0, e3) (t3, e3)
    assert slots.tolist() == [[8, 0, -1], [2, 6, 1], [-1, -1, -1], [7, 9, 3]]
    counts_WL = torch.tensor([[2, 1], [0, 3]])  # source 0 sends expert 0 two rows, 1 one; source 1 three to 1
    rows = packed_rows(counts_WL, capacity=4, rows_per_expert=8)
    assert rows.tolist() == [[0, 1, 8, 16], [9, 10, 11, 16]]


def test_routes_ok_is_the_device_check():
    ok = torch.tensor([[0, 3], [-1, 2]])
    assert bool(routes_ok(ok, 4))
    assert not bool(routes_ok(torch.tensor([[0, 4]]), 4))
    assert not bool(routes_ok(torch.tensor([[1, 1]]), 4))
    assert not bool(routes_ok(torch.tensor([[-2, 1]]), 4))
