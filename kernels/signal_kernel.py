"""TileLang pieces of a barrier that a kernel passes itself (:class:`kernels.comm.Signal`): the
kernel that reads what peers stored begins it, and each of its CTAs waits for the peers only where
it first needs their stores. A barrier kernel before it (torch's: 4-6 us on two H100s after the
kernel ahead of it) would hold back the work that needs nothing of the peers; here that work hides
the signals' flight over NVLink.

- ``signal_peers`` (macro; the kernel's first CTA): thread w fences at system scope and stores this
  call's epoch into this rank's flag at peer w with release semantics. The kernel runs after the
  kernels that stored into the peers have completed (stream order, or PDL's wait for the one before
  it), so their stores are visible to every GPU before the signal.
- ``wait_peers`` (macro; every thread of a CTA): thread w spins (acquire loads at system scope)
  until peer w's flag here holds the epoch, then a CTA barrier. A peer that never signals does not
  hang the device: after the signal's ``timeout_ns`` the thread writes the peer and the epoch into
  the signal's host-mapped report (a later thread's overwrite names another silent peer), fences at
  system scope and traps. Epochs compare by wrapping difference and
  flags are never reset, so a late reader cannot miss a signal.
- ``count_epoch`` (macro; every thread, at the kernel's end): the last CTA to take a ticket stores
  the epoch on the device (every CTA read the previous one first) and resets the tickets, so a
  CUDA graph's replays count on.
- ``barrier_alone``: the three as a one-CTA kernel, for a call whose kernel has no CTA to carry them
  (no rows) or falls back to a reference.

Shape suffixes: W ranks.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.launch import launcher
from kernels.pdl import chained
from kernels.tiles import PASS_CONFIGS

from kernels.signal import Signal

SOURCE = r"""
__device__ __forceinline__ void ep_signal_sys(int* flags0, long long delta, int index, int epoch) {
  int* flag = reinterpret_cast<int*>(reinterpret_cast<char*>(flags0) + delta) + index;
  __threadfence_system();
  asm volatile("st.release.sys.global.b32 [%0], %1;" :: "l"(flag), "r"(epoch) : "memory");
}
__device__ __forceinline__ void ep_wait_sys(const int* flag, int epoch, long long timeout_ns, long long report,
                                            int peer) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    int seen;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
    if ((int)((unsigned)seen - (unsigned)epoch) >= 0) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > (unsigned long long)timeout_ns) {
      volatile int* words = reinterpret_cast<volatile int*>(report);
      if (words != nullptr) {  // plain stores: host memory need not take atomics; any silent peer will do
        words[1] = epoch;
        __threadfence_system();
        words[0] = peer + 1;
        __threadfence_system();
      }
      __trap();
    }
  }
}
"""


def in_kernel_barrier(world: int):
    """The macros ``signal_peers(flags_W, delta_W, epoch, rank, first)``, ``wait_peers(own_W,
    epoch, rank, timeout_ns, report)`` (the signal's bound and report address) and ``count_epoch(epoch_1, tickets_1, epoch, blocks)`` for ``world`` ranks (CTAs
    of at least ``world`` threads; ``flags_W`` is rank 0's copy, the peers' reached at their byte
    offsets inside the signal's C helper, out of TileLang's bounds checks; ``epoch`` is
    ``epoch_1[0] + 1`` as every CTA read it first)."""

    @T.macro
    def signal_peers(flags_W, delta_W, epoch, rank, first):
        T.import_source(SOURCE)
        tid = T.get_thread_binding()
        if T.And(first, T.And(tid < world, tid != rank)):
            T.call_extern("handle", "ep_signal_sys", T.address_of(flags_W[0]), delta_W[tid], rank, epoch)

    @T.macro
    def wait_peers(own_W, epoch, rank, timeout_ns, report):
        tid = T.get_thread_binding()
        if T.And(tid < world, tid != rank):
            T.call_extern("handle", "ep_wait_sys", T.address_of(own_W[tid]), epoch, timeout_ns, report, tid)
        T.sync_threads()

    @T.macro
    def count_epoch(epoch_1, tickets_1, epoch, blocks):
        T.sync_threads()
        if T.get_thread_binding() == 0:
            if T.atomic_add(tickets_1[0], 1, return_prev=True) == blocks - 1:
                tickets_1[0] = 0
                epoch_1[0] = epoch

    return signal_peers, wait_peers, count_epoch


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_barrier_kernel(world: int):
    """``(flags_W, own_W, delta_W, epoch_1, tickets_1, rank, timeout_ns, report)``: one CTA passing
    the barrier."""
    signal_peers, wait_peers, count_epoch = in_kernel_barrier(world)

    @T.prim_func
    def barrier_kernel(
        flags_W: T.Tensor[(world,), T.int32],
        own_W: T.Tensor[(world,), T.int32],
        delta_W: T.Tensor[(world,), T.int64],
        epoch_1: T.Tensor[(1,), T.int32],
        tickets_1: T.Tensor[(1,), T.int32],
        rank: T.int32,
        timeout_ns: T.int64,
        report: T.int64,
    ):
        with T.Kernel(1, threads=-(-world // 32) * 32):
            chained()
            epoch = T.alloc_local((1,), T.int32)
            epoch[0] = epoch_1[0] + 1
            signal_peers(flags_W, delta_W, epoch[0], rank, True)
            wait_peers(own_W, epoch[0], rank, timeout_ns, report)
            count_epoch(epoch_1, tickets_1, epoch[0], 1)

    return barrier_kernel


def barrier_alone(signal: Signal) -> None:
    """The barrier as a kernel of its own (after everything before it in the stream)."""
    launch = launcher(get_barrier_kernel(signal.world))
    launch(signal.flags_W, signal.own_W, signal.delta_W, signal.epoch_1, signal.tickets_1, signal.rank, signal.timeout_ns,
           signal.report_address)


def signal_args(signal: Signal | None, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A signalled kernel's ``(flags_W, own_W, delta_W, epoch_1, tickets_1, timeout_ns, report)``;
    stand-ins (never read) for the same kernel's unsignalled build."""
    if signal is not None:
        return (signal.flags_W, signal.own_W, signal.delta_W, signal.epoch_1, signal.tickets_1, signal.timeout_ns,
                signal.report_address)
    stand_in = torch.empty(world + 1, dtype=torch.int64, device=device)  # one allocation on the hot path
    flags = stand_in.view(torch.int32)
    return flags[:world], flags[:world], stand_in[:world], flags[world:world + 1], flags[world + 1:world + 2], 0, 0


def check_signal(signal: Signal, device: torch.device, world: int) -> None:
    """``signal``'s tensors on ``device``, of the dtypes a kernel takes, over ``world`` ranks."""
    if not isinstance(signal, Signal):
        raise TypeError(f"signal: expected a kernels.comm.Signal, got {type(signal).__name__}")
    if signal.world != world or signal.delta_W.shape != (world,):
        raise ValueError(f"signal: expected flags and offsets for {world} ranks, got {signal.world} flags and "
                         f"offsets of shape {tuple(signal.delta_W.shape)}")
    for name in ("flags_W", "own_W", "epoch_1", "tickets_1"):
        t = getattr(signal, name)
        if t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"signal.{name}: expected int32 on {device}, got {t.dtype} on {t.device}")
    if signal.timeout_ns <= 0:
        raise ValueError(f"signal.timeout_ns: expected > 0, got {signal.timeout_ns}")
    report = signal.report_2
    if report is not None and (report.shape != (2,) or report.dtype != torch.int32 or not report.is_pinned()):
        raise ValueError(f"signal.report_2: expected int32 [2] in pinned host memory, got {report.dtype} "
                         f"{tuple(report.shape)} on {report.device} (pinned: {report.is_pinned()})")
