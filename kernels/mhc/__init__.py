"""mHC: manifold-constrained hyper-connections (see :mod:`kernels.mhc.reference`, the specification).

``pre_apply`` and ``post`` run their TileLang kernels, forward and (under autograd) backward, when
:func:`kernels.select.use_tilelang` says so for the input's device and the kernels take the dtypes
(streams bfloat16/float16/float32, coefficients float32); otherwise the reference with its
autograd runs. The choice is made from the arguments up front, never by catching a kernel's error.
The other ops are the reference's.

Shape suffixes as in :mod:`kernels.mhc.reference`.
"""

import torch

from kernels.mhc import post_kernel, pre_apply_kernel, reference
from kernels.mhc.reference import (
    expand,
    head,
    norm_fn,
    pre,
    pre_fused,
    replay,
    round_to_tf32,
    sinkhorn,
    split_sinkhorn,
)
from kernels.select import use_tilelang

__all__ = [
    "expand",
    "head",
    "norm_fn",
    "post",
    "pre",
    "pre_apply",
    "pre_fused",
    "replay",
    "round_to_tf32",
    "sinkhorn",
    "split_sinkhorn",
]


def _kernel_for(*tensors: object) -> bool:
    """True when all arguments are tensors (anything else goes to the reference, which names the
    error) on a device that runs TileLang kernels."""
    return all(isinstance(t, torch.Tensor) for t in tensors) and use_tilelang(tensors[0].device)


class _PreApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TND, pre_TN):
        ctx.save_for_backward(x_TND, pre_TN)
        return pre_apply_kernel.pre_apply(x_TND, pre_TN)

    @staticmethod
    def backward(ctx, g_TD):
        return pre_apply_kernel.pre_apply_backward(*ctx.saved_tensors, g_TD)


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f_TD, x_TND, post_TN, comb_TNN):
        ctx.save_for_backward(f_TD, x_TND, post_TN, comb_TNN)
        return post_kernel.post(f_TD, x_TND, post_TN, comb_TNN)

    @staticmethod
    def backward(ctx, g_TND):
        return post_kernel.post_backward(*ctx.saved_tensors, g_TND.to(ctx.saved_tensors[1].dtype))


def pre_apply(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
    """See :func:`kernels.mhc.reference.pre_apply`."""
    if _kernel_for(x_TND, pre_TN) and pre_apply_kernel.supports(x_TND, pre_TN):
        return _PreApply.apply(x_TND, pre_TN)
    return reference.pre_apply(x_TND, pre_TN)


def post(f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> torch.Tensor:
    """See :func:`kernels.mhc.reference.post`."""
    if _kernel_for(x_TND, f_TD, post_TN, comb_TNN) and post_kernel.supports(f_TD, x_TND, post_TN, comb_TNN):
        return _Post.apply(f_TD, x_TND, post_TN, comb_TNN)
    return reference.post(f_TD, x_TND, post_TN, comb_TNN)
