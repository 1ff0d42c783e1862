"""Routing: router scores, top-k expert choice and weights, the gate to physical replicas, hash
routing, load statistics.

``reference.py`` is the specification. On devices where :func:`kernels.select.use_tilelang` is true,
``topk_route`` (and ``topk_route_with_counts``) run the one-kernel router of
``topk_route_kernel.py``, ``gate`` runs that kernel with its gate stages (``gate_kernel.py``; when
``topk + num_shared`` fits a warp) and ``expert_counts`` runs ``expert_counts_kernel.py``, except
where the reference alone has what the call asks for: float64 logits, or logits that need a
gradient (the kernel's weights are not differentiable; ``topk_weights`` is). ``physical_map.py``
holds the logical -> physical replica map and the rule that picks a replica. Kernel paths check
shapes, dtypes and devices but no values (that would cost a host sync per call): for a token whose
logits are not finite the kernel's routes are unspecified (a NaN score can win, with a NaN weight),
where the reference raises. Callers that must reject NaN/Inf logits check them once where they
sync anyway (the MoE router does).
"""

import torch

from kernels.select import use_tilelang

from . import reference
from .physical_map import PhysicalMap, physical_routes
from .reference import GateRoutes, hash_route, score, sequence_balance_stats, topk_weights

__all__ = [
    "GateRoutes",
    "PhysicalMap",
    "expert_counts",
    "gate",
    "hash_route",
    "physical_routes",
    "score",
    "sequence_balance_stats",
    "topk_route",
    "topk_route_with_counts",
    "topk_weights",
]


def _router_kernel_applies(logits_TE: object, options: dict) -> bool:
    if not (
        isinstance(logits_TE, torch.Tensor)
        and logits_TE.dtype != torch.float64
        and not (logits_TE.requires_grad and torch.is_grad_enabled())
        and use_tilelang(logits_TE.device)
    ):
        return False
    from .topk_route_kernel import supports

    return logits_TE.dim() != 2 or supports(logits_TE.shape[1], options.get("topk"), options.get("num_groups", 1),
                                            options.get("topk_groups"))


def topk_route(logits_TE: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token and their weights; see :func:`kernels.routing.reference.topk_route`."""
    if _router_kernel_applies(logits_TE, options):
        from .topk_route_kernel import topk_route as kernel

        return kernel(logits_TE, **options)
    return reference.topk_route(logits_TE, **options)


def topk_route_with_counts(
    logits_TE: torch.Tensor, **options
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`topk_route` plus ``counts_E`` ([E] int32, routes per expert, as :func:`expert_counts`);
    the kernel counts them in the same launch."""
    if _router_kernel_applies(logits_TE, options):
        from .topk_route_kernel import topk_route as kernel

        return kernel(logits_TE, **options, with_counts=True)
    topk_idx_TK, topk_weights_TK = reference.topk_route(logits_TE, **options)
    return topk_idx_TK, topk_weights_TK, reference.expert_counts(topk_idx_TK, logits_TE.shape[1])


def gate(logits_TE: torch.Tensor, **options) -> GateRoutes:
    """Routes on physical replicas, with shared routes, a token mask and fixed routes; see
    :func:`kernels.routing.reference.gate`."""
    shared = options.get("num_shared", 0)
    if isinstance(shared, int) and options.get("topk", 0) + shared <= 32 and _router_kernel_applies(logits_TE, options):
        from .gate_kernel import gate as kernel

        return kernel(logits_TE, **options)
    return reference.gate(logits_TE, **options)


def expert_counts(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert; see :func:`kernels.routing.reference.expert_counts`."""
    if isinstance(topk_idx_TK, torch.Tensor) and use_tilelang(topk_idx_TK.device):
        from .expert_counts_kernel import expert_counts as kernel

        return kernel(topk_idx_TK, num_experts)
    return reference.expert_counts(topk_idx_TK, num_experts)
