"""mHC: manifold-constrained hyper-connections (see :mod:`kernels.mhc.reference`, the specification).

``norm_fn`` (forward on the tensor cores for bfloat16/float16 streams, backward for bfloat16;
otherwise on the CUDA cores, the weight gradient then by torch), ``split_sinkhorn``, ``pre_apply``,
``post`` and the inference-only ``pre_fused`` (one kernel; bfloat16: ``pre``'s kernels) run their
TileLang kernels, forward and (under autograd) backward, when :func:`kernels.select.use_tilelang`
says so for the input's device and the kernels take the inputs (streams bfloat16/float16/float32,
coefficients float32; split + Sinkhorn up to 8 streams); otherwise the reference with its autograd
runs. ``pre`` is the reference's composition (``norm_fn`` -> ``split_sinkhorn`` -> ``pre_apply``,
optionally recomputed in backward) over these ops. The choice is made from the arguments up front,
never by catching a kernel's error. The kernels check shapes, dtypes and devices, not values: a
NaN/Inf check reads the whole tensor and syncs with the host on every call (the references do
check). The other ops are the reference's.

Shape suffixes as in :mod:`kernels.mhc.reference`.
"""

import torch

from kernels.mhc import (
    norm_fn_kernel,
    post_kernel,
    pre_apply_kernel,
    pre_fused_kernel,
    reference,
    split_sinkhorn_kernel,
)
from kernels.mhc.reference import (
    expand,
    head,
    replay,
    round_to_tf32,
    sinkhorn,
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


class _NormFn(torch.autograd.Function):
    """The kernels' norm + projection, forward and backward (``grad_fn`` by torch)."""

    @staticmethod
    def forward(ctx, x_TND, fn_MK, eps, tf32):
        mixes_TM, rstd_T = norm_fn_kernel.norm_fn(x_TND, fn_MK, eps=eps, tf32=tf32)
        ctx.save_for_backward(x_TND, fn_MK, mixes_TM, rstd_T)
        ctx.tf32 = tf32
        return mixes_TM

    @staticmethod
    def backward(ctx, g_TM):
        return (*norm_fn_kernel.norm_fn_backward(*ctx.saved_tensors, g_TM, ctx.tf32), None, None)


def norm_fn(x_TND: torch.Tensor, fn_MK: torch.Tensor, *, eps: float = 1e-6, tf32: bool = False) -> torch.Tensor:
    """See :func:`kernels.mhc.reference.norm_fn`; the forward runs the kernel where it takes the
    inputs (streams bfloat16/float16/float32, ``fn`` float32)."""
    if not (_kernel_for(x_TND, fn_MK) and norm_fn_kernel.supports(x_TND, fn_MK)):
        return reference.norm_fn(x_TND, fn_MK, eps=eps, tf32=tf32)
    return _NormFn.apply(x_TND, fn_MK, eps, bool(tf32))


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


class _SplitSinkhorn(torch.autograd.Function):
    """The kernels' split + Sinkhorn; arguments as the reference's autograd op (``n`` implied)."""

    @staticmethod
    def forward(ctx, mixes_TM, scale_3, base_M, n, pre_eps, post_mult, sinkhorn_eps, iters):
        ctx.save_for_backward(mixes_TM, scale_3, base_M)  # the rest is recomputed in backward
        ctx.n, ctx.options = n, dict(post_mult=post_mult, sinkhorn_eps=sinkhorn_eps, iters=iters)
        return split_sinkhorn_kernel.split_sinkhorn(mixes_TM, scale_3, base_M, pre_eps=pre_eps, **ctx.options)

    @staticmethod
    def backward(ctx, g_pre_TN, g_post_TN, g_comb_TNN):
        mixes_TM, scale_3, base_M = ctx.saved_tensors
        t, n = mixes_TM.shape[0], ctx.n
        zeros = mixes_TM.new_zeros
        grads = split_sinkhorn_kernel.split_sinkhorn_backward(
            mixes_TM, scale_3, base_M, zeros(t, n) if g_pre_TN is None else g_pre_TN,
            zeros(t, n) if g_post_TN is None else g_post_TN, zeros(t, n, n) if g_comb_TNN is None else g_comb_TNN,
            **ctx.options)
        return (*grads, None, None, None, None, None)


def split_sinkhorn(
    mixes_TM: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
    sinkhorn_eps: float = 1e-6,
    iters: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`kernels.mhc.reference.split_sinkhorn`."""
    options = dict(pre_eps=pre_eps, post_mult=post_mult, sinkhorn_eps=sinkhorn_eps, iters=iters)
    if not (_kernel_for(mixes_TM, scale_3, base_M) and split_sinkhorn_kernel.supports(mixes_TM, scale_3, base_M)):
        return reference.split_sinkhorn(mixes_TM, scale_3, base_M, **options)
    n = reference.check_split_args(mixes_TM, scale_3, base_M, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, iters=iters,
                                   values=False)
    return _SplitSinkhorn.apply(mixes_TM, scale_3, base_M, n, float(pre_eps), float(post_mult), float(sinkhorn_eps),
                                int(iters))


def pre(
    x_TND: torch.Tensor,
    fn_MK: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
    sinkhorn_eps: float = 1e-6,
    iters: int = 20,
    tf32: bool = False,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`kernels.mhc.reference.pre`; its split+Sinkhorn and pre-apply run the kernels
    where they take the inputs (streams bfloat16/float16/float32, float32 parameters)."""
    options = dict(norm_eps=norm_eps, pre_eps=pre_eps, post_mult=post_mult, sinkhorn_eps=sinkhorn_eps, iters=iters,
                   tf32=tf32, recompute=recompute)
    # fn_MK stands in for mixes_TM and pre_TN, which the kernels make float32 from a float32 fn
    kernels = (_kernel_for(x_TND, fn_MK, scale_3, base_M) and split_sinkhorn_kernel.supports(fn_MK, scale_3, base_M)
               and pre_apply_kernel.supports(x_TND, fn_MK) and norm_fn_kernel.supports(x_TND, fn_MK))
    if not kernels:
        return reference.pre(x_TND, fn_MK, scale_3, base_M, **options)
    return reference.compose_pre(_NormFn.apply, _SplitSinkhorn.apply, _PreApply.apply, x_TND, fn_MK, scale_3, base_M,
                                 **options, values=False)


def pre_fused(
    x_TND: torch.Tensor,
    fn_MK: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
    sinkhorn_eps: float = 1e-6,
    iters: int = 20,
    tf32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`kernels.mhc.reference.pre_fused`; one kernel where it takes the inputs (streams
    float16/float32, float32 parameters). bfloat16 streams run :func:`pre`'s kernels instead: the
    projection on the tensor cores, then split + Sinkhorn and pre-apply, ~224 us against the fused
    CUDA-core walk's 476 at D = 4096. Fusing them would not save bytes: the apply
    re-reads the streams either way, a CTA's 2 MB of them long gone from L2."""
    options = dict(norm_eps=norm_eps, pre_eps=pre_eps, post_mult=post_mult, sinkhorn_eps=sinkhorn_eps, iters=iters,
                   tf32=tf32)
    if _kernel_for(x_TND, fn_MK, scale_3, base_M) and pre_fused_kernel.supports(x_TND, fn_MK, scale_3, base_M):
        if x_TND.dtype != torch.bfloat16:
            return pre_fused_kernel.pre_fused(x_TND, fn_MK, scale_3, base_M, **options)
        reference.check_pre_fused_args(x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, sinkhorn_eps, iters,
                                       values=False)
        with torch.no_grad():
            return pre(x_TND, fn_MK, scale_3, base_M, **options)
    return reference.pre_fused(x_TND, fn_MK, scale_3, base_M, **options)
