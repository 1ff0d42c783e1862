"""The router: top-k gating over the experts, with a per-expert bias for aux-loss-free balancing.

Shape letters: T tokens, D hidden, E experts, K routes per token, B sequences, S sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.routing import PhysicalMap, gate, score, sequence_balance_stats, topk_weights
from kernels.validate import check_finite, check_tensor

from .config import RouterConfig


@dataclass(frozen=True)
class Routing:
    topk_idx_TK: torch.Tensor  # int64 logical experts, -1 = no route
    topk_weights_TK: torch.Tensor  # float32, differentiable w.r.t. the router weight
    logits_TE: torch.Tensor  # float32
    physical_idx_TK: torch.Tensor  # int64 the routes' physical slots (the logical ids without a map)
    counts_E: torch.Tensor  # int32 routes per logical expert


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(num_experts, hidden).normal_(0.0, hidden**-0.5))
        # Selection only (aux-loss-free balancing); moved by ``update_bias``, never by gradients.
        self.register_buffer("bias_E", torch.zeros(num_experts))

    def forward(self, x_TD: torch.Tensor, *, physical_map: PhysicalMap | None = None,
                token_mask_T: torch.Tensor | None = None) -> Routing:
        """Routes ``x_TD``'s tokens; with ``physical_map`` each route also picks its expert's
        replica in the same gate; ``token_mask_T`` ([T] bool, False: not routed) leaves tokens out."""
        c = self.cfg
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        check_finite("router logits", logits_TE)  # a NaN/Inf logit is an error (the layer's one host sync)
        with torch.no_grad():
            routes = gate(logits_TE.detach(), topk=c.topk, scoring=c.scoring, bias_E=self.bias_E.float(),
                          num_groups=c.num_groups, topk_groups=c.topk_groups, normalize=c.normalize,
                          routed_scaling_factor=c.routed_scaling_factor, physical_map=physical_map,
                          token_mask_T=token_mask_T, with_counts=True)
        weights_TK = topk_weights(logits_TE, routes.logical_idx_TK, scoring=c.scoring, normalize=c.normalize,
                                  routed_scaling_factor=c.routed_scaling_factor, values=False)
        return Routing(routes.logical_idx_TK, weights_TK, logits_TE, routes.physical_idx_TK, routes.counts_E)

    def balance_loss(self, routing: Routing, batch: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, ``aux_loss_coef * mean_b sum_e load * prob``."""
        scores_BSE = score(routing.logits_TE, self.cfg.scoring, values=False).unflatten(0, (batch, -1))
        load_BE, prob_BE = sequence_balance_stats(scores_BSE, routing.topk_idx_TK.unflatten(0, (batch, -1)))
        return self.cfg.aux_loss_coef * (load_BE * prob_BE).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded.
        ``load_E``: the routes per expert of the whole EP group (``MoELayer.update_bias`` sums them)."""
        check_tensor("load_E", load_E, shape=tuple(self.bias_E.shape))
        load_E = load_E.float()
        self.bias_E += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)

    def _apply(self, fn, recurse=True):
        """Module casts (``.to(torch.bfloat16)``, ``.half()``) keep the bias float32: in bfloat16,
        steps of ``bias_update_rate`` round away once the bias reaches about 0.5."""
        super()._apply(fn, recurse)
        self.bias_E = self.bias_E.float()
        return self
