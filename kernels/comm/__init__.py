"""Row copies into other ranks' memory: the data movement of the ``nvlink`` dispatch backend.

``put_rows`` runs its TileLang kernel where :func:`kernels.select.use_tilelang` says so for the
rows' device and the region carries peer offsets, and the reference (plain indexing into each
rank's view) otherwise: CPU processes sharing memory files, or a CUDA group without offsets.
"""

import torch

from kernels.select import use_tilelang

from . import reference
from .reference import PeerRegion

__all__ = ["PeerRegion", "put_rows"]


def put_rows(src_NX: torch.Tensor, dest_NW: torch.Tensor, region: PeerRegion) -> None:
    """See :func:`kernels.comm.reference.put_rows`."""
    if isinstance(src_NX, torch.Tensor) and use_tilelang(src_NX.device) and getattr(region, "delta_W", None) is not None:
        from .put_rows_kernel import put_rows as kernel

        return kernel(src_NX, dest_NW, region)
    return reference.put_rows(src_NX, dest_NW, region)
