"""Permutation: the expert-major layout of routes for grouped GEMM, and gathers into and out of it.

``reference.py`` is the specification. On devices where :func:`kernels.select.use_tilelang` is true,
``expert_layout`` runs the sync-free kernels of ``expert_layout_kernel.py``: with ``num_rows=None``
it checks the experts' range and lays out into the static capacity :func:`max_rows`, then reads
``offsets_E[-1]`` on the host to trim ``src_P`` (the host syncs the reference has too); with
``num_rows`` given it never syncs, needs ``num_rows >= max_rows(...)`` as the reference does, and
checks no values: an expert out of range counts as a masked route there, where the reference
raises. ``expand`` and ``unexpand`` run the row-copy kernels of
``expand_kernel.py`` (bit-exact, any dtype; expand scatters each token once to its rows). Both move
bits and have no autograd on any path: the dispatchers' own autograd functions carry the gradients.
"""

import torch

from kernels.select import use_tilelang
from kernels.validate import check_index_range

from . import reference
from .reference import ExpertLayout, max_rows

__all__ = ["ExpertLayout", "expand", "expert_layout", "max_rows", "unexpand"]


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
    if topk_idx_TK.dim() == 2 and isinstance(num_experts, int):
        check_index_range("topk_idx_TK", topk_idx_TK, num_experts)
    capacity = max_rows(*topk_idx_TK.shape, num_experts, alignment) if topk_idx_TK.dim() == 2 else 0
    layout = kernel(topk_idx_TK, num_experts, alignment=alignment, num_rows=capacity)
    needed = int(layout.offsets_E[-1])
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
