"""The routing gate's reference: the replica rule against the planner's, and each gate stage
(shared routes, token mask, fixed routes) against the router it extends."""

import pytest
import torch

from kernels.routing import PhysicalMap, gate, physical_routes, reference, topk_route, topk_weights
from kernels.testing import physical_map_inputs, router_inputs
from topology.routing import choose_replicas, draw_terms

OPTIONS = {"topk": 4, "scoring": "sigmoid", "num_groups": 4, "topk_groups": 2, "normalize": True,
           "routed_scaling_factor": 2.5}


def planner_map(num_rows: int, max_replicas: int, source: int, seed: int) -> tuple[PhysicalMap, tuple]:
    log2phy_ER, fraction_ER, num_physical = physical_map_inputs(num_rows, max_replicas, seed=seed)
    token_step, source_term, expert_term_E = draw_terms(source, num_rows)
    physical_map = PhysicalMap.from_replicas(log2phy_ER, fraction_ER, num_physical=num_physical, token_step=token_step,
                                             source_term=source_term, expert_term_E=expert_term_E)
    return physical_map, (log2phy_ER, fraction_ER)


@pytest.mark.parametrize("num_tokens", [0, 1, 37, 513])
@pytest.mark.parametrize("source", [0, 5])
def test_replicas_are_the_planners_picks(seed, num_tokens, source):
    physical_map, (log2phy_ER, fraction_ER) = planner_map(24, 3, source, seed)
    routes_TK = torch.randint(-1, 24, (num_tokens, 6))
    got = physical_routes(routes_TK, physical_map)
    e_TK = routes_TK.clamp(min=0)
    want = choose_replicas(routes_TK, fraction_ER[e_TK], log2phy_ER[e_TK], torch.arange(num_tokens), source)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert bool((got[routes_TK < 0] == -1).all()) and bool((got[routes_TK >= 0] >= 0).all())


def test_replicas_share_the_routes_by_their_fractions(seed):
    """Over consecutive tokens every replica receives its share of an expert's routes."""
    physical_map, (log2phy_ER, fraction_ER) = planner_map(6, 4, 1, seed)
    num_tokens = 20000
    got = physical_routes(torch.arange(6).repeat(num_tokens, 1), physical_map)
    for e in range(6):
        for r in range(int((log2phy_ER[e] >= 0).sum())):
            share = float((got[:, e] == log2phy_ER[e, r]).float().mean())
            assert abs(share - float(fraction_ER[e, r])) < 2e-3, (e, r)


def test_the_largest_draw_stays_off_replicas_without_a_share():
    """u just below 1 picks the last replica with a share, never one after it (share 0) or padding."""
    physical_map = PhysicalMap.from_replicas(torch.tensor([[3, 1, -1], [0, 2, 1]]),
                                             torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0]], dtype=torch.float64),
                                             num_physical=4, token_step=0.0, source_term=1.0 - 2.0**-53,
                                             expert_term_E=torch.zeros(2, dtype=torch.float64))
    assert physical_routes(torch.tensor([[0, 1]]), physical_map).tolist() == [[3, 2]]
    assert physical_map.log2phy_ER.tolist() == [[3, 1, 1], [0, 2, 1]]  # padding repeats the last replica


@pytest.mark.parametrize("num_tokens", [0, 1, 37, 300])
def test_gate_without_its_stages_is_the_router(seed, num_tokens):
    logits_TE, bias_E = router_inputs(num_tokens, 16, seed=seed)
    got = gate(logits_TE, bias_E=bias_E, with_counts=True, **OPTIONS)
    idx_TK, weights_TK = topk_route(logits_TE, bias_E=bias_E, **OPTIONS)
    assert torch.equal(got.physical_idx_TK, idx_TK) and torch.equal(got.logical_idx_TK, idx_TK)
    assert torch.equal(got.weights_TK, weights_TK)
    assert torch.equal(got.counts_E, reference.expert_counts(idx_TK, 16))
    assert gate(logits_TE, **OPTIONS).counts_E is None


@pytest.mark.parametrize("num_tokens", [0, 1, 37, 300])
def test_every_stage_together(seed, num_tokens):
    """Fixed rows take their routes, masked rows lose all (shared ones too), shared routes follow
    with weight 1, and every route goes through the map."""
    logits_TE, bias_E = router_inputs(num_tokens, 16, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    mask_T = torch.rand(num_tokens, generator=gen) < 0.8
    fixed_T = torch.rand(num_tokens, generator=gen) < 0.3
    fixed_idx_TK = torch.rand(num_tokens, 16, generator=gen).argsort(1)[:, :4]
    fixed_idx_TK[:, 3] = -1
    physical_map, _ = planner_map(18, 3, 2, seed)
    got = gate(logits_TE, bias_E=bias_E, physical_map=physical_map, num_shared=2, token_mask_T=mask_T, fixed_T=fixed_T,
               fixed_idx_TK=fixed_idx_TK, with_counts=True, **OPTIONS)

    logical_TK = topk_route(logits_TE, bias_E=bias_E, **OPTIONS)[0]
    logical_TK = torch.where(fixed_T[:, None], fixed_idx_TK, logical_TK)
    logical_TK = torch.where(mask_T[:, None], logical_TK, -1)
    assert torch.equal(got.logical_idx_TK, logical_TK)
    shared_TN = torch.where(mask_T[:, None], torch.tensor([16, 17]), -1)
    assert torch.equal(got.physical_idx_TK, physical_routes(torch.cat([logical_TK, shared_TN], 1), physical_map))
    weights_TK = topk_weights(logits_TE, logical_TK, scoring="sigmoid", normalize=True, routed_scaling_factor=2.5)
    assert torch.equal(got.weights_TK, torch.cat([weights_TK, mask_T[:, None].float().expand(-1, 2)], 1))
    assert torch.equal(got.counts_E, reference.expert_counts(logical_TK, 16))
    assert got.physical_idx_TK.shape == (num_tokens, 6) and got.weights_TK.shape == (num_tokens, 6)


def test_weights_keep_their_gradient(seed):
    logits_TE = router_inputs(9, 16, seed=seed)[0].requires_grad_()
    routes = gate(logits_TE, num_shared=1, **OPTIONS)
    routes.weights_TK[:, :4].sum().backward()
    assert logits_TE.grad is not None and bool(logits_TE.grad.abs().sum() > 0)


def bad_calls():
    logits_TE = torch.randn(5, 16)
    fixed_idx_TK = torch.zeros(5, 4, dtype=torch.int64)
    fixed_T = torch.ones(5, dtype=torch.bool)
    physical_map = planner_map(16, 2, 0, 0)[0]
    return [
        (lambda: gate(logits_TE, num_shared=-1, **OPTIONS), ValueError, "num_shared"),
        (lambda: gate(logits_TE, fixed_T=fixed_T, **OPTIONS), ValueError, "fixed_idx_TK"),
        (lambda: gate(logits_TE, fixed_T=fixed_T, fixed_idx_TK=fixed_idx_TK + 16, **OPTIONS), ValueError, "fixed_idx_TK"),
        (lambda: gate(logits_TE, fixed_T=fixed_T, fixed_idx_TK=fixed_idx_TK[:, :3], **OPTIONS), ValueError,
         "fixed_idx_TK"),
        (lambda: gate(logits_TE, fixed_T=fixed_T.int(), fixed_idx_TK=fixed_idx_TK, **OPTIONS), TypeError, "fixed_T"),
        (lambda: gate(logits_TE, token_mask_T=fixed_T[:4], **OPTIONS), ValueError, "token_mask_T"),
        (lambda: gate(logits_TE, token_mask_T=fixed_T.float(), **OPTIONS), TypeError, "token_mask_T"),
        (lambda: gate(logits_TE, physical_map=physical_map, num_shared=1, **OPTIONS), ValueError, "physical_map"),
        (lambda: gate(logits_TE, physical_map=physical_map.log2phy_ER, **OPTIONS), TypeError, "physical_map"),
        (lambda: physical_routes(torch.tensor([[16]]), physical_map), ValueError, "routes_TK"),
        (lambda: PhysicalMap.from_replicas(torch.tensor([[0], [-1]]), torch.ones(2, 1, dtype=torch.float64),
                                           num_physical=1, token_step=0.5, source_term=0.0,
                                           expert_term_E=torch.zeros(2, dtype=torch.float64)), ValueError, "log2phy_ER"),
        (lambda: PhysicalMap.from_replicas(torch.tensor([[0], [1]]), -torch.ones(2, 1, dtype=torch.float64),
                                           num_physical=2, token_step=0.5, source_term=0.0,
                                           expert_term_E=torch.zeros(2, dtype=torch.float64)), ValueError, "fraction_ER"),
        (lambda: PhysicalMap(log2phy_ER=physical_map.log2phy_ER, cdf_ER=physical_map.cdf_ER.float(),
                             expert_term_E=physical_map.expert_term_E, token_step=0.5, source_term=0.0),
         TypeError, "cdf_ER"),
    ]


@pytest.mark.parametrize("index", range(13))
def test_bad_input_names_the_argument(index):
    call, error, argname = bad_calls()[index]
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()
