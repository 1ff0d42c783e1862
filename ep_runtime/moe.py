"""The MoE layer: router -> dispatch -> local experts -> combine, plus shared experts.

Shape letters: B sequences, S sequence length, T = B*S tokens, D hidden, E experts, P rows of the
local experts' layout.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.routing import expert_counts

from .config import MoEConfig
from .dispatch import Dispatcher
from .experts import GroupedExperts, SwiGLUMLP
from .router import Router


class MoELayer(nn.Module):
    """An expert-parallel MoE layer. This rank holds experts
    ``[ep_rank * E_local, (ep_rank + 1) * E_local)`` of ``cfg.num_experts``; ``dispatcher`` moves
    tokens between the ranks of the EP group.

    After each forward, ``load_E`` holds the number of this rank's routes to every expert and
    ``aux_loss`` the balance loss (0 when disabled).
    """

    def __init__(self, cfg: MoEConfig, hidden: int, dispatcher: Dispatcher, *, ep_rank: int, seed: int):
        super().__init__()
        self.cfg = cfg
        self.dispatcher = dispatcher
        self.router = Router(hidden, cfg.num_experts, cfg.router)
        n_local = dispatcher.num_local_experts
        self.experts = GroupedExperts(n_local, hidden, cfg.expert_hidden, first_expert=ep_rank * n_local, seed=seed)
        self.shared = SwiGLUMLP(hidden, cfg.expert_hidden * cfg.num_shared_experts) if cfg.num_shared_experts else None
        self.load_E = torch.zeros(cfg.num_experts, dtype=torch.int32)
        self.aux_loss = torch.zeros(())

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.flatten(0, -2)
        routing = self.router(x_TD)
        x_PD, layout, handle = self.dispatcher.dispatch(x_TD, routing.topk_idx_TK, routing.topk_weights_TK)
        out_TD = self.dispatcher.combine(self.experts(x_PD, layout), handle)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        self.load_E = expert_counts(routing.topk_idx_TK, self.cfg.num_experts)
        if self.cfg.router.aux_loss_coef > 0:
            self.aux_loss = self.router.balance_loss(routing, batch=x_BSD.shape[0])
        return out_TD.view_as(x_BSD)
