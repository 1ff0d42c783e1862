"""Lanes: two streams of work in one process that run at the same time (the ``overlap`` pipeline
schedule runs one micro-batch's forward in one lane while another's backward runs in the other).

Collectives of different lanes must not share a process group (ranks would match one lane's
all-to-all with the other's), so whatever a forward or backward communicates through is one
object per lane: ``PerLane([over_group_a, over_group_b])``. Code reads it as it would the
object itself (attribute access goes to the calling thread's lane's member); ``resolve`` gives
the member where a plain object is needed (a process group passed to ``torch.distributed``).
Module attributes that a forward sets and the schedule reads back (an MoE layer's ``load_E``)
are ``PerLaneAttribute`` s. Outside any lane everything is lane 0's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

_state = threading.local()


def current() -> int:
    """The calling thread's lane (0 outside any)."""
    return getattr(_state, "lane", 0)


@contextlib.contextmanager
def lane(index: int) -> Iterator[None]:
    """Runs the body as lane ``index`` (in this thread)."""
    before, _state.lane = current(), index
    try:
        yield
    finally:
        _state.lane = before


class PerLane:
    """One member per lane; attributes are those of the calling thread's lane's member."""

    def __init__(self, members: Sequence):
        if len(members) < 1:
            raise ValueError("members: expected one per lane, got none")
        self.members = tuple(members)

    def current(self):
        return self.members[current()]

    def __getattr__(self, name: str):
        if name == "members":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.current(), name)


def resolve(obj):
    """``obj``'s member for the calling thread's lane; ``obj`` itself if it is not ``PerLane``."""
    return obj.current() if isinstance(obj, PerLane) else obj


def lanes_of(obj) -> int:
    return len(obj.members) if isinstance(obj, PerLane) else 1


def attribute(obj, name: str, default=None):
    """``getattr(obj, name, default)``, one per lane when ``obj`` is ``PerLane``."""
    if isinstance(obj, PerLane):
        values = [getattr(m, name, default) for m in obj.members]
        return None if all(v is None for v in values) else PerLane(values)
    return getattr(obj, name, default)


class PerLaneAttribute:
    """A data attribute holding one value per lane: set and read by each lane's thread. A lane
    that has not set it reads lane 0's value."""

    def __set_name__(self, owner, name: str):
        self.slot = f"_{name}_by_lane"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        values = obj.__dict__.get(self.slot, {})
        if current() in values:
            return values[current()]
        if 0 in values:
            return values[0]
        raise AttributeError(self.slot[1:].removesuffix("_by_lane"))

    def __set__(self, obj, value):
        obj.__dict__.setdefault(self.slot, {})[current()] = value
