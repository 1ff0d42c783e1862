"""A wait on the device that gave up (``failures.DeviceWaits``) names the job's failure: the rank,
its place, the peer it waited for and the step, not the CUDA error its trap leaves behind."""

import json

import pytest
import torch
import torch.distributed as dist

from ep_runtime import failures
from ep_runtime.failures import Activity, DeviceWaits, FailureWatch, RankFailed, report_failure


class Rank:
    rank, world_size, where = 2, 4, "rank 2 (node 0, local 2, pp 1, ep 0)"

    def __init__(self, store=None):
        self.store, self.activity = store, Activity()


@pytest.fixture
def waits(monkeypatch) -> DeviceWaits:
    waits = DeviceWaits(timeout_s=45)
    monkeypatch.setattr(failures, "DEVICE_WAITS", waits)
    return waits


def test_the_first_wait_that_gave_up_is_named(waits):
    first = waits.word(lambda peer: f"rank {peer}'s signal in the nvlink barrier")
    second = waits.word(lambda peer: f"rank {10 + peer}'s signal elsewhere")
    assert waits.gave_up() is None and first.tolist() == [0, 0]
    second[:] = torch.tensor([2, 7])  # peer 1 at epoch 7, as the kernel writes it
    assert waits.gave_up() == "waited 45 s on the device for rank 11's signal elsewhere"
    first[0] = 1
    assert waits.gave_up() == "waited 45 s on the device for rank 0's signal in the nvlink barrier"


def test_the_trap_s_cuda_error_is_reported_as_the_wait(waits):
    waits.word(lambda peer: f"rank {peer}'s signal in the nvlink barrier")[0] = 1
    failure = report_failure(Rank(), RuntimeError("CUDA error: unspecified launch failure"), step=3, grace_s=1)
    assert isinstance(failure, RankFailed) and failure.primary and failure.culprits == (2,)
    assert str(failure) == ("rank 2 (node 0, local 2, pp 1, ep 0) waited 45 s on the device for rank 0's signal in "
                            "the nvlink barrier at step 3")


def test_without_a_device_wait_the_error_is_named(waits):
    failure = report_failure(Rank(), ValueError("bad rows"), step=1, grace_s=1)
    assert str(failure) == "rank 2 (node 0, local 2, pp 1, ep 0) failed at step 1: ValueError: bad rows"


def test_the_watch_ends_the_process_for_a_device_wait(waits, monkeypatch):
    """Its report in the job's store names the wait, then the process ends."""
    class Ended(Exception):
        pass

    def end(code):
        raise Ended(code)

    monkeypatch.setattr(failures.os, "_exit", end)
    store = dist.HashStore()
    watch = FailureWatch(Rank(store), grace_s=5, timeout_s=45, step=lambda: 4)
    watch._end_if_stuck(store)  # nothing yet: the watch returns
    assert not store.check([failures._report_key(2)])
    waits.word(lambda peer: f"rank {peer}'s signal in the nvlink barrier")[0] = 4
    with pytest.raises(Ended, match="1"):
        watch._end_if_stuck(store)
    report = json.loads(store.get(failures._report_key(2)))
    assert report == {"where": Rank.where, "step": 4, "comm": False,
                      "error": "waited 45 s on the device for rank 3's signal in the nvlink barrier"}
