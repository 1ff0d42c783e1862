"""Batched matrix transpose in plain PyTorch: the specification of the transpose kernel.

Shape suffixes: B batch, M rows, N columns.
"""

from __future__ import annotations

import torch

from kernels.validate import check_tensor


def batched_transpose(x_BMN: torch.Tensor) -> torch.Tensor:
    """Swaps the last two dims into a new contiguous tensor.

    Args:
        x_BMN: ``[B, M, N]`` or ``[M, N]``, any dtype (float8_e4m3fn included).

    Returns:
        ``x_BNM`` ``[B, N, M]`` (``[N, M]`` for 2-D input): new memory with row-major strides, same
        dtype and device.
    """
    check_tensor("x_BMN", x_BMN)
    if x_BMN.dim() not in (2, 3):
        raise ValueError(f"x_BMN: expected a 2-D or 3-D tensor, got shape {tuple(x_BMN.shape)}")
    # clone, not .contiguous(): always new memory, and row-major strides even for empty or size-1 dims
    return x_BMN.transpose(-1, -2).clone(memory_format=torch.contiguous_format)
