"""Symmetric heaps: one buffer of the same size on every rank of a group, each rank's copy
readable and writable by every other. The ``nvlink`` backend moves tokens by storing them straight
into peers' copies (``kernels.comm.put_rows``), then a barrier makes the stores visible.

- ``CudaHeap``: torch symmetric memory (NVLink peer mappings); the barrier runs on the current
  stream (no host sync) and CUDA graphs can capture it.
- ``FileHeap``: CPU processes on one host map each other's shared-memory files (``/dev/shm``);
  the barrier is the group's (gloo) barrier. The same backend code then runs, and is tested, on
  CPU workers.

Both hand out ``PeerRegion`` s: a typed ``[rows, width]`` slice at one byte offset of every
rank's copy. A ``CudaHeap`` whose kernels are TileLang's also hands out a barrier that a kernel
passes itself (``kernels.comm.Signal``: flags past its regions).

- ``reserve_pool`` / ``PooledHeap``: heaps of several groups of ranks (EP groups of different
  sizes in one process) reserved up front in one heap over a set holding them all, as torch's
  symmetric memory needs; each barrier goes over its own group's ranks only.
"""

from __future__ import annotations

import os
import uuid
from typing import Protocol

import torch
import torch.distributed as dist

from kernels.comm import PeerRegion, Signal
from kernels.select import use_tilelang
from kernels.signal_kernel import barrier_alone

from ..failures import DEVICE_WAITS

ALIGN = 256  # byte alignment of every region (vector stores need 16)


class SymmetricHeap(Protocol):
    rank: int
    world: int
    nbytes: int

    def region(self, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> PeerRegion:
        """Every rank's ``[rows, width]`` slice of ``dtype`` at byte ``offset`` (a multiple of ALIGN)."""
        ...

    def barrier(self, channel: int = 0) -> None:
        """Returns (on the device: the stream proceeds) once every rank reached it on ``channel``;
        stores into the heap made before it are visible after it. Barriers on different channels
        may run at once (on two streams); each channel's are met in the same order on every rank."""
        ...

    def signal(self) -> Signal | None:
        """The heap's barrier for a kernel to pass itself, where its kernels can (else None: use
        ``barrier``). Its barriers go in one sequence, on one stream."""
        ...


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _slice(heap_bytes: torch.Tensor, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    size = shape[0] * shape[1] * dtype.itemsize
    if offset % ALIGN or offset + size > heap_bytes.numel():
        raise ValueError(f"offset: expected a multiple of {ALIGN} with {size} bytes after it inside a heap of "
                         f"{heap_bytes.numel()} bytes, got {offset}")
    return heap_bytes[offset:offset + size].view(dtype).view(shape)


class FileHeap:
    """A heap of ``nbytes`` per rank in ``/dev/shm`` files, mapped by every rank of ``group``
    (processes on one host). The files are unlinked once all ranks mapped them."""

    def __init__(self, nbytes: int, group: dist.ProcessGroup):
        self.group, self.nbytes = group, nbytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        name = [uuid.uuid4().hex]
        dist.broadcast_object_list(name, group_src=0, group=group)
        paths = [f"/dev/shm/ep_runtime_{name[0]}_{r}" for r in range(self.world)]
        mine = torch.from_file(paths[self.rank], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        # A peer on another host: from_file would make an empty file of its name, and the rows stored
        # there would never reach it. Every rank learns whether any rank misses a peer, so all raise.
        missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
        anyone = torch.tensor([len(missing)])
        dist.all_reduce(anyone, group=group)
        if int(anyone):
            os.unlink(paths[self.rank])
            who = f"rank {self.rank} does not see the files of ranks {missing}" if missing else "another rank does not"
            raise RuntimeError(f"group: the CPU nvlink backend maps its peers' /dev/shm files, so every rank of its "
                               f"group must run on one host; {who} (a wrong --ranks-per-node?)")
        self.heaps = [mine if r == self.rank else torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8)
                      for r, p in enumerate(paths)]
        dist.barrier(group=group)
        os.unlink(paths[self.rank])

    def region(self, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> PeerRegion:
        return PeerRegion(views=tuple(_slice(h, offset, shape, dtype) for h in self.heaps))

    def barrier(self, channel: int = 0) -> None:
        dist.barrier(group=self.group)  # CPU work runs in line: one sequence, whatever the channel

    def signal(self) -> None:
        return None  # CPU processes synchronize through the group's barrier


class CudaHeap:
    """A heap of ``nbytes`` per rank in torch symmetric memory over ``group`` (GPUs of one NVLink
    domain). Regions carry each peer's byte offset from rank 0's copy, for the TileLang kernels.

    It needs torch's default ("CUDA") symmetric-memory backend: its barrier is a stream-ordered
    kernel with release/acquire at system scope, where NVSHMEM's (torch <= 2.13) returns at once.
    The heap is allocated and rendezvoused once (a host-blocking collective) and kept: freeing
    symmetric memory synchronizes the device.

    One process rendezvouses over one set of ranks only (a heap may grow there; another group of
    the same ranks, a second lane's, is fine): torch 2.11's symmetric memory hangs, or maps the
    wrong peers, when a process's rendezvous over some ranks follows one over others (seen on 4
    H200s: all four after two hangs, pytorch/pytorch#196082; nodes of two after all four gave wrong
    rows). Other ranks raise instead; groups of other ranks take heaps reserved in one pool over a
    set that holds them all (``reserve_pool``). A group of one rank has no peers and needs no
    rendezvous."""

    _ranks_of_process: tuple[int, ...] | None = None  # the ranks this process's rendezvous went over
    # Every heap and its peer mappings, never freed: freeing a mapping runs cudaDeviceSynchronize
    # (torch's AllocationRef), which on a host between a peer-waiting kernel and the launch its peer
    # waits for never returns. A dispatcher whose heap grew used to drop the old handle there.
    _kept: list = []

    def __init__(self, nbytes: int, group: dist.ProcessGroup, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group, self.nbytes = group, nbytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # An explicit index: symmetric memory on torch 2.11 fails on a bare "cuda" device.
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        backend = symm_mem.get_backend(device)
        if backend != "CUDA":
            raise RuntimeError(f"symmetric memory backend: expected 'CUDA' (its barrier orders peers' stores), got "
                               f"{backend!r} (TORCH_SYMMMEM or symm_mem.set_backend chose it)")
        # Past the regions: the in-kernel barrier's int32 flags, one per sender, zero before any peer
        # can signal (every rank passes the barrier below first, behind its zeroing).
        total = nbytes + aligned(self.world * 4)
        if self.world == 1:
            self.handle, whole = None, [torch.zeros(total, dtype=torch.uint8, device=device)]
        else:
            self._claim_group(group)
            local = symm_mem.empty(total, dtype=torch.uint8, device=device)
            local.zero_()
            self.handle = symm_mem.rendezvous(local, group)
            CudaHeap._kept.append((local, self.handle))
            whole = [local if r == self.rank else self.handle.get_buffer(r, (total,), torch.uint8)
                     for r in range(self.world)]
        self.heaps = [h[:nbytes] for h in whole]
        ptrs = [h.data_ptr() for h in whole]
        self.delta_W = torch.tensor([p - ptrs[0] for p in ptrs], dtype=torch.int64, device=device)
        self._signal = _signal(whole, nbytes, self.rank, self.delta_W, dist.get_process_group_ranks(group))
        self.barrier()

    def region(self, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> PeerRegion:
        return PeerRegion(views=tuple(_slice(h, offset, shape, dtype) for h in self.heaps), delta_W=self.delta_W)

    @classmethod
    def _claim_group(cls, group: dist.ProcessGroup) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        if cls._ranks_of_process is None:
            cls._ranks_of_process = ranks
        elif cls._ranks_of_process != ranks:
            raise RuntimeError(
                f"group: this process's symmetric memory already went over ranks {list(cls._ranks_of_process)}; "
                f"torch's symmetric memory cannot rendezvous over other ranks ({list(ranks)}) in the same process "
                "(pytorch/pytorch#196082): reserve every group's heap up front over one set of ranks "
                "(nvlink.reserve_heaps), or use one nvlink EP group per process")

    def barrier(self, channel: int = 0) -> None:
        if self.handle is not None:  # one rank: no peer to wait for; stream order does the rest
            # bounded as the in-kernel barrier is (torch's kernel then asserts: a CUDA error, unnamed)
            self.handle.barrier(channel=channel, timeout_ms=int(DEVICE_WAITS.timeout_s * 1000))

    def signal(self) -> Signal | None:
        if self.handle is None or not use_tilelang(self.delta_W.device):  # no peers, or no kernel to pass it
            return None
        return self._signal


def _signal(whole: list[torch.Tensor], at: int, rank: int, delta_W: torch.Tensor, ranks: list[int]) -> Signal:
    """The barrier a kernel passes itself over the heaps ``whole`` (one a rank), its int32 flags at
    byte ``at`` of each, its epoch counters on this rank; a wait that gives up names the peer by its
    job rank (``ranks``)."""
    flags = [h[at:at + len(whole) * 4].view(torch.int32) for h in whole]
    counters = torch.zeros(2, dtype=torch.int32, device=delta_W.device)
    report = DEVICE_WAITS.word(lambda peer: f"rank {ranks[peer]}'s signal in the nvlink barrier")
    return Signal(flags_W=flags[0], own_W=flags[rank], delta_W=delta_W, epoch_1=counters[:1], tickets_1=counters[1:],
                  rank=rank, timeout_ns=int(DEVICE_WAITS.timeout_s * 1e9), report_2=report)


def plan_offsets(needs: dict[str, tuple[tuple[int, ...], int]]) -> dict[str, int]:
    """Byte offsets in a pool for heaps ``name -> (ranks, nbytes)``: heaps that share a rank never
    overlap; heaps of disjoint ranks may. Every rank computes the same plan from the same needs
    (largest first, then by ranks and name; each heap at the end of the placed ones it meets)."""
    offsets: dict[str, int] = {}
    for name, (ranks, nbytes) in sorted(needs.items(), key=lambda kv: (-kv[1][1], kv[1][0], kv[0])):
        met = [offsets[other] + aligned(needs[other][1]) for other in offsets if set(needs[other][0]) & set(ranks)]
        offsets[name] = max(met, default=0)
    return offsets


class PooledHeap:
    """A heap of ``nbytes`` per rank of ``group`` at byte ``offset`` of ``pool``, a heap over a
    set of ranks holding the group's (``reserve_pool``). Its barriers are its own ranks': the
    group's (gloo) barrier on CPU; on CUDA a ``kernels.comm.Signal`` a channel, its flags past the
    regions."""

    CHANNELS = 2  # barrier channels (nvlink's rows and routes): each a sequence of its own, on its own stream

    def __init__(self, pool: CudaHeap | FileHeap, offset: int, nbytes: int, group: dist.ProcessGroup):
        self.group, self.nbytes = group, nbytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        ranks, pool_ranks = dist.get_process_group_ranks(group), dist.get_process_group_ranks(pool.group)
        whole = [pool.heaps[pool_ranks.index(r)][offset:offset + nbytes + self.flag_bytes(self.world)] for r in ranks]
        self.heaps = [h[:nbytes] for h in whole]
        self.delta_W, self._signals = None, []  # CPU: the group's barrier
        if isinstance(pool, CudaHeap):
            if not use_tilelang(pool.delta_W.device):
                raise RuntimeError("group: a pooled heap on CUDA passes its barriers by TileLang kernels, and "
                                   "TileLang's kernels are not in use here (kernels.select)")
            ptrs = [h.data_ptr() for h in whole]
            self.delta_W = torch.tensor([p - ptrs[0] for p in ptrs], dtype=torch.int64, device=whole[0].device)
            self._signals = [_signal(whole, nbytes + channel * aligned(self.world * 4), self.rank, self.delta_W, ranks)
                             for channel in range(self.CHANNELS)]

    @classmethod
    def flag_bytes(cls, world: int) -> int:
        return cls.CHANNELS * aligned(world * 4)

    def region(self, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> PeerRegion:
        return PeerRegion(views=tuple(_slice(h, offset, shape, dtype) for h in self.heaps), delta_W=self.delta_W)

    def barrier(self, channel: int = 0) -> None:
        if self._signals:
            barrier_alone(self._signals[channel])
        else:
            dist.barrier(group=self.group)

    def signal(self) -> Signal | None:
        # the rows' channel: a kernel passing it stands in for that channel's next barrier, on its stream
        return self._signals[0] if self._signals else None


def reserve_pool(needs: list[tuple[str, dist.ProcessGroup, int]], over: dist.ProcessGroup,
                 device: torch.device) -> dict[str, PooledHeap]:
    """Heaps of several groups of ranks in one process, carved from one heap over ``over`` (a set
    holding all their ranks: one node's): the one rendezvous torch's symmetric memory allows a
    process (``CudaHeap``). ``needs``: this rank's ``(key, group, nbytes)``, a key naming the
    same heap on every rank of its group (e.g. the group's name and the heap's place among that
    group's heaps); a group's ranks may ask different sizes, the largest is kept. Collective over
    ``over``: every rank of it calls this, with its own needs (possibly none), before any heap is
    used. Groups of one rank need no pool: their keys are left out."""
    over_ranks = set(dist.get_process_group_ranks(over))
    mine = [(key, tuple(dist.get_process_group_ranks(group)), aligned(nbytes)) for key, group, nbytes in needs]
    everyone: list = [None] * len(over_ranks)
    dist.all_gather_object(everyone, mine, group=over)
    merged: dict[str, tuple[tuple[int, ...], int]] = {}  # key: (ranks, the largest regions' bytes asked)
    for key, ranks, nbytes in (need for per_rank in everyone for need in per_rank):
        if not set(ranks) <= over_ranks:  # every rank raises: none is left waiting in the pool's rendezvous
            raise ValueError(f"over: expected a group holding every rank of the heaps' groups; {key}'s ranks "
                             f"{list(ranks)} are not all in {sorted(over_ranks)}")
        if len(ranks) > 1:
            merged[key] = (ranks, max(nbytes, merged.get(key, (ranks, 0))[1]))
    wholes = {k: (ranks, nbytes + PooledHeap.flag_bytes(len(ranks))) for k, (ranks, nbytes) in merged.items()}
    offsets = plan_offsets(wholes)
    total = max((offsets[k] + aligned(b) for k, (_, b) in wholes.items()), default=ALIGN)
    pool = CudaHeap(total, over, device) if device.type == "cuda" else FileHeap(total, over)  # zeroed, then a barrier
    return {key: PooledHeap(pool, offsets[key], merged[key][1], group) for key, group, _ in needs if key in merged}


def make_heap(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> SymmetricHeap:
    """The heap for ``device``: ``CudaHeap`` on CUDA, ``FileHeap`` on CPU."""
    return CudaHeap(nbytes, group, device) if device.type == "cuda" else FileHeap(nbytes, group)
