"""TileLang pieces of a split barrier (:class:`kernels.comm.reference.Signal`): ``arrive`` ends a
kernel whose stores peers will read, ``wait`` begins the part of a later kernel that reads what
peers stored. A barrier kernel between the two (torch's, 4-6 us on two H100s after the kernel
before it) would hold back the later kernel's work that needs nothing of the peers; with the
barrier split around it, that work hides the signal's flight over NVLink.

- ``arrive`` (macro, at the end of a kernel; every thread of every CTA): a CTA barrier, then its
  first thread fences at system scope (the CTA's stores, seen through the barrier, become visible
  to every GPU) and takes a ticket; the CTA with the last ticket fences again and stores the next
  epoch into this rank's flag at every peer with release semantics, resets the tickets and counts
  the epoch.
- ``wait`` (macro, every thread of a CTA): thread w spins (acquire loads at system scope) until
  peer w's flag here holds this rank's epoch, then a CTA barrier; a peer that never arrives traps
  after ``TIMEOUT_S`` instead of hanging the device. Epochs compare by wrapping difference and
  flags are never reset, so a late reader cannot miss an arrival.
- ``arrive_alone`` / ``wait_alone``: the same as one-CTA kernels, for calls whose kernel has no
  CTA to carry them (no rows) or falls back to a reference.

The epoch lives on the device, counted by ``arrive``; a ``wait`` after it in stream order reads
it (chained kernels: the wait for the kernel before covers it).

Shape suffixes: W ranks.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.pdl import chained
from kernels.quant.tiles import PEER_PASS_CONFIGS

from .signal import Signal

TIMEOUT_S = 120  # past any skew of the ranks' first-call compiles; a stuck peer still fails the job

SOURCE = r"""
__device__ __forceinline__ int ep_ticket_sys(int* tickets) {
  __threadfence_system();
  return atomicAdd(tickets, 1);
}
__device__ __forceinline__ void ep_signal_sys(int* flag, int epoch) {
  __threadfence_system();
  asm volatile("st.release.sys.global.b32 [%0], %1;" :: "l"(flag), "r"(epoch) : "memory");
}
__device__ __forceinline__ void ep_wait_sys(const int* flag, int epoch, unsigned long long timeout_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    int seen;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
    if ((int)((unsigned)seen - (unsigned)epoch) >= 0) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) __trap();
  }
}
"""


def arrive(world: int):
    """A macro ``(flags_W, delta_W, epoch_1, tickets_1, rank, blocks)`` ending a kernel of
    ``blocks`` CTAs over ``world`` ranks (``flags_W``: rank 0's copy; a kernel with peer offsets
    runs with ``PEER_PASS_CONFIGS``)."""

    @T.macro
    def arrive_(flags_W, delta_W, epoch_1, tickets_1, rank, blocks):
        T.import_source(SOURCE)
        T.sync_threads()
        if T.get_thread_binding() == 0:
            if T.call_extern("int32", "ep_ticket_sys", T.address_of(tickets_1[0])) == blocks - 1:
                for w in T.unroll(world):
                    if w != rank:
                        T.call_extern("handle", "ep_signal_sys", T.address_of(flags_W[delta_W[w] // 4 + rank]),
                                      epoch_1[0] + 1)
                tickets_1[0] = 0
                epoch_1[0] = epoch_1[0] + 1

    return arrive_


def wait(world: int):
    """A macro ``(own_W, epoch_1, rank)``: every peer's arrival at this rank's epoch, then a CTA
    barrier (every thread of the CTA calls it; a CTA of at least ``world`` threads)."""

    @T.macro
    def wait_(own_W, epoch_1, rank):
        T.import_source(SOURCE)
        tid = T.get_thread_binding()
        if T.And(tid < world, tid != rank):
            T.call_extern("handle", "ep_wait_sys", T.address_of(own_W[tid]), epoch_1[0],
                          T.uint64(TIMEOUT_S * 1_000_000_000))
        T.sync_threads()

    return wait_


@tilelang.jit(pass_configs=PEER_PASS_CONFIGS)
def get_signal_kernel(world: int, waits: bool):
    """``(flags_W, own_W, delta_W, epoch_1, tickets_1, rank)``: one CTA that arrives, or waits."""
    arrive_, wait_ = arrive(world), wait(world)
    num_flags = T.dynamic("num_flags")

    @T.prim_func
    def signal_kernel(
        flags_W: T.Tensor[(num_flags,), T.int32],
        own_W: T.Tensor[(world,), T.int32],
        delta_W: T.Tensor[(world,), T.int64],
        epoch_1: T.Tensor[(1,), T.int32],
        tickets_1: T.Tensor[(1,), T.int32],
        rank: T.int32,
    ):
        with T.Kernel(1, threads=max(32, -(-world // 32) * 32)):
            chained()
            if waits:
                wait_(own_W, epoch_1, rank)
            else:
                arrive_(flags_W, delta_W, epoch_1, tickets_1, rank, 1)

    return signal_kernel


def _launch(signal: Signal, waits: bool) -> None:
    kernel = get_signal_kernel(signal.world, waits)
    kernel(signal.flags_W, signal.own_W, signal.delta_W, signal.epoch_1, signal.tickets_1, signal.rank)


def arrive_alone(signal: Signal) -> None:
    """This rank's arrival, in a kernel of its own (after everything before it in the stream)."""
    _launch(signal, waits=False)


def wait_alone(signal: Signal) -> None:
    """Every peer's arrival at this rank's epoch, in a kernel of its own."""
    _launch(signal, waits=True)


def check_signal(signal: Signal, device: torch.device) -> None:
    """``signal``'s tensors on ``device``, of the shapes and dtypes a kernel takes."""
    if not isinstance(signal, Signal):
        raise TypeError(f"signal: expected a kernels.comm.Signal, got {type(signal).__name__}")
    for name in ("flags_W", "own_W", "epoch_1", "tickets_1"):
        t = getattr(signal, name)
        if t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"signal.{name}: expected int32 on {device}, got {t.dtype} on {t.device}")
