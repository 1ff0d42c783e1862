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


def causal_sequence_mean(x_TD: torch.Tensor, batch: int | None, token_mask_T: torch.Tensor | None) -> torch.Tensor:
    """Each token's mean of its sequence's rows up to and including it (``batch`` sequences of equal
    length, one after another; masked tokens count for none); a sequence's masked head gets zeros.
    The CPU probe in ``docs/performance.md`` is why: at DeepSeek-V3's router widths a direction
    that a sequence's router inputs share sent all its tokens to the same experts."""
    if type(batch) is not int or batch < 1 or x_TD.shape[0] % batch:
        raise ValueError(f"batch: expected the number of sequences, a positive int dividing the {x_TD.shape[0]} "
                         f"tokens (model.moe.router.center_inputs needs it), got {batch!r}")
    x_BSD = x_TD.view(batch, -1, x_TD.shape[1])
    kept_BS1 = (torch.ones(x_BSD.shape[:2], device=x_TD.device) if token_mask_T is None
                else token_mask_T.view(batch, -1).float())[..., None]
    return ((x_BSD * kept_BS1).cumsum(1) / kept_BS1.cumsum(1).clamp(min=1)).view_as(x_TD)


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(num_experts, hidden).normal_(0.0, hidden**-0.5))
        # Selection only (aux-loss-free balancing); moved by ``update_bias``, never by gradients.
        self.register_buffer("bias_E", torch.zeros(num_experts))

    def forward(self, x_TD: torch.Tensor, *, physical_map: PhysicalMap | None = None,
                token_mask_T: torch.Tensor | None = None, batch: int | None = None) -> Routing:
        """Routes ``x_TD``'s tokens; with ``physical_map`` each route also picks its expert's
        replica in the same gate; ``token_mask_T`` ([T] bool, False: not routed) leaves tokens out.
        ``batch``: the sequences ``x_TD`` holds, one after another (``cfg.center_inputs`` needs it)."""
        c = self.cfg
        x_TD = x_TD.float()
        if c.center_inputs:
            x_TD = x_TD - causal_sequence_mean(x_TD.detach(), batch, token_mask_T)
        logits_TE = F.linear(x_TD, self.weight.float())
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
