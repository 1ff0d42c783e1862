"""The MoE layer on one process against its independent specification (``moe_spec``): the output
and every gradient (input, router, each routed expert, the shared expert), for each router option
changed one at a time from a base case, FP8 dispatch, the balance loss, and the rule that gives
each expert its initial weights. Each case also checks that it exercises what it claims (the bias
changes some picks, normalizing changes the weights, tokens reach several experts), so that a layer
that drops one of them cannot pass."""

import pytest
import torch
import torch.nn.functional as F
from moe_spec import (F64, RouterSpec, assert_close, balance_loss, fp4_roundtrip, initial_expert_weights, moe_layer,
                      params_of, route, scaled_error)

from ep_runtime.config import MoEConfig, RouterConfig
from ep_runtime.dispatch import AllToAllDispatcher
from ep_runtime.experts import GroupedExperts
from ep_runtime.moe import MoELayer

HIDDEN, INTER, EXPERTS, SEED = 24, 12, 8, 5
TOL = 1e-5  # float32 layer vs float64 spec, per tensor (moe_spec.scaled_error)

BASE = dict(scoring="sigmoid", topk=2, normalize=True)
ROUTERS = {  # one option away from BASE each; the pairs that interact together
    "base": {},
    "softmax": dict(scoring="softmax"),
    "sqrtsoftplus": dict(scoring="sqrtsoftplus"),
    "top1-unnormalized": dict(topk=1, normalize=False),  # normalized, one weight is 1: no router gradient
    "top3-groups": dict(topk=3, num_groups=4, topk_groups=2),
    "groups-of-one": dict(num_groups=8, topk_groups=3),
    "unnormalized-scaled": dict(normalize=False, routed_scaling_factor=2.5),
    "softmax-normalized-scaled": dict(scoring="softmax", routed_scaling_factor=1.5),
}


def make_layer(router: dict, *, shared: int = 1, wire: str = "bf16", alignment: int = 4,
               fp8_combine: bool = False) -> MoELayer:
    cfg = MoEConfig(num_experts=EXPERTS, expert_hidden=INTER, num_shared_experts=shared, alignment=alignment,
                    dispatch_format=wire, fp8_combine=fp8_combine, router=RouterConfig(**(BASE | router)))
    dispatcher = AllToAllDispatcher(num_experts=EXPERTS, alignment=alignment, dispatch_format=wire,
                                    fp8_combine=fp8_combine)
    layer = MoELayer(cfg, HIDDEN, dispatcher, ep_rank=0, seed=SEED)
    with torch.no_grad():  # a bias large enough to change picks (it steers selection only)
        layer.router.bias_E.copy_(torch.linspace(-0.1, 0.1, EXPERTS)[torch.randperm(EXPERTS)])
    return layer


def run_layer(layer: MoELayer, x_BSD: torch.Tensor, g_BSD: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x_BSD.clone().requires_grad_()
    out = layer(x)
    (out * g_BSD).sum().backward()
    got = {"out": out.detach(), "grad_x": x.grad, "router": layer.router.weight.grad}
    w13, w2 = layer.experts.w13_EDI2.grad, layer.experts.w2_EID.grad
    for e in range(EXPERTS):
        got |= {f"expert{e}.gate": w13[e, :, :INTER], f"expert{e}.up": w13[e, :, INTER:], f"expert{e}.down": w2[e]}
    if layer.shared is not None:
        w13s, w2s = layer.shared.w13.weight.grad.T, layer.shared.w2.weight.grad.T
        inter = w13s.shape[1] // 2
        got |= {"shared.gate": w13s[:, :inter], "shared.up": w13s[:, inter:], "shared.down": w2s}
    return got


def run_spec(layer: MoELayer, x_BSD: torch.Tensor, g_BSD: torch.Tensor, *, wire: str = "bf16", params=None):
    p = params if params is not None else params_of(layer)
    x = x_BSD.flatten(0, 1).to(F64).requires_grad_()
    out, routes = moe_layer(x, p, RouterSpec.of(layer.cfg.router), wire=wire)
    (out * g_BSD.flatten(0, 1).to(F64)).sum().backward()
    want = {"out": out.detach().view(x_BSD.shape), "grad_x": x.grad.view(x_BSD.shape)}
    grads = {name: t.grad if t.grad is not None else torch.zeros_like(t) for name, t in p.leaves().items()}
    return want | grads, routes


def compare(got: dict, want: dict, tol: float = TOL) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert_close(name, got[name], want[name], tol)


@pytest.mark.parametrize("case", sorted(ROUTERS))
def test_layer_matches_the_spec(case, seed):
    layer = make_layer(ROUTERS[case])
    x, g = torch.randn(3, 10, HIDDEN), torch.randn(3, 10, HIDDEN)
    want, routes = run_spec(layer, x, g)
    compare(run_layer(layer, x, g), want)
    # what the case exercises: the layer's own picks, the bias, several experts, normalized weights
    assert sorted(map(sorted, layer.router(x.flatten(0, 1)).topk_idx_TK.tolist())) == sorted(map(sorted, routes))
    p, r = params_of(layer), RouterSpec.of(layer.cfg.router)
    unbiased = p.__class__(router=p.router, bias=torch.zeros_like(p.bias), experts=p.experts, shared=p.shared)
    assert any(route(t, p, r)[0] != route(t, unbiased, r)[0] for t in x.flatten(0, 1).double()), "bias idle"
    assert len({e for rt in routes for e in rt}) >= 6, routes
    used = {f"expert{e}" for rt in routes for e in rt}
    for name, t in want.items():  # an expert no token reached has a zero gradient: it is compared too
        assert t.abs().max() > 0 or name.split(".")[0] not in used | {"out", "grad_x", "router", "shared"}, name


def test_the_shared_expert_and_its_width(seed):
    """Two shared experts make one MLP twice as wide; none leaves the routed sum alone."""
    x, g = torch.randn(2, 6, HIDDEN), torch.randn(2, 6, HIDDEN)
    for shared in (0, 2):
        layer = make_layer({}, shared=shared)
        want, _ = run_spec(layer, x, g)
        compare(run_layer(layer, x, g), want)
        assert (layer.shared is None) == (shared == 0)
        if shared:
            assert layer.shared.w2.weight.shape == (HIDDEN, 2 * INTER)


@pytest.mark.parametrize("alignment, fp8_combine", [(1, False), (8, True)])
def test_fp8_dispatch_is_the_spec_of_the_cast_tokens(alignment, fp8_combine, seed):
    """FP8 dispatch: the experts see the e4m3 round trip of their tokens (per token and 128
    columns: hidden 160 is one full group and a ragged one), exactly as the spec casts them; the
    spec without the cast is off by the cast's error, which is at most 2^-4 of a group's largest
    magnitude per element, a stated bound this checks too. FP8 rows home (``fp8_combine``) change
    nothing on one process: a rank's rows for itself stay in their dtype."""
    global HIDDEN
    hidden, HIDDEN = HIDDEN, 160
    try:
        layer = make_layer({}, wire="e4m3", alignment=alignment, fp8_combine=fp8_combine)
        x, g = torch.randn(2, 8, HIDDEN), torch.randn(2, 8, HIDDEN)
        x[0, 0, 5] = 40.0  # one large value: its group's scale, not the token's other group's
        want, _ = run_spec(layer, x, g, wire="e4m3")
        got = run_layer(layer, x, g)
        compare(got, want)
        exact, _ = run_spec(layer, x, g)
        assert scaled_error(got["out"], exact["out"]) > 10 * TOL  # the cast is seen
        assert (got["out"] - exact["out"]).abs().max() <= 2.0**-4 * float(exact["out"].abs().max())
    finally:
        HIDDEN = hidden


def test_fp4_dispatch_is_the_spec_of_the_cast_tokens(seed):
    """FP4 dispatch: the experts see the e2m1 round trip of their tokens under two levels of scales
    (per token, and e4m3 per 16 columns: hidden 40 is two full groups and a ragged one), exactly as
    the spec casts them. The stated error: a value an expert sees is within half the top e2m1 step
    (2 scale units) of its group's scale, which e4m3 rounding makes at most ``amax / 6 * 17/16``:
    within ``amax / 6 * 17/16`` of the token's value, per group of 16 columns. The layer's output
    is then off by at most a quarter of its largest magnitude here."""
    global HIDDEN
    hidden, HIDDEN = HIDDEN, 40
    try:
        layer = make_layer({}, wire="e2m1")
        x, g = torch.randn(2, 8, HIDDEN), torch.randn(2, 8, HIDDEN)
        x[0, 0, 5] = 40.0  # one large value: the token's scale; its other groups' e4m3 scales are small
        want, _ = run_spec(layer, x, g, wire="e2m1")
        got = run_layer(layer, x, g)
        compare(got, want)
        tokens = x.flatten(0, 1).double()
        seen = torch.stack([fp4_roundtrip(t) for t in tokens])
        amax = F.pad(tokens.abs(), (0, -HIDDEN % 16)).view(tokens.shape[0], -1, 16).amax(2)
        bound = (amax / 6 * 17 / 16).repeat_interleave(16, 1)[:, :HIDDEN]
        assert ((seen - tokens).abs() <= bound).all()
        exact, _ = run_spec(layer, x, g)
        assert scaled_error(got["out"], exact["out"]) > 10 * TOL  # the cast is seen
        assert (got["out"] - exact["out"]).abs().max() <= 0.25 * float(exact["out"].abs().max())
    finally:
        HIDDEN = hidden


def test_balance_loss_matches_the_spec(seed):
    layer = make_layer(dict(aux_loss_coef=0.03))
    x = torch.randn(3, 7, HIDDEN)
    layer(x)
    layer.aux_loss.backward()
    p = params_of(layer)
    want = balance_loss(x, p, RouterSpec.of(layer.cfg.router), 0.03)
    want.backward()
    got, want_value = float(layer.aux_loss.detach()), float(want.detach())
    assert abs(got - want_value) <= 1e-6 * abs(want_value), (got, want_value)
    assert_close("router", layer.router.weight.grad, p.router.grad, TOL)


def test_initial_weights_follow_each_experts_seed():
    """Slot ``i`` of a rank holding experts 4..7 (or a placement's logical experts) starts as the
    spec's expert ``4 + i`` (or its logical expert), whatever the other slots."""
    for first, logical in ((0, None), (4, None), (0, (6, 1, 6, 3))):
        experts = GroupedExperts(4, HIDDEN, INTER, first_expert=first, seed=SEED, logical_ids=logical)
        ids = logical or tuple(range(first, first + 4))
        assert experts.logical_ids == ids
        for slot, expert in enumerate(ids):
            w13, w2 = initial_expert_weights(SEED, expert, HIDDEN, INTER)
            assert torch.equal(experts.w13_EDI2[slot].detach(), w13), (first, logical, slot)
            assert torch.equal(experts.w2_EID[slot].detach(), w2), (first, logical, slot)
    a, b = initial_expert_weights(SEED, 0, HIDDEN, INTER), initial_expert_weights(SEED, 1, HIDDEN, INTER)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])


def test_a_swap_of_two_experts_is_seen(seed):
    """The comparison tells experts apart: the spec with experts 0 and 1 exchanged is far off."""
    layer = make_layer({})
    x, g = torch.randn(2, 10, HIDDEN), torch.randn(2, 10, HIDDEN)
    got = run_layer(layer, x, g)
    p = params_of(layer)
    swapped = p.__class__(router=p.router, bias=p.bias, experts=(p.experts[1], p.experts[0], *p.experts[2:]),
                          shared=p.shared)
    want, routes = run_spec(layer, x, g, params=swapped)
    assert any(0 in r or 1 in r for r in routes)
    assert scaled_error(got["out"], want["out"]) > 1000 * TOL


def test_scaled_error_binds_on_every_element():
    """A corruption of one element by 1% of the tensor's RMS, or zeroing its smallest tenth, fails
    a tolerance of TOL; float32 rounding of the same tensor passes."""
    g = torch.Generator().manual_seed(0)
    want = torch.randn(64, 48, generator=g, dtype=F64) * torch.logspace(-3, 1, 48, dtype=F64)
    assert scaled_error(want.float(), want) <= TOL
    rms = float(want.square().mean().sqrt())
    for index in ((0, 0), (63, 47), (17, 3)):
        bad = want.clone()
        bad[index] += 0.01 * rms
        assert scaled_error(bad, want) > TOL, index
    smallest = want.abs() <= want.abs().quantile(0.1)
    zeroed = torch.where(smallest, 0.0, want)
    assert scaled_error(zeroed, want) > TOL
    assert scaled_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert scaled_error(torch.ones(3), torch.zeros(3)) == float("inf")
