"""Row copies into other ranks' memory and their bookkeeping: the ``nvlink`` dispatch backend's ops.

``put_rows`` runs its TileLang kernel where :func:`kernels.select.use_tilelang` says so for the
rows' device and the region carries peer offsets, and the reference (plain indexing into each
rank's view) otherwise: CPU processes sharing memory files, or a CUDA group without offsets.
``put_routes`` (dispatch's planning, with every token's routes and the count stored into every
rank), ``put_tokens`` (dispatch's FP8 cast and rows stored into the peers' regions in one launch),
``put_tokens_and_routes`` (the two in one launch, for a small batch)
and ``reduce_put`` (combine's weighted reduce stored straight into the peers' regions, as e4m3
rows and scales into ``TokenRegions``; the peer variant of ``kernels.reduce``'s weighted-reduce
kernel) take their kernels on the same terms as
``put_rows``. ``plan_receive`` (what each received row is) runs its TileLang kernel where
``use_tilelang`` says so, the reference otherwise. ``receive_layout`` (``plan_receive`` and the
local experts' layout of what arrived) is one kernel for a small batch
(``receive_layout_kernel.fits``), the two ops otherwise. ``receive_expand`` (that, then the FP8
rows dequantized into the layout) is one kernel for a batch that :func:`receive_expand_fits`, the
public ``receive_layout`` and ``kernels.permute.expand_cast_back`` otherwise. ``Signal`` is a
symmetric heap's barrier that a kernel passes itself (``signal_kernel``; ``kernels.reduce``'s
``reduce_sum_home`` takes one).
"""

import functools

import torch

from kernels.permute import ExpertLayout, expert_layout
from kernels.permute import expand_cast_back
from kernels.select import use_tilelang

from . import reference
from .reference import PeerRegion, ReceivePlan, RouteRegions, TokenRegions, receive_rows
from kernels.signal import Signal

__all__ = ["PeerRegion", "ReceivePlan", "RouteRegions", "Signal", "TokenRegions", "plan_receive", "put_routes",
           "put_rows", "put_tokens", "put_tokens_and_routes", "receive_expand", "receive_expand_fits", "receive_layout",
           "receive_rows", "reduce_put"]


def put_rows(src_NX: torch.Tensor, dest_NW: torch.Tensor, region: PeerRegion) -> None:
    """See :func:`kernels.comm.reference.put_rows`."""
    if isinstance(src_NX, torch.Tensor) and use_tilelang(src_NX.device) and getattr(region, "delta_W", None) is not None:
        from .put_rows_kernel import put_rows as kernel

        return kernel(src_NX, dest_NW, region)
    return reference.put_rows(src_NX, dest_NW, region)


def put_routes(topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, regions: RouteRegions, *,
               num_local_experts: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.comm.reference.put_routes`."""
    if (isinstance(topk_idx_TK, torch.Tensor) and use_tilelang(topk_idx_TK.device)
            and getattr(regions.meta, "delta_W", None) is not None):
        from .plan_kernel import put_routes as kernel

        return kernel(topk_idx_TK, topk_weights_TK, regions, num_local_experts=num_local_experts, rank=rank)
    return reference.put_routes(topk_idx_TK, topk_weights_TK, regions, num_local_experts=num_local_experts, rank=rank)


def put_tokens(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, regions: TokenRegions, *, num_local_experts: int,
               rank: int, group: int = 128) -> None:
    """See :func:`kernels.comm.reference.put_tokens`."""
    if isinstance(x_TD, torch.Tensor) and use_tilelang(x_TD.device) and getattr(regions.q, "delta_W", None) is not None:
        from .put_tokens_kernel import put_tokens as kernel

        return kernel(x_TD, topk_idx_TK, regions, num_local_experts=num_local_experts, rank=rank, group=group)
    return reference.put_tokens(x_TD, topk_idx_TK, regions, num_local_experts=num_local_experts, rank=rank,
                                group=group)


def put_tokens_and_routes(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                          tokens: TokenRegions, routes: RouteRegions, *, num_local_experts: int, rank: int,
                          group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.comm.reference.put_tokens_and_routes` (one kernel where ``put_tokens``
    takes its own)."""
    if (isinstance(x_TD, torch.Tensor) and use_tilelang(x_TD.device)
            and getattr(tokens.q, "delta_W", None) is not None):
        from .put_tokens_kernel import put_tokens_and_routes as kernel

        return kernel(x_TD, topk_idx_TK, topk_weights_TK, tokens, routes, num_local_experts=num_local_experts,
                      rank=rank, group=group)
    return reference.put_tokens_and_routes(x_TD, topk_idx_TK, topk_weights_TK, tokens, routes,
                                           num_local_experts=num_local_experts, rank=rank, group=group)


def reduce_put(y_PD: torch.Tensor, pos_RK: torch.Tensor, weights_RK: torch.Tensor, dest_RW: torch.Tensor,
               region: PeerRegion | TokenRegions, *, skip_rank: int = -1, group: int = 128) -> None:
    """See :func:`kernels.comm.reference.reduce_put` (the kernel casts FP8 groups of whole vectors of at
    most a warp: ``reduce_put_kernel.fp8_lanes``)."""
    fp8 = isinstance(region, TokenRegions)
    rows = region.q if fp8 else region
    if isinstance(y_PD, torch.Tensor) and use_tilelang(y_PD.device) and getattr(rows, "delta_W", None) is not None:
        from .reduce_put_kernel import fp8_lanes, reduce_put as kernel

        if not fp8 or fp8_lanes(y_PD.shape[-1], y_PD.element_size(), group):
            return kernel(y_PD, pos_RK, weights_RK, dest_RW, region, skip_rank=skip_rank, group=group)
    return reference.reduce_put(y_PD, pos_RK, weights_RK, dest_RW, region, skip_rank=skip_rank, group=group)


def plan_receive(meta_RM: torch.Tensor, count_W: torch.Tensor, **sizes) -> ReceivePlan:
    """See :func:`kernels.comm.reference.plan_receive`."""
    if isinstance(meta_RM, torch.Tensor) and use_tilelang(meta_RM.device):
        from .plan_kernel import plan_receive as kernel

        return kernel(meta_RM, count_W, **sizes)
    return reference.plan_receive(meta_RM, count_W, **sizes)


def receive_layout(meta_RM: torch.Tensor, count_W: torch.Tensor, *, num_local_experts: int, rank: int,
                   max_tokens: int, alignment: int, num_rows: int) -> tuple[ReceivePlan, ExpertLayout]:
    """See :func:`kernels.comm.reference.receive_layout`."""
    if isinstance(meta_RM, torch.Tensor) and use_tilelang(meta_RM.device):
        from .receive_layout_kernel import fits, receive_layout as kernel

        if meta_RM.dim() == 2 and fits(meta_RM.shape[0] * (meta_RM.shape[1] // 2), num_local_experts):
            return kernel(meta_RM, count_W, num_local_experts=num_local_experts, rank=rank, max_tokens=max_tokens,
                          alignment=alignment, num_rows=num_rows)
    plan = plan_receive(meta_RM, count_W, num_local_experts=num_local_experts, rank=rank, max_tokens=max_tokens)
    return plan, expert_layout(plan.local_idx_RK, num_local_experts, alignment=alignment, num_rows=num_rows,
                               routes_per_token=min(plan.local_idx_RK.shape[1], num_local_experts))


@functools.cache  # asked on every dispatch and combine of a transport, of its few sizes
def receive_expand_fits(world: int, max_tokens: int, topk: int, num_local_experts: int) -> bool:
    """Whether :func:`receive_expand` takes ``W * T_max`` received rows of ``topk`` routes in one
    launch on a GPU (a small batch; its layout then costs no launch of its own)."""
    from .receive_expand_kernel import fits

    return fits(world, max_tokens, topk, num_local_experts)


def receive_expand(meta_RM: torch.Tensor, count_W: torch.Tensor, q_RD: torch.Tensor, sf_RG: torch.Tensor, *,
                   num_local_experts: int, rank: int, max_tokens: int, alignment: int, group: int = 128,
                   out_dtype: torch.dtype = torch.bfloat16) -> tuple[ReceivePlan, ExpertLayout, torch.Tensor]:
    """See :func:`kernels.comm.reference.receive_expand`."""
    world, topk = count_W.shape[0], meta_RM.shape[-1] // 2
    if (isinstance(meta_RM, torch.Tensor) and use_tilelang(meta_RM.device)
            and receive_expand_fits(world, max_tokens, topk, num_local_experts)):
        from .receive_expand_kernel import receive_expand as kernel

        return kernel(meta_RM, count_W, q_RD, sf_RG, num_local_experts=num_local_experts, rank=rank,
                      max_tokens=max_tokens, alignment=alignment, group=group, out_dtype=out_dtype)
    plan, layout = receive_layout(meta_RM, count_W, num_local_experts=num_local_experts, rank=rank,
                                  max_tokens=max_tokens, alignment=alignment,
                                  num_rows=receive_rows(world, max_tokens, topk, num_local_experts, alignment))
    return plan, layout, expand_cast_back(q_RD, sf_RG, layout, group=group, out_dtype=out_dtype)
