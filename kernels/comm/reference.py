"""Row copies into other ranks' memory, in plain PyTorch: the specification of the comm kernels.

A *peer region* is one buffer of the same shape and dtype on every rank of a group, each rank's
copy reachable from every other (symmetric memory: NVLink peer mappings on GPUs, shared memory
files between CPU processes, see ``ep_runtime.dispatch.symmetric``). ``PeerRegion.views[w]`` is
rank w's copy, seen from this rank.

Shape suffixes: N source rows, W ranks, X row width (elements), M rows of the destination region.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.validate import check_tensor


@dataclass(frozen=True, eq=False)
class PeerRegion:
    """Rank w's copy of one symmetric buffer region at ``views[w]`` (all ``[M, X]``, one dtype).

    ``delta_W`` (int64, on the views' device) is each copy's address minus ``views[0]``'s, in
    units of ``unit`` bytes: how a kernel that takes only ``views[0]`` reaches the others (every
    copy lies at the same offset of its rank's heap, as in an NVSHMEM symmetric heap)."""

    views: tuple[torch.Tensor, ...]
    delta_W: torch.Tensor | None = field(default=None)
    unit: int = 16

    @property
    def world(self) -> int:
        return len(self.views)


def put_rows(src_NX: torch.Tensor, dest_NW: torch.Tensor, region: PeerRegion) -> None:
    """Copies row n of ``src_NX`` to row ``dest_NW[n, w]`` of rank w's copy of ``region``, for
    every w where that entry is not -1 (each source row is read once and written to up to W ranks).

    Args:
        src_NX: [N, X] rows, the region's dtype and width, on its device.
        dest_NW: [N, W] int32 or int64 destination rows in ``[0, M)``, -1 for none.
        region: where the rows go. Rows no entry names are left as they were.
    """
    check_put_rows_args(src_NX, dest_NW, region)
    for w, view in enumerate(region.views):
        rows = (dest_NW[:, w] >= 0).nonzero().squeeze(1)
        view[dest_NW[rows, w].long()] = src_NX[rows]


def check_put_rows_args(src_NX: torch.Tensor, dest_NW: torch.Tensor, region: PeerRegion) -> None:
    if not isinstance(region, PeerRegion) or not region.views:
        raise TypeError(f"region: expected a PeerRegion with one view per rank, got {region!r}")
    first = region.views[0]
    check_tensor("src_NX", src_NX, ndim=2, dtype=first.dtype, device=first.device)
    if src_NX.shape[1] != first.shape[1]:
        raise ValueError(f"src_NX: expected rows of the region's width {first.shape[1]}, got shape {tuple(src_NX.shape)}")
    check_tensor("dest_NW", dest_NW, dtype=(torch.int32, torch.int64), shape=(src_NX.shape[0], region.world),
                 device=first.device)
