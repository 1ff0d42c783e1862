"""Gradients averaged in buckets (``ep_runtime.gradients``) equal plain all-reduces of each
gradient, to the bit: overlapped with a backward (every bucket but the one holding an unused
parameter starts before backward returns), accumulated over two backwards, or copied in after one.
Overlapped buckets refuse a second backward. The buckets split by size and dtype, in order."""

import torch
from gradient_workers import averaged_three_ways
from gpus import needs_gpus

from ep_runtime.gradients import _buckets
from launch.local import launch_local


@needs_gpus(2)
def test_bucketed_gradients_equal_plain_all_reduces():
    for rank, out in launch_local(averaged_three_ways, nproc=2).items():
        for name in ("one", "two"):
            got, want = out[name]["got"], out[name]["want"]
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (rank, name)
        assert torch.equal(out["one"]["got"][0], torch.zeros(3))  # the unused parameter: zeros
        assert out["one"]["buckets"] > 2 and out["one"]["started"] == out["one"]["buckets"] - 1
        assert out["two"]["started"] == 0  # several backwards: all at the reduce
        assert all(torch.equal(g, w) for g, w in zip(out["unattached"], out["one"]["want"]))
        assert "a second backward before reduce" in out["second_backward"]


def test_buckets_split_by_size_and_dtype_in_order():
    """About ``size`` elements a bucket (a larger tensor alone): a whole v3-layer stage's gradients
    in one buffer did not fit an H200."""
    tensors = [torch.zeros(n) for n in (3, 4, 10, 1, 1)]
    runs = _buckets(tensors, 7)
    assert [[t.numel() for t in run] for run in runs] == [[3, 4], [10], [1, 1]]
    assert [t for run in runs for t in run] == tensors and _buckets([], 7) == []
    mixed = [torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)]
    assert [len(run) for run in _buckets(mixed, 100)] == [1, 2]
