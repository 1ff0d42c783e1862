"""Engram: hashed n-gram memory ops (see :mod:`kernels.engram.reference`, the specification).

Where :func:`kernels.select.use_tilelang` says so for the input's device:

* ``gate`` runs its TileLang kernels, forward and (under autograd) backward, when the kernels take
  the dtypes (bfloat16/float16/float32, ``wh`` and ``we`` of one dtype) and the shape
  (:func:`kernels.engram.gate_backward_kernel.backward_plan`: a thread's weight gradients fit its registers,
  a token's rows shared memory); otherwise the reference with its autograd runs.
* ``ngram_hash`` runs its kernel (:mod:`kernels.engram.hash_kernel`, bit-exact) after the
  reference's checks of the ids' and the compress map's values, which the kernel skips.

The choice is made from the arguments up front, never by catching a kernel's error.
``make_hash_config`` and ``short_conv`` are the reference's everywhere.
"""

import torch

from kernels.engram import gate_backward_kernel, gate_kernel, hash_kernel, reference
from kernels.engram.reference import HashConfig, make_hash_config, short_conv
from kernels.select import use_tilelang

__all__ = ["HashConfig", "gate", "make_hash_config", "ngram_hash", "short_conv"]


def ngram_hash(
    ids_BS: torch.Tensor, config: HashConfig, *, compress_V: torch.Tensor | None = None, pad_id: int = 0
) -> torch.Tensor:
    """See :func:`kernels.engram.reference.ngram_hash`."""
    if isinstance(ids_BS, torch.Tensor) and use_tilelang(ids_BS.device):
        reference.check_hash_args(ids_BS, config, compress_V, pad_id)  # the values the kernel does not check
        return hash_kernel.hash_indices(ids_BS, config, compress_V=compress_V, pad_id=pad_id)
    return reference.ngram_hash(ids_BS, config, compress_V=compress_V, pad_id=pad_id)


def gate(
    x_TND: torch.Tensor,
    k_TND: torch.Tensor,
    v_TD: torch.Tensor,
    wh_ND: torch.Tensor,
    we_ND: torch.Tensor,
    *,
    clamp: float = 1e-6,
    eps: float = 1e-6,
    add_residual: bool = True,
) -> torch.Tensor:
    """See :func:`kernels.engram.reference.gate`."""
    tensors = (x_TND, k_TND, v_TD, wh_ND, we_ND)
    if (
        all(isinstance(t, torch.Tensor) for t in tensors)
        and x_TND.dim() == 3  # other shapes go to the reference, which names what is wrong
        and use_tilelang(x_TND.device)
        and gate_kernel.supports(*tensors)
        and gate_backward_kernel.backward_fits(x_TND, k_TND, v_TD)
    ):
        return _Gate.apply(*tensors, float(clamp), float(eps), bool(add_residual))
    return reference.gate(*tensors, clamp=clamp, eps=eps, add_residual=add_residual)


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps, add_residual):
        out_TND, stats_TN3 = gate_kernel.gate(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp=clamp, eps=eps,
                                              add_residual=add_residual, return_stats=True)
        ctx.save_for_backward(x_TND, k_TND, v_TD, wh_ND, we_ND, stats_TN3)
        ctx.options = dict(clamp=clamp, add_residual=add_residual)
        return out_TND

    @staticmethod
    def backward(ctx, g_TND):
        *inputs, stats_TN3 = ctx.saved_tensors
        grads = gate_backward_kernel.gate_backward(*inputs, g_TND.to(inputs[0].dtype), stats_TN3, **ctx.options)
        return (*grads, None, None, None)
