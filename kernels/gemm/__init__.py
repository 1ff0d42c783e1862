"""FP8 grouped GEMMs for the routed experts, with DeepSeek-V3's scaling (see
:mod:`kernels.gemm.reference` for the functions and :doc:`docs/design/gemm.md` for the kernels).

Each op runs its TileLang kernel where :func:`kernels.select.use_tilelang` says so for the
operand's device and the kernel takes the shapes (multiples of 128; ``supports`` in each kernel
module), and the PyTorch reference otherwise. Neither has autograd: the runtime calls them inside
its own ``autograd.Function``.

Shape suffixes as in :mod:`kernels.gemm.reference`.
"""

import torch
import torch.nn.functional as F

from kernels.gemm import grouped_mm_kernel, reference, wgrad_kernel
from kernels.quant import per_block_cast
from kernels.select import use_tilelang
from kernels.transpose import batched_transpose
from kernels.validate import check_tensor


def _on_tilelang(t: object) -> bool:
    return isinstance(t, torch.Tensor) and use_tilelang(t.device)


def grouped_fp8_mm(
    a_PK: torch.Tensor, sa_PG: torch.Tensor, b_ENK: torch.Tensor, sb_EJG: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """See :func:`kernels.gemm.reference.grouped_fp8_mm`."""
    if (_on_tilelang(a_PK) and a_PK.dim() == 2 and isinstance(b_ENK, torch.Tensor) and b_ENK.dim() == 3
            and grouped_mm_kernel.supports(a_PK.shape[1], b_ENK.shape[1])):
        return grouped_mm_kernel.grouped_fp8_mm(a_PK, sa_PG, b_ENK, sb_EJG, offsets_E)
    return reference.grouped_fp8_mm(a_PK, sa_PG, b_ENK, sb_EJG, offsets_E)


def grouped_fp8_mm_wgrad(
    a_MR: torch.Tensor, sa_CM: torch.Tensor, b_NR: torch.Tensor, sb_CN: torch.Tensor, offsets_E: torch.Tensor,
    *, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """See :func:`kernels.gemm.reference.grouped_fp8_mm_wgrad`."""
    if (_on_tilelang(a_MR) and a_MR.dim() == 2 and isinstance(b_NR, torch.Tensor) and b_NR.dim() == 2
            and wgrad_kernel.supports(a_MR.shape[0], b_NR.shape[0], a_MR.shape[1])):
        return wgrad_kernel.grouped_fp8_mm_wgrad(a_MR, sa_CM, b_NR, sb_CN, offsets_E, out_dtype=out_dtype)
    return reference.grouped_fp8_mm_wgrad(a_MR, sa_CM, b_NR, sb_CN, offsets_E, out_dtype=out_dtype)


def cast_weights(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's ``[N, K]`` matrix cast per 128 x 128 block (:func:`kernels.quant.per_block_cast`).

    Returns:
        ``q_ENK`` ``[E, N, K]`` float8_e4m3fn and ``sf_EJG`` ``[E, ceil(N / 128), ceil(K / 128)]``
        float32: :func:`grouped_fp8_mm`'s ``b`` and ``sb``. A block's scale is the same for the
        matrix and its transpose, so ``q.transpose(1, 2)`` and ``sf.transpose(1, 2)`` (made
        contiguous) are the transposed weights' cast: the forward and the data gradient share one.
    """
    check_tensor("w_ENK", w_ENK, ndim=3)
    e, n, k = w_ENK.shape
    if n % reference.SCALE_BLOCK == 0:  # no block straddles two experts: one cast of the stack
        q, sf = per_block_cast(w_ENK.reshape(e * n, k))
        return q.view(e, n, k), sf.view(e, n // reference.SCALE_BLOCK, -1)
    casts = [per_block_cast(w_NK) for w_NK in w_ENK]
    return torch.stack([q for q, _ in casts]), torch.stack([sf for _, sf in casts])


def k_major(q_PM: torch.Tensor) -> torch.Tensor:
    """A weight-gradient operand from a per-channel cast's ``[P, M]`` e4m3 bytes: ``[M, R]``, the
    rows contiguous, with ``R`` = P rounded up to 128 (the padding rows hold zeros and lie past
    every segment). Made by :func:`kernels.transpose.batched_transpose` on the bytes."""
    rows = q_PM.shape[0]
    pad = -rows % reference.SCALE_BLOCK
    if pad:
        q_PM = F.pad(q_PM.view(torch.uint8), (0, 0, 0, pad)).view(q_PM.dtype)
    return batched_transpose(q_PM)


__all__ = ["cast_weights", "grouped_fp8_mm", "grouped_fp8_mm_wgrad", "k_major"]
