"""Lanes: PerLane members and per-lane attributes follow the calling thread's lane."""

import threading

import pytest

from ep_runtime import lanes


class _Holder:
    value = lanes.PerLaneAttribute()


def test_per_lane_member_and_attribute_follow_the_thread():
    per_lane = lanes.PerLane(["a", "bb"])
    holder = _Holder()
    holder.value = 10  # lane 0's, outside any lane
    seen = {}

    def run(index: int) -> None:
        with lanes.lane(index):
            before = holder.value  # a lane that has not set it reads lane 0's
            holder.value = 100 + index
            seen[index] = (lanes.current(), per_lane.upper(), lanes.resolve(per_lane), before, holder.value)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[1] == (1, "BB", "bb", seen[1][3], 101) and seen[1][3] in (10, 100)
    assert seen[0][:3] == (0, "A", "a") and seen[0][4] == 100
    assert lanes.current() == 0 and holder.value == 100 and lanes.resolve("plain") == "plain"
    assert lanes.lanes_of(per_lane) == 2 and lanes.lanes_of(object()) == 1


def test_attribute_is_per_lane_unless_all_none():
    class D:
        def __init__(self, group):
            self.group = group

    assert lanes.attribute(lanes.PerLane([D(None), D(None)]), "group") is None
    assert lanes.attribute(lanes.PerLane([D(1), D(2)]), "group").members == (1, 2)
    assert lanes.attribute(D(3), "group") == 3
    with pytest.raises(ValueError, match="members"):
        lanes.PerLane([])
