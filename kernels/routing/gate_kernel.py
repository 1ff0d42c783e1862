"""The routing gate on the GPU: :func:`kernels.routing.reference.gate` in one launch of the router
kernel (``topk_route_kernel.py``) with its gate stages switched on.

After the router's top-k, in the same warp a token's lane ``k`` (one route each):

1. takes the token's fixed route ``k`` instead when ``fixed_T`` marks it (an id off ``[-1, E)``
   reads as -1), and -1 when ``token_mask_T`` masks the token;
2. reads its weight from the scores, normalizes and scales as the router does, and counts the
   logical route; lanes ``K .. K + N - 1`` carry the shared routes (``E + n``, weight 1.0);
3. picks its route's replica from the physical map in float64 with ``__dmul_rn`` / ``__dadd_rn``,
   the operations of :func:`kernels.routing.physical_map.physical_routes` rounded one by one (no
   fused multiply-add), so the physical ids are bit-exact with the reference's.

Host side: attribute checks only (no host sync). Masks, fixed routes and the map are not checked
for values; the reference is the op that does.

Shape suffixes: T tokens, E logical routed experts, K routes per token, N shared routes, R replicas.
"""

import torch

from kernels.validate import check_tensor

from .physical_map import PhysicalMap
from .reference import GateRoutes
from .topk_route_kernel import WARP, GateLaunch, launch


def gate(
    logits_TE: torch.Tensor,
    *,
    topk: int,
    scoring: str = "softmax",
    bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int | None = None,
    normalize: bool = False,
    routed_scaling_factor: float = 1.0,
    physical_map: PhysicalMap | None = None,
    num_shared: int = 0,
    token_mask_T: torch.Tensor | None = None,
    fixed_T: torch.Tensor | None = None,
    fixed_idx_TK: torch.Tensor | None = None,
    with_counts: bool = False,
) -> GateRoutes:
    """:func:`kernels.routing.reference.gate` in one kernel (the router's limits apply, and
    ``topk + num_shared`` <= 32). Without a map, ``logical_idx_TK`` is a view of the first K
    columns of ``physical_idx_TK``."""
    if not isinstance(logits_TE, torch.Tensor) or logits_TE.dim() != 2:
        check_tensor("logits_TE", logits_TE, ndim=2)
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    absent = GateLaunch.absent(device)
    most = WARP - topk if isinstance(topk, int) else WARP  # a lane a route
    if isinstance(num_shared, bool) or not isinstance(num_shared, int) or not 0 <= num_shared <= most:
        raise ValueError(f"num_shared: expected an int in [0, {most}], got {num_shared!r}")
    if (fixed_T is None) != (fixed_idx_TK is None):
        raise ValueError("fixed_idx_TK: expected it given with fixed_T, got one of them only")
    if token_mask_T is not None:
        check_tensor("token_mask_T", token_mask_T, dtype=torch.bool, shape=(num_tokens,), device=device)
    if fixed_T is not None:
        check_tensor("fixed_T", fixed_T, dtype=torch.bool, shape=(num_tokens,), device=device)
        check_tensor("fixed_idx_TK", fixed_idx_TK, dtype=(torch.int32, torch.int64), shape=(num_tokens, topk),
                     device=device)
    logical_idx_TK = absent.logical_idx_TK
    map_tensors = (absent.log2phy_ER, absent.cdf_ER, absent.expert_term_E)
    token_step = source_term = 0.0
    if physical_map is not None:
        if not isinstance(physical_map, PhysicalMap):
            raise TypeError(f"physical_map: expected a PhysicalMap, got {type(physical_map).__name__}")
        if physical_map.num_experts != num_experts + num_shared:
            raise ValueError(f"physical_map: expected {num_experts + num_shared} rows (experts + shared), got "
                             f"{physical_map.num_experts}")
        if physical_map.log2phy_ER.device != device:
            raise ValueError(f"physical_map: expected a map on {device}, got one on {physical_map.log2phy_ER.device}")
        map_tensors = (physical_map.log2phy_ER.contiguous(), physical_map.cdf_ER.contiguous(),
                       physical_map.expert_term_E.contiguous())
        token_step, source_term = physical_map.token_step, physical_map.source_term
        logical_idx_TK = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)

    gate_inputs = GateLaunch(
        flags=(num_shared, physical_map is not None, token_mask_T is not None, fixed_T is not None),
        token_mask_T=absent.token_mask_T if token_mask_T is None else token_mask_T.contiguous(),
        fixed_T=absent.fixed_T if fixed_T is None else fixed_T.contiguous(),
        fixed_idx_TK=absent.fixed_idx_TK if fixed_idx_TK is None else fixed_idx_TK.long().contiguous(),
        log2phy_ER=map_tensors[0], cdf_ER=map_tensors[1], expert_term_E=map_tensors[2],
        logical_idx_TK=logical_idx_TK, token_step=token_step, source_term=source_term,
    )
    idx_TK, weights_TK, counts_E = launch(logits_TE, bias_E, topk=topk, scoring=scoring, num_groups=num_groups,
                                          topk_groups=topk_groups, normalize=normalize,
                                          routed_scaling_factor=routed_scaling_factor, with_counts=with_counts,
                                          gate=gate_inputs)
    if physical_map is None:
        logical_idx_TK = idx_TK[:, :topk]
    return GateRoutes(idx_TK, logical_idx_TK, weights_TK, counts_E if with_counts else None)
