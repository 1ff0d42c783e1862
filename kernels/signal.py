"""The state of a barrier that a kernel passes itself (:mod:`kernels.signal_kernel` has the kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Signal:
    """A barrier over a symmetric heap's ranks that a kernel passes itself
    (:mod:`kernels.signal_kernel`): as it starts, its first CTA signals every peer (the
    kernels before it, whose stores the peers will read, have completed); each CTA waits for the
    peers' signals only before it reads what they stored, so its work before that hides the
    signals' flight; its last CTA counts the call's epoch. Every rank passes one such barrier per
    call, in the same order, as with ``SymmetricHeap.barrier``.

    Attributes:
        flags_W: int32 [W], rank 0's flags (word w: rank w's epoch); rank v's copy lies
            ``delta_W[v]`` bytes from it, as a ``PeerRegion``'s.
        own_W: this rank's copy of the flags (what a wait reads).
        delta_W: int64 [W], the heap's byte offsets.
        epoch_1: int32 [1], the barriers this rank passed (on the device: a CUDA graph replays on).
        tickets_1: int32 [1], the passing kernel's CTAs done so far (0 between kernels).
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
