"""The MoE layer as the README uses it on one process: bad construction and input are named, a
batch without tokens passes, ``update_bias`` balances without an auxiliary loss, the router's
bias stays float32 through module casts and its weights and balance loss add no host sync, and
the experts' grouped-GEMM (CUDA) path equals their loop."""

import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

import ep_runtime.experts as experts_module
from ep_runtime.config import MoEConfig, RouterConfig
from ep_runtime.dispatch import AllToAllDispatcher
from ep_runtime.experts import GroupedExperts, SwiGLUFn
from ep_runtime.moe import MoELayer
from kernels.permute import max_rows

HIDDEN = 16


def layer(num_experts=8, **router):
    cfg = MoEConfig(num_experts=num_experts, expert_hidden=8, alignment=1, router=RouterConfig(**router))
    return MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=num_experts, alignment=1), ep_rank=0, seed=0)


def test_bad_construction_and_input_are_named():
    cfg = MoEConfig(num_experts=8, expert_hidden=8, alignment=1)
    with pytest.raises(ValueError, match=r"^ep_rank: expected 0\.\.0"):
        MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=8, alignment=1), ep_rank=3, seed=0)
    with pytest.raises(ValueError, match="^dispatcher.num_experts: expected model.moe.num_experts=8"):
        MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=16, alignment=1), ep_rank=0, seed=0)
    rank_1 = types.SimpleNamespace(num_experts=8, num_local_experts=4, ep_rank=1)  # rank 1 of an EP group of 2
    with pytest.raises(ValueError, match=r"^ep_rank: expected the dispatcher's rank in its EP group, 1 .* got 0"):
        MoELayer(cfg, HIDDEN, rank_1, ep_rank=0, seed=0)
    with pytest.raises(ValueError, match=r"^ep_rank: expected 0\.\.0 \(the dispatcher's EP size 1\), got 1$"):
        MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=8, alignment=1), ep_rank=1, seed=0)
    with pytest.raises(ValueError, match="^num_experts: expected a positive int, got 0"):
        AllToAllDispatcher(num_experts=0)
    with pytest.raises(ValueError, match=r"^logical_ids: expected 2 experts, got 3$"):
        GroupedExperts(2, HIDDEN, 8, seed=0, logical_ids=(0, 1, 2))
    moe = layer()
    with pytest.raises(ValueError, match="^x_BSD: expected a 3-D tensor"):
        moe(torch.randn(10, HIDDEN))
    with pytest.raises(ValueError, match=r"^x_BSD: expected shape \('\*', '\*', 16\), got \(2, 5, 32\)"):
        moe(torch.randn(2, 5, 32))
    with pytest.raises(TypeError, match=r"^x_BSD: expected the layer's dtype torch.float32 \(or autocast\)"):
        moe(torch.randn(2, 5, HIDDEN, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe(torch.randn(2, 5, HIDDEN, dtype=torch.bfloat16)).shape == (2, 5, HIDDEN)


def test_a_fresh_layer_has_routed_nothing():
    moe = layer()
    assert moe.load_E.dtype == torch.int32 and torch.equal(moe.load_E, torch.zeros(8, dtype=torch.int32))
    assert float(moe.aux_loss) == 0 and moe.shared.w13.bias is None and moe.shared.w2.bias is None


def test_a_batch_without_tokens(seed):
    """It passes, and leaves no balance loss behind: not the last batch's (its graph long gone)."""
    moe = layer(aux_loss_coef=0.01)
    moe(torch.randn(2, 5, HIDDEN))
    assert float(moe.aux_loss.detach()) > 0
    plain = layer(aux_loss_coef=0.0)
    plain(torch.randn(2, 5, HIDDEN))
    assert not plain.aux_loss.requires_grad and float(plain.aux_loss) == 0  # disabled: no graph at all
    x = torch.randn(0, 5, HIDDEN, requires_grad=True)
    out = moe(x)
    out.sum().backward()
    assert out.shape == x.shape and int(moe.load_E.sum()) == 0 and float(moe.aux_loss) == 0


def test_update_bias_lowers_the_busy_experts(seed):
    moe = layer(bias_update_rate=0.01, topk=2)
    with torch.no_grad():
        moe.router.weight[0] += 5.0  # expert 0 wins every token
    moe(torch.randn(2, 8, HIDDEN).abs())
    before = moe.router.bias_E.clone()
    moe.update_bias()
    moved = moe.router.bias_E - before
    busy = moe.load_E.float() > moe.load_E.float().mean()
    assert bool((moved[busy] == -0.01).all()) and bool((moved[~busy] == 0.01).all())


def test_router_bias_stays_float32_through_module_casts():
    moe = layer(bias_update_rate=1e-3).to(torch.bfloat16)
    assert moe.router.weight.dtype == torch.bfloat16 and moe.router.bias_E.dtype == torch.float32
    moe.router.bias_E.fill_(0.5)
    moe.router.update_bias(torch.tensor([9, 1, 1, 1, 1, 1, 1, 1]))
    assert moe.router.bias_E[0] == torch.tensor(0.499, dtype=torch.float32)  # 0.5 - 1e-3, not rounded away
    with pytest.raises(ValueError, match=r"^load_E: expected shape \(8,\), got \(1,\)"):  # not broadcast
        moe.router.update_bias(torch.tensor([5]))


def test_make_dispatcher_without_a_group_is_the_identity_all_to_all_with_the_configs_options():
    """One process: whatever the backend named, tokens do not travel; the layout and FP8 options
    come from the config."""
    import dataclasses

    from ep_runtime.config import DISPATCHERS
    from ep_runtime.dispatch import (DeepEPDispatcher, Dispatcher, HierarchicalDispatcher, NVLinkDispatcher,
                                     make_dispatcher)
    from ep_runtime.parallel import single_process

    assert Dispatcher.backends == {"all_to_all": AllToAllDispatcher, "nvlink": NVLinkDispatcher,
                                   "deepep": DeepEPDispatcher, "hierarchical": HierarchicalDispatcher}
    ctx = single_process(torch.device("cpu"))
    for name in DISPATCHERS:
        cfg = MoEConfig(num_experts=16, alignment=16, dispatch_format="e4m3", fp8_combine=name != "deepep", dispatcher=name)
        d = make_dispatcher(cfg, ctx)
        assert type(d) is AllToAllDispatcher and d.group is None and (d.world, d.ep_rank) == (1, 0), name
        assert (d.num_experts, d.num_local_experts, d.alignment, d.dispatch_format, d.fp8_combine) == (
            16, 16, 16, "e4m3", name != "deepep"), name
    bad = MoEConfig()
    object.__setattr__(bad, "dispatcher", "mpi")  # past the config's own check
    with pytest.raises(ValueError, match=r"^model\.moe\.dispatcher: expected one of \('all_to_all', 'nvlink', "
                                         r"'deepep'\), got 'mpi'$"):
        make_dispatcher(bad, ctx)
    assert dataclasses.is_dataclass(bad)


def test_a_nan_router_logit_is_an_error():
    moe = layer()
    x = torch.randn(1, 4, HIDDEN)
    x[0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^router logits: expected finite values, got 8 NaN/Inf entries$"):
        moe(x)


def test_dispatch_backward_of_the_tokens_alone_and_of_masked_routes(seed):
    """Dispatch's backward when its weights reach nothing (zeros for them, each token's gradient
    the sum over its routes), when they need no gradient, and combine's weight gradient of a
    masked (-1) route (0, not a stray value)."""
    d = AllToAllDispatcher(num_experts=4, alignment=2)
    x = torch.randn(5, 3, requires_grad=True)
    idx = torch.tensor([[0, 2], [1, -1], [3, 0], [-1, -1], [2, 1]])
    w = torch.rand(5, 2, requires_grad=True)
    x_PD, _, _ = d.dispatch(x, idx, w)
    x_PD.sum().backward()
    assert torch.equal(w.grad, torch.zeros(5, 2))
    assert torch.equal(x.grad, (idx >= 0).sum(1, keepdim=True).float().expand(5, 3))
    x.grad = None
    x_PD, _, _ = d.dispatch(x, idx, w.detach())
    (2 * x_PD).sum().backward()
    assert torch.equal(x.grad, 2 * (idx >= 0).sum(1, keepdim=True).float().expand(5, 3))
    w.grad = None
    x_PD, layout, handle = d.dispatch(x, idx, w)
    # 2, 2, 2 and 1 routes to experts 0..3, each segment padded to alignment 2, in the static
    # capacity (nothing travels, so no host read trims it)
    assert layout.offsets_E.tolist() == [2, 4, 6, 8] and x_PD.shape == (max_rows(5, 2, 4, 2), 3)
    out = d.combine(x_PD, handle)  # identity experts: each token times its routed weights' sum
    assert torch.allclose(out, x * torch.where(idx >= 0, w, 0.0).sum(1, keepdim=True)) and not out[3].any()
    out.sum().backward()
    assert torch.equal(w.grad[idx < 0], torch.zeros(3))
    assert torch.allclose(w.grad[idx >= 0], x.detach().sum(1, keepdim=True).expand(5, 2)[idx >= 0])


@pytest.mark.parametrize("call, error, message", [
    (lambda d, x, idx, w: d.dispatch(x[None], idx, w), ValueError, "x_TD: expected a 2-D tensor, got shape (1, 5, 3)"),
    (lambda d, x, idx, w: d.dispatch(x.int(), idx, w), TypeError,
     "x_TD: expected dtype torch.float32 or torch.bfloat16 or torch.float16, got torch.int32"),
    (lambda d, x, idx, w: d.dispatch(x, idx.float(), w), TypeError,
     "topk_idx_TK: expected dtype torch.int64 or torch.int32, got torch.float32"),
    (lambda d, x, idx, w: d.dispatch(x, idx[:4], w), ValueError, "topk_idx_TK: expected shape (5, '*'), got (4, 2)"),
    (lambda d, x, idx, w: d.dispatch(x, idx.to("meta"), w), ValueError,
     "topk_idx_TK: expected a tensor on cpu, got one on meta"),
    (lambda d, x, idx, w: d.dispatch(x, idx, w.double()), TypeError,
     "topk_weights_TK: expected dtype torch.float32, got torch.float64"),
    (lambda d, x, idx, w: d.dispatch(x, idx, w[:, :1]), ValueError, "topk_weights_TK: expected shape (5, 2), got (5, 1)"),
    (lambda d, x, idx, w: d.dispatch(x, idx, w.to("meta")), ValueError,
     "topk_weights_TK: expected a tensor on cpu, got one on meta"),
    (lambda d, x, idx, w: d.combine(torch.zeros(3, 3), "handle"), TypeError,
     "handle: expected the DispatchHandle from dispatch, got str"),
    (lambda d, x, idx, w: d.combine(d.dispatch(x, idx, w)[0][:-1], d.dispatch(x, idx, w)[2]), ValueError,
     "y_PD: expected shape (14, '*'), got (13, 3)"),
    (lambda d, x, idx, w: d.combine(d.dispatch(x, idx, w)[0].double(), d.dispatch(x, idx, w)[2]), TypeError,
     "y_PD: expected dtype torch.float32 or torch.bfloat16 or torch.float16, got torch.float64"),
])
def test_bad_dispatch_and_combine_arguments_are_named(call, error, message):
    import re

    d = AllToAllDispatcher(num_experts=4, alignment=2)
    x, idx, w = torch.randn(5, 3), torch.tensor([[0, 2], [1, -1], [3, 0], [-1, -1], [2, 1]]), torch.rand(5, 2)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        call(d, x, idx, w)


def test_masked_tokens_reach_only_the_shared_experts(seed):
    """A token the mask leaves out gets no routed expert and adds no load; the others route as
    without a mask."""
    moe = layer(topk=2)
    x = torch.randn(2, 5, HIDDEN)
    mask_BS = torch.rand(2, 5) < 0.6
    mask_BS[0, 0], mask_BS[1, 4] = True, False
    out = moe(x, mask_BS)
    load_E = moe.load_E.clone()
    plain = moe(x)
    x_TD = x.flatten(0, 1)
    routes_TK = moe.router(x_TD).topk_idx_TK
    assert int(load_E.sum()) == 2 * int(mask_BS.sum())
    assert torch.equal(load_E, torch.bincount(routes_TK[mask_BS.flatten()].flatten(), minlength=8).int())
    torch.testing.assert_close(out[~mask_BS], moe.shared(x_TD)[~mask_BS.flatten()])
    torch.testing.assert_close(out[mask_BS], plain[mask_BS])
    with pytest.raises(ValueError, match=r"^token_mask_BS: expected a 2-D tensor, got shape \(10,\)"):
        moe(x, mask_BS.flatten())
    with pytest.raises(TypeError, match=r"^token_mask_BS: expected dtype torch.bool, got torch.int64$"):
        moe(x, mask_BS.long())
    with pytest.raises(ValueError, match=r"^token_mask_BS: expected a tensor on cpu, got one on meta$"):
        moe(x, mask_BS.to("meta"))


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values into Python (on a GPU, each is a host sync)."""

    READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", None) in self.READS
        return func(*args, **(kwargs or {}))


def test_the_router_weights_and_balance_loss_add_no_host_sync(seed):
    """The router checks its logits once; its differentiable weights and the balance loss skip
    the value checks of the reference ops (a sync each on a GPU) on those checked logits."""
    from kernels.routing import gate, score, sequence_balance_stats
    from kernels.validate import check_finite

    router = layer(topk=2, aux_loss_coef=0.01).router
    c = router.cfg
    with HostReads() as forward:
        routing = router(torch.randn(2 * 5, HIDDEN))
    with HostReads() as routes:
        check_finite("router logits", routing.logits_TE)
        gate(routing.logits_TE, topk=c.topk, scoring=c.scoring, bias_E=router.bias_E, num_groups=c.num_groups,
             topk_groups=c.topk_groups, with_counts=True)
    assert forward.count == routes.count > 0
    scores_BSE = score(routing.logits_TE, c.scoring, values=False).unflatten(0, (2, 5))
    with HostReads() as loss:
        router.balance_loss(routing, batch=2)
    with HostReads() as stats:
        sequence_balance_stats(scores_BSE, routing.topk_idx_TK.unflatten(0, (2, 5)))
    assert loss.count == stats.count


def _record_rows(monkeypatch, name):
    """The ``rows`` bound of every call of ``ep_runtime.experts.<name>`` (which still runs)."""
    bounds, original = [], getattr(experts_module, name)

    def recorded(*args, rows=None, **kwargs):
        bounds.append(rows)
        return original(*args, rows=rows, **kwargs)

    monkeypatch.setattr(experts_module, name, recorded)
    return bounds


def test_swiglu_fn_hands_its_row_bound_to_both_ops(seed, monkeypatch):
    """Rows past the bound are unspecified (the CPU reference computes them, a GPU kernel skips
    them): what SwiGLUFn owes is the bound, forward and backward."""
    forward_rows, backward_rows = _record_rows(monkeypatch, "swiglu"), _record_rows(monkeypatch, "swiglu_backward")
    x_TI2 = torch.randn(6, 16, requires_grad=True)
    rows = torch.tensor([4], dtype=torch.int32)
    SwiGLUFn.apply(x_TI2, rows).sum().backward()
    assert forward_rows == [rows] and backward_rows == [rows]


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: which path GroupedExperts takes, seen on the CPU."""

    @property
    def is_cuda(self):
        return True


def _scaled_error(got, want):
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max())


def test_the_grouped_gemm_path_equals_the_loop(seed, monkeypatch):
    """``torch._grouped_mm`` runs on the CPU too: the CUDA path in bfloat16 against the float32 loop,
    forward and backward, with an expert without tokens and capacity rows past the last segment
    (unspecified in the grouped path, whose SwiGLU gets the bound)."""
    experts = GroupedExperts(4, HIDDEN, 8, seed=seed)
    assert experts.logical_ids == (0, 1, 2, 3)  # slots hold experts 0.. by default
    idx = torch.tensor([[0, 2], [2, -1], [3, 0], [-1, -1], [2, 0], [3, 2]])  # none to expert 1
    x_PD, layout, _ = AllToAllDispatcher(num_experts=4, alignment=1).dispatch(torch.randn(6, HIDDEN), idx,
                                                                             torch.rand(6, 2))
    n = int(layout.offsets_E[-1])
    x_PD = torch.cat([x_PD[:n], torch.randn(5, HIDDEN)]).requires_grad_()
    assert layout.offsets_E.tolist() == [3, 3, 7, 9] and x_PD.shape[0] == n + 5
    forward_rows, backward_rows = _record_rows(monkeypatch, "swiglu"), _record_rows(monkeypatch, "swiglu_backward")
    grouped, looped = experts._grouped(x_PD, layout), experts._looped(x_PD, layout)
    assert grouped.dtype == torch.float32
    assert _scaled_error(grouped[:n], looped[:n]) < 2e-2  # bfloat16 GEMMs
    grad_PD = torch.randn_like(looped)[:n]
    params = (x_PD, experts.w13_EDI2, experts.w2_EID)
    got_x, *got_w = torch.autograd.grad(grouped[:n], params, grad_PD)
    want_x, *want_w = torch.autograd.grad(looped[:n], params, grad_PD)
    for got, want in zip([got_x[:n], *got_w], [want_x[:n], *want_w]):  # capacity rows' gradients: unspecified
        assert _scaled_error(got, want) < 2e-2
    # The grouped path's calls first, then the loop's (its 3 experts with tokens, no bound).
    bound = layout.offsets_E[-1:]
    assert torch.equal(forward_rows[0], bound) and torch.equal(backward_rows[0], bound)
    assert forward_rows[1:] == backward_rows[1:] == [None] * 3
    with torch.no_grad():
        picked = experts(x_PD.detach().as_subclass(_ClaimsCuda), layout).as_subclass(torch.Tensor)
    assert torch.equal(picked[:n], grouped[:n].detach())


def test_centered_router_inputs_are_causal_and_leave_masked_tokens_out():
    """``center_inputs``: each token routed by its input minus the mean of its sequence's inputs up
    to it, by hand; a later token, another sequence or a masked token changes none of its logits."""
    moe = layer(topk=2, center_inputs=True)
    router, batch, seq = moe.router, 2, 5
    x = torch.randn(batch * seq, 16, generator=torch.Generator().manual_seed(0))
    x_BSD = x.view(batch, seq, 16)
    mean_BSD = torch.stack([x_BSD[:, :s + 1].mean(1) for s in range(seq)], dim=1)
    want = (x_BSD - mean_BSD).reshape(-1, 16) @ router.weight.detach().T
    logits = router(x, batch=batch).logits_TE
    torch.testing.assert_close(logits, want)
    later = x.clone()
    later[3] += 10  # the fourth token of the first sequence
    changed = (router(later, batch=batch).logits_TE != logits).any(1)
    assert changed.tolist() == [False, False, False, True, True] + [False] * seq
    mask = torch.ones(batch * seq, dtype=torch.bool)
    mask[1] = False
    masked = router(x, batch=batch, token_mask_T=mask).logits_TE
    other = x.clone()
    other[1] += 10
    again = router(other, batch=batch, token_mask_T=mask).logits_TE
    assert torch.equal(again[mask], masked[mask]) and not torch.equal(masked, logits)
    whole = x_BSD[0].reshape(seq, 16)  # one sequence alone routes as it does beside the other
    torch.testing.assert_close(router(whole, batch=1).logits_TE, logits[:seq])
    for bad in (None, 0, 4):  # 4 does not divide the 10 tokens
        with pytest.raises(ValueError, match=f"^batch: expected .* dividing the 10 tokens .*, got {bad}$"):
            router(x, batch=bad)
    out = moe(x_BSD.clone().requires_grad_())  # the layer passes its sequences
    out.sum().backward()
    assert out.shape == x_BSD.shape and torch.isfinite(out).all()
    assert torch.equal(moe.load_E, router(x, batch=batch).counts_E)
    assert not torch.equal(moe.load_E, router(x, batch=seq).counts_E)  # 5 sequences of 2 would route otherwise
    with pytest.raises(ValueError, match="^model.moe.router.center_inputs: expected a bool"):
        RouterConfig(center_inputs=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch_format", ["bf16", "e4m3"])
def test_one_rank_dispatch_and_combine_never_sync(dispatch_format):
    """Nothing travels in an EP group of one rank, so dispatch, combine and their backward issue
    their work without waiting for the GPU (torch's sync debug mode raises on any host sync)."""
    torch.manual_seed(0)
    d = AllToAllDispatcher(num_experts=32, alignment=128, dispatch_format=dispatch_format)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.rand(512, 32, device="cuda").topk(8, dim=1).indices
    w = torch.rand(512, 8, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x_PD, layout, handle = d.dispatch(x, idx, w)
        out = d.combine(x_PD, handle)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = x.detach().float() * w.detach().sum(1, keepdim=True)
    tol = 0.07 if dispatch_format == "e4m3" else 0.01
    assert (out.float() - expected).norm() <= tol * expected.norm()
    assert x.grad is not None and w.grad is not None
