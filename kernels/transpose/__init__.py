"""Batched matrix transpose, and FP8 scales to and from DeepGEMM's MN-major layout (see
:mod:`kernels.transpose.reference`).

``batched_transpose`` runs its TileLang kernel where :func:`kernels.select.use_tilelang` says so
for the input's device and its elements are 1, 2, 4 or 8 bytes, and the reference otherwise (also
for an input that needs a gradient: the kernel has no autograd of its own, :mod:`kernels.select`).
The scale layouts run theirs likewise, for up to ``sf_layout_kernel.MAX_GROUPS`` scale groups.
"""

import torch

from kernels.select import needs_grad, use_tilelang
from kernels.transpose import reference
from kernels.transpose import sf_layout_kernel
from kernels.transpose.batched_transpose_kernel import batched_transpose as batched_transpose_kernel


def batched_transpose(x_BMN: torch.Tensor) -> torch.Tensor:
    """See :func:`kernels.transpose.reference.batched_transpose`."""
    if (isinstance(x_BMN, torch.Tensor) and x_BMN.dim() in (2, 3) and x_BMN.element_size() in (1, 2, 4, 8)
            and use_tilelang(x_BMN.device) and not needs_grad(x_BMN)):
        return batched_transpose_kernel(x_BMN)
    return reference.batched_transpose(x_BMN)


def _kernel_for(sf: object, groups: int) -> bool:
    return isinstance(sf, torch.Tensor) and use_tilelang(sf.device) and type(groups) is int and 1 <= groups <= sf_layout_kernel.MAX_GROUPS


def sf_to_mn_major(sf_MG: torch.Tensor, *, pack_ue8m0: bool = False) -> torch.Tensor:
    """See :func:`kernels.transpose.reference.sf_to_mn_major`."""
    if _kernel_for(sf_MG, sf_MG.shape[1] if isinstance(sf_MG, torch.Tensor) and sf_MG.dim() == 2 else 0):
        return sf_layout_kernel.sf_to_mn_major(sf_MG, pack_ue8m0=pack_ue8m0)
    return reference.sf_to_mn_major(sf_MG, pack_ue8m0=pack_ue8m0)


def sf_to_row_major(sf_mn: torch.Tensor, *, groups: int) -> torch.Tensor:
    """See :func:`kernels.transpose.reference.sf_to_row_major`."""
    if _kernel_for(sf_mn, groups):
        return sf_layout_kernel.sf_to_row_major(sf_mn, groups=groups)
    return reference.sf_to_row_major(sf_mn, groups=groups)


__all__ = ["batched_transpose", "sf_to_mn_major", "sf_to_row_major"]
