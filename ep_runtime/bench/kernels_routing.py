"""``bench kernels`` cases of ``kernels.routing``: the router (three configurations) and the
per-expert counts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kernels_cases import Case, Inputs, nbytes, tk_peer

def _case_topk_route(inp: Inputs, tk) -> Case:
    from kernels import routing
    from kernels.routing import reference

    s, opts = inp.shape, inp.router_options
    logits, bias = inp.logits_TE, inp.bias_E

    def ref(logits_TE, bias_E):
        return reference.topk_route(logits_TE, bias_E=bias_E, **opts)

    peers = {}
    scores_TE = (torch.sigmoid(logits) + bias).contiguous()  # topk_gate takes selection scores
    weights_TK = inp.weights_TK.contiguous()
    peers.update(tk_peer(tk, "tile_kernels.topk_gate", lambda tk: tk.moe.topk_gate(scores_TE, s.topk)))
    peers.update(tk_peer(tk, "tile_kernels.normalize_weight", lambda tk: tk.moe.normalize_weight(weights_TK)))
    return Case(
        "topk_route", lambda: routing.topk_route(logits, bias_E=bias, **opts), ref, (logits, bias),
        bytes=nbytes(logits, bias) + s.tokens * s.topk * (8 + 4),
        bytes_note="read logits [T,E] f32 + bias; write idx [T,K] i64 + weights [T,K] f32",
        exact=False, peers=peers,
        # normalize_weight alone is a sliver of the router; topk_gate (plain top-k over ready
        # scores, no groups) is the comparison the router is held to.
        partial_peers=("tile_kernels.normalize_weight",),
    )


def _case_topk_route_with_counts(inp: Inputs, tk) -> Case:
    from kernels import routing
    from kernels.routing import reference

    s, opts = inp.shape, inp.router_options
    logits, bias = inp.logits_TE, inp.bias_E

    def ref(logits_TE, bias_E):
        idx, w = reference.topk_route(logits_TE, bias_E=bias_E, **opts)
        return idx, w, reference.expert_counts(idx, s.experts)

    def unfused():
        idx, w = routing.topk_route(logits, bias_E=bias, **opts)
        return idx, w, routing.expert_counts(idx, s.experts)

    route_bytes = nbytes(logits, bias) + s.tokens * s.topk * 12
    return Case(
        "topk_route_with_counts", lambda: routing.topk_route_with_counts(logits, bias_E=bias, **opts), ref,
        (logits, bias), bytes=route_bytes + s.experts * 4,
        bytes_note="topk_route's bytes + write counts [E] i32", exact=False,
        unfused=unfused, unfused_bytes=route_bytes + s.tokens * s.topk * 8 + s.experts * 4,
        unfused_note="topk_route, then expert_counts (reads idx [T,K] i64 again)",
    )


def _case_topk_route_sqrtsoftplus(inp: Inputs, tk) -> Case:
    """The configuration tile-kernels' ``moe_topk_gate_forward`` computes: sqrt-softplus scores,
    bias, plain top-k (no groups), normalized and scaled weights."""
    from kernels import routing
    from kernels.routing import reference

    s = inp.shape
    opts = dict(topk=s.topk, scoring="sqrtsoftplus", normalize=True, routed_scaling_factor=s.routed_scaling_factor)
    logits, bias = inp.logits_TE, inp.bias_E

    def ref(logits_TE, bias_E):
        return reference.topk_route(logits_TE, bias_E=bias_E, **opts)

    peers = tk_peer(
        tk, "tile_kernels.moe_topk_gate_forward",
        lambda tk: tk.moe.moe_topk_gate_forward(logits, s.topk, False, 0, s.routed_scaling_factor, 0,
                                                scoring_func="sqrtsoftplus", bias=bias),
    )
    return Case(
        "topk_route_sqrtsoftplus", lambda: routing.topk_route(logits, bias_E=bias, **opts), ref, (logits, bias),
        bytes=nbytes(logits, bias) + s.tokens * s.topk * 12, bytes_note="as topk_route", exact=False, peers=peers,
    )


def _case_expert_counts(inp: Inputs, tk) -> Case:
    from kernels import routing
    from kernels.routing import reference

    s, idx = inp.shape, inp.topk_idx_TK
    return Case(
        "expert_counts", lambda: routing.expert_counts(idx, s.experts),
        lambda topk_idx_TK: reference.expert_counts(topk_idx_TK, s.experts), (idx,),
        bytes=nbytes(idx) + s.experts * 4, bytes_note="read idx [T,K] i64; write counts [E] i32",
    )


CASES: dict[str, Callable[..., Case]] = {
    "topk_route": _case_topk_route,
    "topk_route_with_counts": _case_topk_route_with_counts,
    "topk_route_sqrtsoftplus": _case_topk_route_sqrtsoftplus,
    "expert_counts": _case_expert_counts,
}
