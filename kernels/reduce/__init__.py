"""Weighted reduction of expert outputs per token, and its backward (see
:mod:`kernels.reduce.reference`).

``weighted_reduce`` runs its TileLang kernel (bit-exact, also fused with FP8 dequantization),
``weighted_reduce_backward`` its kernel (both gradients in one pass over the routed rows only) and
``reduce_sum_home`` its kernel (a combine's home side: the own rows reduced into the sum of the
returned ones) where :func:`kernels.select.use_tilelang` says so for ``y_PD``'s device, and the
reference otherwise (``weighted_reduce`` also for inputs that need a gradient: its kernel has no
autograd of its own, :mod:`kernels.select`). Kernel paths check shapes, dtypes and devices but no values (that would cost
a host sync): a position past ``y_PD``'s rows counts as -1 there, where the reference raises.
"""

import torch

from kernels.signal import Signal
from kernels.permute.reference import ExpertLayout
from kernels.reduce import reference
from kernels.reduce.weighted_reduce_kernel import weighted_reduce as weighted_reduce_kernel
from kernels.select import needs_grad, use_tilelang


def weighted_reduce(
    y_PD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    *,
    sf_PG: torch.Tensor | None = None,
    group: int = 128,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """See :func:`kernels.reduce.reference.weighted_reduce`."""
    kernel = isinstance(y_PD, torch.Tensor) and use_tilelang(y_PD.device) and not needs_grad(y_PD, weights_TK)
    impl = weighted_reduce_kernel if kernel else reference.weighted_reduce
    return impl(y_PD, pos_TK, weights_TK, sf_PG=sf_PG, group=group, out_dtype=out_dtype)


def weighted_reduce_backward(
    grad_TD: torch.Tensor, y_PD: torch.Tensor, weights_TK: torch.Tensor, layout: ExpertLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.reduce.reference.weighted_reduce_backward`."""
    if not (isinstance(y_PD, torch.Tensor) and use_tilelang(y_PD.device)):
        return reference.weighted_reduce_backward(grad_TD, y_PD, weights_TK, layout)
    from kernels.reduce.weighted_reduce_backward_kernel import weighted_reduce_backward as kernel

    return kernel(grad_TD, y_PD, weights_TK, layout)


def reduce_sum_home(y_PD: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor, rows_SD: torch.Tensor,
                    home_TW: torch.Tensor, *, rank: int, sf_SG: torch.Tensor | None = None,
                    group: int = 128, signal: Signal | None = None) -> torch.Tensor:
    """See :func:`kernels.reduce.reference.reduce_sum_home`. With ``signal`` (a CUDA heap's
    ``kernels.comm.Signal``; TileLang kernels only) the call also passes the heap's barrier that
    the returned rows wait behind: it signals the peers first and waits for theirs only before it
    reads a returned row, its own rows reduced meanwhile."""
    if isinstance(y_PD, torch.Tensor) and use_tilelang(y_PD.device):
        from kernels.reduce.weighted_reduce_kernel import reduce_sum_home as kernel

        return kernel(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank=rank, sf_SG=sf_SG, group=group, signal=signal)
    if signal is not None:
        raise ValueError("signal: only the TileLang kernel passes a barrier itself (kernels.select chose the "
                         "reference here); use the heap's barrier")
    return reference.reduce_sum_home(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank=rank, sf_SG=sf_SG, group=group)


__all__ = ["reduce_sum_home", "weighted_reduce", "weighted_reduce_backward"]
