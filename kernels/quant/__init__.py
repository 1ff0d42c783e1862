"""FP8 (e4m3) and FP4 (e2m1) casts, requantization between scale layouts, and SwiGLU (see
:mod:`kernels.quant.reference` for the conventions).

Each op runs its TileLang kernel where :func:`kernels.select.use_tilelang` says so for the input's
device, and the PyTorch reference otherwise (``swiglu`` also for an input that needs a gradient:
the kernel has no autograd of its own, :mod:`kernels.select`). The blockwise casts take the kernel for block sides
that are powers of two (:func:`kernels.tiles.supports_block`; 1x128, 128x128 and 128x1 among
them) and the reference for any other block shape; so do ``swiglu_per_token_cast`` for its
group and the requantizations for either side's block. The per-token casts to e2m1 or with e4m3
scales, and their casts back, take the kernel for power-of-two groups of 2 to 1024 columns and rows
that fit its shared memory (:func:`kernels.quant.scaled_cast_kernel.supports`). The expand fused
with a cast (and the cast back fused with an expand) are :mod:`kernels.permute`'s.

Shape suffixes as in :mod:`kernels.quant.reference`.
"""

import torch

from kernels.quant import reference
from kernels.quant.blockwise_cast_kernel import blockwise_cast
from kernels.quant import swiglu_kernel
from kernels.quant.cast_back_kernel import cast_back as cast_back_kernel
from kernels.quant.requant_kernel import requant as requant_kernel
from kernels.quant.scaled_cast_back_kernel import per_token_scaled_cast_back
from kernels.quant.scaled_cast_kernel import per_token_scaled_cast, supports, supports_group
from kernels.tiles import supports_block
from kernels.select import needs_grad, use_tilelang


def _kernel_for(x: object, block: tuple[int, int] | None = None) -> bool:
    """True when ``x`` (a tensor; anything else goes to the reference, which names the error) is on
    a device that runs TileLang kernels, and the block shape is one they take."""
    return (
        isinstance(x, torch.Tensor)
        and use_tilelang(x.device)
        and (block is None or (_is_block(block) and supports_block(block)))
    )


def _is_block(block: object) -> bool:
    return isinstance(block, tuple) and len(block) == 2 and all(type(b) is int and b >= 1 for b in block)


def per_token_cast(
    x_TD: torch.Tensor, *, group: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.per_token_cast`."""
    if _kernel_for(x_TD, (1, group)):
        return blockwise_cast(x_TD, (1, group), round_sf=round_sf, pack_sf=pack_sf, name="x_TD")
    return reference.per_token_cast(x_TD, group=group, round_sf=round_sf, pack_sf=pack_sf)


def per_block_cast(
    x_MN: torch.Tensor, *, block: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.per_block_cast`."""
    if _kernel_for(x_MN, (block, block)):
        return blockwise_cast(x_MN, (block, block), round_sf=round_sf, pack_sf=pack_sf)
    return reference.per_block_cast(x_MN, block=block, round_sf=round_sf, pack_sf=pack_sf)


def per_channel_cast(
    x_MN: torch.Tensor, *, block: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.per_channel_cast`."""
    if _kernel_for(x_MN, (block, 1)):
        return blockwise_cast(x_MN, (block, 1), round_sf=round_sf, pack_sf=pack_sf)
    return reference.per_channel_cast(x_MN, block=block, round_sf=round_sf, pack_sf=pack_sf)


def cast_back(
    q: torch.Tensor, sf: torch.Tensor, *, block: tuple[int, int], out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """See :func:`kernels.quant.reference.cast_back`."""
    if _kernel_for(q, block):
        return cast_back_kernel(q, sf, block=block, out_dtype=out_dtype)
    return reference.cast_back(q, sf, block=block, out_dtype=out_dtype)


def requant(
    q: torch.Tensor,
    sf: torch.Tensor,
    *,
    in_block: tuple[int, int],
    out_block: tuple[int, int],
    round_sf: bool = False,
    pack_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.requant`."""
    options = dict(in_block=in_block, out_block=out_block, round_sf=round_sf, pack_sf=pack_sf)
    if _kernel_for(q, in_block) and _kernel_for(q, out_block):
        return requant_kernel(q, sf, **options)
    return reference.requant(q, sf, **options)


def per_block_cast_lossless(
    q: torch.Tensor, sf: torch.Tensor, *, in_block: tuple[int, int], block: int = 128, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.per_block_cast_lossless`."""
    if _kernel_for(q, in_block) and _kernel_for(q, (block, block)):
        return requant_kernel(q, sf, in_block=in_block, out_block=(block, block), round_sf=True, pack_sf=pack_sf,
                              lossless=True)
    return reference.per_block_cast_lossless(q, sf, in_block=in_block, block=block, pack_sf=pack_sf)


def _scaled_kernel_for(x_TD: object, group: object) -> bool:
    """True when the per-token scaled cast kernel takes ``x_TD`` and ``group`` (anything it does not
    take goes to the reference, which names the error)."""
    return (
        _kernel_for(x_TD) and x_TD.dtype in reference.FLOAT_DTYPES and x_TD.dim() == 2
        and supports(x_TD.shape[1], group, x_TD.element_size())
    )


def per_token_cast_fp4(x_TD: torch.Tensor, *, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.per_token_cast_fp4`."""
    if _scaled_kernel_for(x_TD, group):
        return per_token_scaled_cast(x_TD, group=group, fmt="e2m1", sf_format="ue8m0")
    return reference.per_token_cast_fp4(x_TD, group=group)


def per_token_cast_fp4_e4m3_sf(
    x_TD: torch.Tensor, *, group: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.per_token_cast_fp4_e4m3_sf`."""
    if _scaled_kernel_for(x_TD, group):
        return per_token_scaled_cast(x_TD, group=group, fmt="e2m1", sf_format="e4m3")
    return reference.per_token_cast_fp4_e4m3_sf(x_TD, group=group)


def per_token_cast_e4m3_sf(
    x_TD: torch.Tensor, *, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.per_token_cast_e4m3_sf`."""
    if _scaled_kernel_for(x_TD, group):
        return per_token_scaled_cast(x_TD, group=group, fmt="e4m3", sf_format="e4m3")
    return reference.per_token_cast_e4m3_sf(x_TD, group=group)


def cast_back_fp4(
    q_TH: torch.Tensor, sf_TG: torch.Tensor, *, group: int, gsf_T: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """See :func:`kernels.quant.reference.cast_back_fp4`."""
    if _kernel_for(q_TH) and q_TH.dtype == torch.uint8 and supports_group(group):
        return per_token_scaled_cast_back(q_TH, sf_TG, gsf_T, group=group, out_dtype=out_dtype)
    return reference.cast_back_fp4(q_TH, sf_TG, group=group, gsf_T=gsf_T, out_dtype=out_dtype)


def cast_back_e4m3_sf(
    q_TD: torch.Tensor, sf_TG: torch.Tensor, gsf_T: torch.Tensor, *, group: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """See :func:`kernels.quant.reference.cast_back_e4m3_sf`."""
    if _kernel_for(q_TD) and q_TD.dtype == torch.float8_e4m3fn and supports_group(group):
        return per_token_scaled_cast_back(q_TD, sf_TG, gsf_T, group=group, out_dtype=out_dtype)
    return reference.cast_back_e4m3_sf(q_TD, sf_TG, gsf_T, group=group, out_dtype=out_dtype)


def swiglu(
    x_TI2: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """See :func:`kernels.quant.reference.swiglu`."""
    if _kernel_for(x_TI2) and not needs_grad(x_TI2, weights_T):
        return swiglu_kernel.swiglu(x_TI2, rows=rows, weights_T=weights_T, clamp=clamp)
    return reference.swiglu(x_TI2, rows=rows, weights_T=weights_T, clamp=clamp)


def swiglu_per_token_cast(
    x_TI2: torch.Tensor,
    *,
    group: int = 128,
    round_sf: bool = False,
    pack_sf: bool = False,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.swiglu_per_token_cast`."""
    options = dict(group=group, round_sf=round_sf, pack_sf=pack_sf, weights_T=weights_T, clamp=clamp)
    if _kernel_for(x_TI2, (1, group)):
        return swiglu_kernel.swiglu_per_token_cast(x_TI2, **options)
    return reference.swiglu_per_token_cast(x_TI2, **options)


def swiglu_backward(
    x_TI2: torch.Tensor,
    grad_TI: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.quant.reference.swiglu_backward`."""
    if _kernel_for(x_TI2):
        return swiglu_kernel.swiglu_backward(x_TI2, grad_TI, rows=rows, weights_T=weights_T, clamp=clamp)
    return reference.swiglu_backward(x_TI2, grad_TI, rows=rows, weights_T=weights_T, clamp=clamp)


__all__ = [
    "cast_back",
    "cast_back_e4m3_sf",
    "cast_back_fp4",
    "per_block_cast",
    "per_block_cast_lossless",
    "per_channel_cast",
    "per_token_cast",
    "requant",
    "per_token_cast_e4m3_sf",
    "per_token_cast_fp4",
    "per_token_cast_fp4_e4m3_sf",
    "swiglu",
    "swiglu_backward",
    "swiglu_per_token_cast",
]
