"""Weighted reduction of expert outputs per token (see :mod:`kernels.reduce.reference`).

``weighted_reduce`` runs its TileLang kernel (bit-exact, also fused with FP8 dequantization) where
:func:`kernels.select.use_tilelang` says so for ``y_PD``'s device, and the reference otherwise.
"""

import torch

from kernels.reduce import reference
from kernels.reduce.weighted_reduce_kernel import weighted_reduce as weighted_reduce_kernel
from kernels.select import use_tilelang


def weighted_reduce(
    y_PD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    sf_PG: torch.Tensor | None = None,
    group: int = 128,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """See :func:`kernels.reduce.reference.weighted_reduce`."""
    impl = weighted_reduce_kernel if isinstance(y_PD, torch.Tensor) and use_tilelang(y_PD.device) else reference.weighted_reduce
    return impl(y_PD, pos_TK, weights_TK, sf_PG=sf_PG, group=group, out_dtype=out_dtype)


__all__ = ["weighted_reduce"]
