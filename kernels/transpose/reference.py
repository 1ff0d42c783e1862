"""Batched matrix transpose, and FP8 scales to and from the layout DeepGEMM reads, in plain
PyTorch: the specification of the transpose kernels.

The MN-major TMA-aligned scale layout (DeepGEMM's): a ``[M, G]`` matrix of scales (M rows or row
blocks, G scale groups along the reduced dim K) stored column by column, each column padded to a
multiple of ``TMA_ALIGN`` rows so that it starts on 16 bytes, i.e. a ``[M, G]`` view with strides
``(1, align(M, 4))`` of ``[G, align(M, 4)]`` memory. Packed, the scales are UE8M0 exponent bytes
``e + 127``, four consecutive groups a little-endian int32 word (group ``4w + b`` in byte ``b``):
an int32 ``[M, ceil(G / 4)]`` view with strides ``(1, align(M, 4))``. Padding (rows past M, bytes
past G) is zero.

Shape suffixes: B batch, M rows, N columns, G scale groups, W int32 words of four groups.
"""

from __future__ import annotations

import torch

from kernels.validate import check_positive, check_tensor

TMA_ALIGN = 4  # 4-byte scales or words in a 16-byte TMA alignment


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


def sf_to_mn_major(sf_MG: torch.Tensor, *, pack_ue8m0: bool = False) -> torch.Tensor:
    """Scales in the MN-major TMA-aligned layout (see the module doc).

    Args:
        sf_MG: ``[M, G]`` float32 scales, or uint8 exponents ``e + 127`` (the casts' packed scales).
        pack_ue8m0: pack the exponents four to an int32 word. A float32 scale contributes its
            exponent byte (its value exactly when it is a power of two; otherwise its mantissa is
            dropped, rounding it down to one).

    Returns:
        float32 ``[M, G]`` (2**e for uint8 input), or with ``pack_ue8m0`` int32 ``[M, ceil(G / 4)]``;
        either with strides ``(1, align(M, 4))``.
    """
    check_tensor("sf_MG", sf_MG, dtype=(torch.float32, torch.uint8), ndim=2)
    m, g = sf_MG.shape
    m_aligned = -(-m // TMA_ALIGN) * TMA_ALIGN
    if pack_ue8m0:
        exponents = sf_MG if sf_MG.dtype == torch.uint8 else (sf_MG.view(torch.int32) >> 23 & 0xFF).to(torch.uint8)
        bytes_MW4 = torch.zeros((m_aligned, -(-g // 4) * 4), dtype=torch.uint8, device=sf_MG.device)
        bytes_MW4[:m, :g] = exponents
        words_WM = torch.empty((bytes_MW4.shape[1] // 4, m_aligned), dtype=torch.int32, device=sf_MG.device)
        return words_WM.copy_(bytes_MW4.view(torch.int32).t()).t()[:m]
    sf_f32 = sf_MG if sf_MG.dtype == torch.float32 else ((sf_MG.to(torch.int32)) << 23).view(torch.float32)
    sf_GM = torch.zeros((g, m_aligned), dtype=torch.float32, device=sf_MG.device)
    sf_GM[:, :m] = sf_f32.t()
    return sf_GM.t()[:m]


def sf_to_row_major(sf_mn: torch.Tensor, *, groups: int) -> torch.Tensor:
    """The inverse of :func:`sf_to_mn_major`: scales as a row-major ``[M, groups]`` tensor.

    Args:
        sf_mn: float32 ``[M, groups]`` or packed int32 ``[M, ceil(groups / 4)]``, any strides.
        groups: G, the scale groups (a packed word holds four, so its count alone leaves G open).

    Returns:
        float32 ``[M, G]`` as given, or from packed words uint8 ``[M, G]`` exponents ``e + 127``;
        contiguous.
    """
    check_positive("groups", groups)
    check_tensor("sf_mn", sf_mn, dtype=(torch.float32, torch.int32), ndim=2)
    packed = sf_mn.dtype == torch.int32
    check_tensor("sf_mn", sf_mn, shape=(None, -(-groups // 4) if packed else groups))
    if packed:
        words_MW = torch.empty(sf_mn.shape, dtype=torch.int32, device=sf_mn.device).copy_(sf_mn)  # strides (W, 1)
        return words_MW.view(torch.uint8)[:, :groups].contiguous()
    return sf_mn.clone(memory_format=torch.contiguous_format)
