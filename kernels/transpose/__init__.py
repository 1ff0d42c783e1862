"""Batched matrix transpose (see :mod:`kernels.transpose.reference`).

``batched_transpose`` runs its TileLang kernel where :func:`kernels.select.use_tilelang` says so
for the input's device and its elements are 1, 2, 4 or 8 bytes, and the reference otherwise (also
for an input that needs a gradient: the kernel has no autograd of its own, :mod:`kernels.select`).
"""

import torch

from kernels.select import needs_grad, use_tilelang
from kernels.transpose import reference
from kernels.transpose.batched_transpose_kernel import batched_transpose as batched_transpose_kernel


def batched_transpose(x_BMN: torch.Tensor) -> torch.Tensor:
    """See :func:`kernels.transpose.reference.batched_transpose`."""
    if (isinstance(x_BMN, torch.Tensor) and x_BMN.dim() in (2, 3) and x_BMN.element_size() in (1, 2, 4, 8)
            and use_tilelang(x_BMN.device) and not needs_grad(x_BMN)):
        return batched_transpose_kernel(x_BMN)
    return reference.batched_transpose(x_BMN)


__all__ = ["batched_transpose"]
