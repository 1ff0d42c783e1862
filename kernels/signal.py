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
        timeout_ns: how long a wait spins before it gives up (then the kernel traps).
        report_2: int32 [2] in pinned host memory (the device writes it through unified
            addressing), or None: a wait that gives up writes ``[1 + the peer it waited for, the
            epoch]`` there first, so that the host names the wait rather than the trap's CUDA error.
    """

    flags_W: torch.Tensor
    own_W: torch.Tensor
    delta_W: torch.Tensor
    epoch_1: torch.Tensor
    tickets_1: torch.Tensor
    rank: int
    timeout_ns: int = 120 * 10**9  # past any skew of the ranks' first-call compiles
    report_2: torch.Tensor | None = None

    @property
    def world(self) -> int:
        return self.own_W.shape[0]

    @property
    def report_address(self) -> int:
        """Where a wait that gives up reports (0: nowhere)."""
        return 0 if self.report_2 is None else self.report_2.data_ptr()
