"""``bench kernels`` cases of ``kernels.routing``: the router (three configurations), the gate to
physical replicas and the per-expert counts."""

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


def _case_gate(inp: Inputs, tk) -> Case:
    """The router with counts and a replica pick from a map of up to two replicas an expert (what
    the MoE layer runs with a placement)."""
    from kernels import routing
    from kernels.routing import PhysicalMap, reference
    from kernels.testing import physical_map_inputs

    s, opts = inp.shape, inp.router_options
    logits, bias = inp.logits_TE, inp.bias_E
    log2phy_ER, fraction_ER, num_physical = physical_map_inputs(s.experts, 2)
    physical_map = PhysicalMap.from_replicas(
        log2phy_ER, fraction_ER, num_physical=num_physical, token_step=0.6180339887498949, source_term=0.0,
        expert_term_E=torch.arange(s.experts, dtype=torch.float64) * 0.7548776662466927).to(logits.device)

    def ref(logits_TE, bias_E):
        routes = reference.gate(logits_TE, bias_E=bias_E, physical_map=physical_map, with_counts=True, **opts)
        return routes.physical_idx_TK, routes.weights_TK, routes.counts_E

    def ours():
        routes = routing.gate(logits, bias_E=bias, physical_map=physical_map, with_counts=True, **opts)
        return routes.physical_idx_TK, routes.weights_TK, routes.counts_E

    def unfused():
        idx, w, counts = routing.topk_route_with_counts(logits, bias_E=bias, **opts)
        return routing.physical_routes(idx, physical_map), w, counts

    route_bytes = nbytes(logits, bias) + s.tokens * s.topk * 12 + s.experts * 4
    map_bytes = nbytes(physical_map.log2phy_ER, physical_map.cdf_ER, physical_map.expert_term_E)
    return Case(
        "gate", ours, ref, (logits, bias), bytes=route_bytes + map_bytes,
        bytes_note="topk_route_with_counts' bytes + read the map [E,R] i32 + f64 + [E] f64", exact=False,
        unfused=unfused, unfused_bytes=route_bytes + map_bytes + s.tokens * s.topk * 16,
        unfused_note="topk_route_with_counts, then the reference's replica pick (reads idx [T,K] i64, writes [T,K] i64)",
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
    "gate": _case_gate,
    "expert_counts": _case_expert_counts,
}
