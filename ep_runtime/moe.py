"""The MoE layer: router -> dispatch -> local experts -> combine, plus shared experts.

Shape letters: B sequences, S sequence length, T = B*S tokens, D hidden, E experts, P rows of the
local experts' layout, K routes per token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kernels.routing import PhysicalMap
from kernels.validate import check_tensor

from .config import MoEConfig
from .dispatch import Dispatcher
from .experts import GroupedExperts, SwiGLUMLP
from .lanes import PerLaneAttribute
from .placement import ExpertPlacement
from .router import Router
from .streams import beside


class MoELayer(nn.Module):
    """An expert-parallel MoE layer. This rank holds experts
    ``[ep_rank * E_local, (ep_rank + 1) * E_local)`` of ``cfg.num_experts``; ``dispatcher`` moves
    tokens between the ranks of the EP group.

    With a ``placement`` (``ep_runtime.placement.ExpertPlacement``) the router still picks logical
    experts and its gate sends each route to one of its expert's physical replicas (deterministically, see
    ``ExpertPlacement.physical_route``), ``dispatcher`` works over the placement's ``P`` physical
    experts and this rank holds slots ``[ep_rank * P / W, (ep_rank + 1) * P / W)``, each initialised
    from its logical expert's seed. Without one, slot ``e`` is expert ``e``.

    After each forward, ``load_E`` holds the number of this rank's routes to every (logical) expert
    and ``aux_loss`` the balance loss (0 when disabled), per lane (``ep_runtime.lanes``; a
    ``PerLane`` dispatcher gives each lane its own EP group); :meth:`update_bias` after a step does
    the auxiliary-loss-free balancing.
    """

    load_E = PerLaneAttribute()
    aux_loss = PerLaneAttribute()

    def __init__(self, cfg: MoEConfig, hidden: int, dispatcher: Dispatcher, *, ep_rank: int, seed: int,
                 placement: ExpertPlacement | None = None):
        super().__init__()
        self.cfg = cfg
        self.dispatcher = dispatcher
        self.ep_rank = ep_rank
        self.hidden = hidden
        self.router = Router(hidden, cfg.num_experts, cfg.router)
        n_local = dispatcher.num_local_experts
        if not (isinstance(ep_rank, int) and 0 <= ep_rank < self.ep_size):
            raise ValueError(f"ep_rank: expected 0..{self.ep_size - 1} (the dispatcher's EP size {self.ep_size}), "
                             f"got {ep_rank!r}")
        if dispatcher.ep_rank != ep_rank:
            raise ValueError(f"ep_rank: expected the dispatcher's rank in its EP group, {dispatcher.ep_rank} (it "
                             f"receives that rank's experts' tokens), got {ep_rank}")
        if placement is None and dispatcher.num_experts != cfg.num_experts:
            raise ValueError(f"dispatcher.num_experts: expected model.moe.num_experts={cfg.num_experts} (or a "
                             f"placement's physical experts), got {dispatcher.num_experts}")
        logical_ids = None
        if placement is not None:
            self.check_placement(placement, name="placement")
            logical_ids = placement.local_experts(ep_rank)
        self.experts = GroupedExperts(n_local, hidden, cfg.expert_hidden, first_expert=ep_rank * n_local, seed=seed,
                                      logical_ids=logical_ids, fp8=cfg.fp8_experts)
        self.placement: ExpertPlacement | None = None
        if placement is not None:
            self.set_placement(placement)
        self.shared = SwiGLUMLP(hidden, cfg.expert_hidden * cfg.num_shared_experts) if cfg.num_shared_experts else None
        self.load_E = torch.zeros(cfg.num_experts, dtype=torch.int32)
        self.aux_loss = torch.zeros(())

    @property
    def ep_size(self) -> int:
        """Ranks of this layer's EP group (the dispatcher's)."""
        return self.dispatcher.num_experts // self.dispatcher.num_local_experts

    def check_placement(self, placement: ExpertPlacement, *, name: str) -> None:
        """Raises ValueError unless ``placement`` fits this layer's experts and dispatcher."""
        if not isinstance(placement, ExpertPlacement):
            raise TypeError(f"{name}: expected an ExpertPlacement, got {type(placement).__name__}")
        d = self.dispatcher
        if placement.num_experts != self.cfg.num_experts:
            raise ValueError(f"{name}.num_experts: expected model.moe.num_experts={self.cfg.num_experts}, got "
                             f"{placement.num_experts}")
        if placement.ep_size != self.ep_size:
            raise ValueError(f"{name}.ep_size: expected the dispatcher's EP size {self.ep_size}, got "
                             f"{placement.ep_size}")
        if placement.num_physical_experts != d.num_experts:
            raise ValueError(f"{name}.phy2log_P: expected the dispatcher's {d.num_experts} physical experts, got "
                             f"{placement.num_physical_experts}")

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Routes by ``placement`` from now on and records its slots' experts. Moves no weights:
        ``ep_runtime.replicas.switch_placement`` does that (and calls this)."""
        self.check_placement(placement, name="placement")
        physical_map = placement.physical_map(self.ep_rank)
        device = self.router.weight.device
        # Buffers, so that module moves take them along; not persistent: the placement, not the state
        # dict, says where experts are.
        self.register_buffer("route_log2phy_ER", physical_map.log2phy_ER.to(device), persistent=False)
        self.register_buffer("route_cdf_ER", physical_map.cdf_ER.to(device), persistent=False)
        self.register_buffer("route_draw_E", physical_map.expert_term_E.to(device), persistent=False)
        self._draw_steps = (physical_map.token_step, physical_map.source_term)
        self.placement = placement
        self.experts.logical_ids = tuple(placement.local_experts(self.ep_rank))

    @property
    def physical_map(self) -> PhysicalMap | None:
        """The gate's replica map of this rank's tokens (None without a placement)."""
        if self.placement is None:
            return None
        token_step, source_term = self._draw_steps
        return PhysicalMap(log2phy_ER=self.route_log2phy_ER, cdf_ER=self.route_cdf_ER,
                           expert_term_E=self.route_draw_E, token_step=token_step, source_term=source_term)

    def forward(self, x_BSD: torch.Tensor, token_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``token_mask_BS`` ([B, S] bool, False: padding): masked tokens reach no routed expert and
        add no load; they still pass through the shared experts."""
        check_tensor("x_BSD", x_BSD, ndim=3, shape=(None, None, self.hidden))
        dtype = self.router.weight.dtype
        if x_BSD.dtype != dtype and not torch.is_autocast_enabled(x_BSD.device.type):
            raise TypeError(f"x_BSD: expected the layer's dtype {dtype} (or autocast), got {x_BSD.dtype}")
        if token_mask_BS is not None:
            check_tensor("token_mask_BS", token_mask_BS, dtype=torch.bool, shape=tuple(x_BSD.shape[:2]),
                         device=x_BSD.device)
            token_mask_BS = token_mask_BS.flatten()
        x_TD = x_BSD.flatten(0, -2)
        if self.shared is not None:  # beside the routed path: it needs nothing of the other ranks
            side = beside(x_TD.device)
            side.hold(x_TD)  # the shared experts' backward reads it beside
            with side:
                shared_TD = self.shared(x_TD)
        routing = self.router(x_TD, physical_map=self.physical_map, token_mask_T=token_mask_BS, batch=x_BSD.shape[0])
        x_PD, layout, handle = self.dispatcher.dispatch(x_TD, routing.physical_idx_TK, routing.topk_weights_TK)
        out_TD = self.dispatcher.combine(self.experts(x_PD, layout), handle)
        if self.shared is not None:
            side.join()
            out_TD = out_TD + shared_TD
        self.load_E = routing.counts_E
        if self.cfg.router.aux_loss_coef > 0:  # none for a batch without tokens (not the last batch's)
            self.aux_loss = (self.router.balance_loss(routing, batch=x_BSD.shape[0]) if x_TD.shape[0]
                             else torch.zeros((), device=x_TD.device))
        return out_TD.view_as(x_BSD)

    @torch.no_grad()
    def update_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Aux-loss-free balancing, once a step: the last forward's ``load_E`` summed over ``group``
        (every rank whose tokens these experts serve; None: this process's routes alone) moves the
        router's bias (``model.moe.router.bias_update_rate``)."""
        load_E = self.load_E.to(self.router.bias_E.device, torch.int64)
        if group is not None:
            dist.all_reduce(load_E, group=group)
        self.router.update_bias(load_E)
