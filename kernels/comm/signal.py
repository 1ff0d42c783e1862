"""The split barrier's state (see :mod:`kernels.comm.signal_kernel` for the kernels that use it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Signal:
    """A split barrier over a symmetric heap's ranks, for kernels that end or begin one
    (``kernels.comm.signal_kernel``): a kernel *arrives* once all of its stores are visible to
    every GPU (its last CTA stores the call's epoch into this rank's flag at every peer), a later
    kernel *waits* until every peer's flag here holds the epoch. Between the two, a rank computes
    what needs nothing of its peers. Every rank arrives and waits once a call, in the same order.

    Attributes:
        flags_W: int32 [W], rank 0's flags (word w: rank w's epoch); rank v's copy lies
            ``delta_W[v]`` bytes from it, as a ``PeerRegion``'s.
        own_W: this rank's copy of the flags (what a wait reads).
        delta_W: int64 [W], the heap's byte offsets.
        epoch_1: int32 [1], this rank's arrivals so far (on the device: a CUDA graph replays on).
        tickets_1: int32 [1], the arriving kernel's CTAs done so far (0 between kernels).
        rank: this rank.
    """

    flags_W: torch.Tensor
    own_W: torch.Tensor
    delta_W: torch.Tensor
    epoch_1: torch.Tensor
    tickets_1: torch.Tensor
    rank: int

    @property
    def world(self) -> int:
        return self.own_W.shape[0]
