"""Permutation: the expert-major layout of routes for grouped GEMM, and gathers into and out of it.

``reference.py`` is the specification. On devices where :func:`kernels.select.use_tilelang` is true,
``expert_layout`` runs the sync-free kernels of ``expert_layout_kernel.py``: with ``num_rows=None``
it lays out into the static capacity :func:`max_rows`, then reads ``offsets_E[-1]`` (to trim
``src_P``) and the experts' range (checked as the reference does) in one host sync; with
``num_rows`` given it never syncs, needs ``num_rows >= max_rows(...)`` as the reference does, and
checks no values: an expert out of range counts as a masked route there, where the reference
raises. ``expand`` and ``unexpand`` run the row-copy kernels of
``expand_kernel.py`` (bit-exact, any dtype; expand scatters each token once to its rows). Both move
bits and have no autograd on any path: the dispatchers' own autograd functions carry the gradients.
``expand_per_token_cast`` and ``expand_cast_back`` fuse the expand with :mod:`kernels.quant`'s FP8
cast (``expand_quant_kernel.py``) or cast back (``expand_cast_back_kernel.py``), for 1 x group
scale groups of a power-of-two size (the reference otherwise).
"""

import torch

from kernels.select import use_tilelang
from kernels.tiles import supports_block

from . import reference
from .reference import ExpertLayout, max_rows

__all__ = ["ExpertLayout", "expand", "expand_cast_back", "expand_per_token_cast", "expert_layout", "max_rows",
           "unexpand"]


def expert_layout(
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    *,
    alignment: int = 128,
    num_rows: int | None = None,
    routes_per_token: int | None = None,
) -> ExpertLayout:
    """Expert-major layout of the routes; see :func:`kernels.permute.reference.expert_layout`."""
    if not (isinstance(topk_idx_TK, torch.Tensor) and use_tilelang(topk_idx_TK.device)):
        return reference.expert_layout(topk_idx_TK, num_experts, alignment=alignment, num_rows=num_rows,
                                       routes_per_token=routes_per_token)
    from .expert_layout_kernel import expert_layout as kernel

    if num_rows is not None:
        return kernel(topk_idx_TK, num_experts, alignment=alignment, num_rows=num_rows,
                      routes_per_token=routes_per_token)
    capacity = max_rows(*topk_idx_TK.shape, num_experts, alignment) if topk_idx_TK.dim() == 2 else 0
    layout = kernel(topk_idx_TK, num_experts, alignment=alignment, num_rows=capacity)
    # One host read for the trim and the experts' range (the kernel takes an expert out of range as
    # a masked route, so checking after it is safe).
    ends = [layout.offsets_E[-1].long()]
    if topk_idx_TK.numel():
        ends += [topk_idx_TK.min().long(), topk_idx_TK.max().long()]
    needed, *span = torch.stack(ends).tolist()
    if span and (span[0] < -1 or span[1] >= num_experts):
        raise ValueError(f"topk_idx_TK: expected entries in -1 or [0, {num_experts}), got values in "
                         f"[{span[0]}, {span[1]}]")
    return ExpertLayout(
        counts_E=layout.counts_E,
        offsets_E=layout.offsets_E,
        pos_TK=layout.pos_TK,
        src_P=layout.src_P[:needed],
        alignment=alignment,
    )


def expand(x_TD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Gathers tokens into the layout; see :func:`kernels.permute.reference.expand`."""
    if not (isinstance(x_TD, torch.Tensor) and use_tilelang(x_TD.device)):
        return reference.expand(x_TD, layout)
    from .expand_kernel import expand as kernel

    return kernel(x_TD, layout)


def unexpand(y_PD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Gathers layout rows back per route; see :func:`kernels.permute.reference.unexpand`."""
    if not (isinstance(y_PD, torch.Tensor) and use_tilelang(y_PD.device)):
        return reference.unexpand(y_PD, layout)
    from .expand_kernel import unexpand as kernel

    return kernel(y_PD, layout)


def expand_per_token_cast(
    x_TD: torch.Tensor, layout: ExpertLayout, *, group: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.permute.reference.expand_per_token_cast`."""
    if isinstance(x_TD, torch.Tensor) and use_tilelang(x_TD.device) and supports_block((1, group)):
        from .expand_quant_kernel import expand_per_token_cast as kernel

        return kernel(x_TD, layout, group=group, round_sf=round_sf, pack_sf=pack_sf)
    return reference.expand_per_token_cast(x_TD, layout, group=group, round_sf=round_sf, pack_sf=pack_sf)


def expand_cast_back(
    q_TD: torch.Tensor, sf_TG: torch.Tensor, layout: ExpertLayout, *, group: int = 128,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """See :func:`kernels.permute.reference.expand_cast_back`."""
    if isinstance(q_TD, torch.Tensor) and use_tilelang(q_TD.device) and supports_block((1, group)):
        from .expand_cast_back_kernel import expand_cast_back as kernel

        return kernel(q_TD, sf_TG, layout, group=group, out_dtype=out_dtype)
    return reference.expand_cast_back(q_TD, sf_TG, layout, group=group, out_dtype=out_dtype)
