"""The mHC layers: a sublayer wrapped as ``x' = post * F(pre_apply(x)) + comb^T x`` against an
independent formulation written here, gradients by gradcheck in float64, recompute giving the same
values and gradients while keeping less for backward, the model with mHC (and Engram) on one
process, and errors that name the bad input or config field."""

import dataclasses

import pytest
import torch
from torch.func import functional_call

from ep_runtime import mhc
from ep_runtime.config import EngramConfig, MHCConfig, ModelConfig
from ep_runtime.config_files import preset
from ep_runtime.dispatch import AllToAllDispatcher
from ep_runtime.engram import Engram
from ep_runtime.model import TinyDeepSeek

F64 = torch.float64


def randomize_(module: torch.nn.Module, std: float = 0.5) -> torch.nn.Module:
    """Fresh random parameters (never the structured initial values) so every path is exercised."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * std)
    return module


def slow_sublayer(x_BSND, fn_MK, scale_3, base_M, f, iters, eps):
    """The DeepSeek-V4 mHC sublayer, written out per token from the issue's formulas."""
    b, s, n, d = x_BSND.shape
    out = torch.empty_like(x_BSND)
    ys = torch.empty(b, s, d, dtype=x_BSND.dtype)
    coeffs = []
    for bi in range(b):
        for si in range(s):
            flat = x_BSND[bi, si].reshape(-1).double()
            m = (fn_MK.double() @ flat) / torch.sqrt((flat**2).mean() + eps)
            pre = torch.sigmoid(m[:n] * scale_3[0] + base_M[:n]) + eps
            post = 2 * torch.sigmoid(m[n : 2 * n] * scale_3[1] + base_M[n : 2 * n])
            logits = (m[2 * n :] * scale_3[2] + base_M[2 * n :]).view(n, n)
            p = torch.softmax(logits, -1) + eps
            p = p / (p.sum(0, keepdim=True) + eps)
            for _ in range(iters - 1):
                p = p / (p.sum(1, keepdim=True) + eps)
                p = p / (p.sum(0, keepdim=True) + eps)
            ys[bi, si] = (pre[:, None] * x_BSND[bi, si].double()).sum(0)
            coeffs.append((post, p))
    f_BSD = f(ys)
    k = 0
    for bi in range(b):
        for si in range(s):
            post, comb = coeffs[k]
            k += 1
            for j in range(n):
                mixed = sum(comb[i, j] * x_BSND[bi, si, i].double() for i in range(n))
                out[bi, si, j] = post[j] * f_BSD[bi, si].double() + mixed
    return out


def small_sublayer(d: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()).to(dtype)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_hyper_connection_matches_slow_formulation(seed, n):
    cfg = MHCConfig(n=n, sinkhorn_iters=5)
    hc = randomize_(mhc.HyperConnection(cfg, 8)).double()
    f = small_sublayer(8, F64)
    x = torch.randn(2, 3, n, 8, dtype=F64)
    got = hc(x, f)
    want = slow_sublayer(x, hc.fn_MK, hc.scale_3, hc.base_M, f, cfg.sinkhorn_iters, cfg.eps)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("recompute", [False, True])
def test_hyper_connection_gradcheck(seed, recompute):
    hc = randomize_(mhc.HyperConnection(MHCConfig(n=3, sinkhorn_iters=4, recompute=recompute), 4)).double()
    f = small_sublayer(4, F64)
    names = [name for name, _ in hc.named_parameters()]

    def run(x, *params):
        return functional_call(hc, dict(zip(names, params)), (x, f))

    x = torch.randn(1, 3, 3, 4, dtype=F64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in hc.parameters()]
    assert torch.autograd.gradcheck(run, (x, *params))


class Pair(torch.nn.Module):
    def __init__(self, cfg: MHCConfig, d: int):
        super().__init__()
        self.first, self.second = (randomize_(mhc.HyperConnection(cfg, d)).double() for _ in range(2))
        self.f1, self.f2 = small_sublayer(d, F64), small_sublayer(d, F64)

    def forward(self, x):
        return mhc.two_sublayers(x, self.first, self.f1, self.second, self.f2)


@pytest.mark.parametrize("recompute", [False, True])
def test_block_of_two_sublayers_gradcheck(seed, recompute):
    """A block's attention and FFN (two_sublayers), whose recompute rebuilds the middle streams."""
    pair = Pair(MHCConfig(n=2, sinkhorn_iters=3, recompute=recompute), 4)
    names = [n for n, _ in pair.named_parameters() if n.startswith(("first.", "second."))]

    def run(x, *params):
        return functional_call(pair, dict(zip(names, params)), (x,))

    x = torch.randn(1, 2, 2, 4, dtype=F64, requires_grad=True)
    params = [pair.get_parameter(n).detach().clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(run, (x, *params))
    with torch.no_grad():
        torch.testing.assert_close(pair(x), pair.second(pair.first(x, pair.f1), pair.f2))


def test_head_and_expand_gradcheck(seed):
    head = randomize_(mhc.MHCHead(MHCConfig(n=3), 4)).double()
    names = [name for name, _ in head.named_parameters()]

    def run(h, *params):
        return functional_call(head, dict(zip(names, params)), (mhc.expand(h, 3) * torch.arange(1.0, 4.0, dtype=F64)[:, None],))

    h = torch.randn(2, 2, 4, dtype=F64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in head.parameters()]
    assert torch.autograd.gradcheck(run, (h, *params))


def test_initial_mixing_is_a_plain_residual():
    """At initialisation the per-token part is small: y is about the mean of the streams, each
    stream gets F(y) once and mostly keeps itself, and identical streams stay identical (each
    stream's mix of them has weights summing to 1: comb's columns)."""
    hc = mhc.HyperConnection(MHCConfig(n=4), 16)
    x = mhc.expand(torch.randn(2, 5, 16), 4)
    y_TD, post_TN, comb_TNN = hc.coefficients(x.reshape(10, 4, 16))
    torch.testing.assert_close(y_TD, x[:, :, 0].reshape(10, 16), rtol=0.05, atol=0.05)
    torch.testing.assert_close(post_TN, torch.ones(10, 4), rtol=0.02, atol=0.02)
    assert bool((comb_TNN.diagonal(dim1=1, dim2=2) > 0.5).all())
    torch.testing.assert_close(comb_TNN.sum(1), torch.ones(10, 4), atol=1e-5, rtol=0)  # doubly stochastic
    torch.testing.assert_close(comb_TNN.sum(2), torch.ones(10, 4), atol=1e-5, rtol=0)


def _model(cfg: ModelConfig, seed: int = 3) -> TinyDeepSeek:
    torch.manual_seed(seed)
    return TinyDeepSeek(cfg, AllToAllDispatcher(num_experts=cfg.moe.num_experts, alignment=4), seed=seed)


def _small_v4(**overrides) -> ModelConfig:
    small = {"hidden": 32, "num_layers": 2, "max_seq_len": 16, "engram": EngramConfig(layers=(0, 1), table_size=211)}
    return dataclasses.replace(preset("v4").model, **{**small, **overrides})


def _forward_backward(model, tokens):
    with mhc.saved_bytes(model) as kept:
        loss = model.loss(tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, kept


def test_recompute_same_values_and_gradients_less_memory(seed):
    """recompute changes what backward keeps, not what it computes: the same loss bit for bit, the
    same gradients up to the order in which autograd adds a tensor's several gradient terms (a
    block's input streams feed both recomputed regions); fewer saved bytes (printed: pytest -s)."""
    tokens = torch.randint(0, 256, (4, 17))
    results = {}
    for recompute in (False, True):
        cfg = _small_v4(mhc=MHCConfig(n=4, recompute=recompute))
        results[recompute] = _forward_backward(_model(cfg), tokens)
    (loss0, grads0, kept0), (loss1, grads1, kept1) = results[False], results[True]
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and len(grads0) > 20
    for name in grads0:
        scale = float(grads0[name].abs().max())
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=1e-5 * scale, msg=name)
    print(f"\nmHC recompute, T=64 tokens, n=4, D=32, 2 blocks: saved {kept0['bytes']} -> {kept1['bytes']} bytes "
          f"({kept0['tensors']} -> {kept1['tensors']} tensors)")
    # per block one [T, N, D] float32 stream, per sublayer the mixes, rstd and pre weights:
    # T * (N*(N+2) + 1 + N) floats (4 sublayers)
    t, n, d = 64, 4, 32
    assert kept0["bytes"] - kept1["bytes"] >= 2 * t * n * d * 4 + 4 * t * (n * (n + 2) + 1 + n) * 4


def test_model_with_mhc_and_engram_trains_one_process(seed):
    model = _model(_small_v4())
    assert len(model.sharded_parameters()) == 2
    dense = {id(p) for p in model.dense_parameters()}
    assert not dense & {id(p) for p in model.sharded_parameters() + model.expert_parameters()}
    assert len(dense) + len(model.sharded_parameters()) + len(model.expert_parameters()) == len(
        list(model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (1, 17)).repeat(4, 1)  # one sequence to memorise
    losses = []
    for _ in range(12):
        loss = model.loss(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    for p in model.parameters():
        assert bool(torch.isfinite(p).all())


def test_plain_model_has_no_mhc_or_engram(seed):
    """mhc=None, engram=None: one residual stream, no tables."""
    plain = _model(ModelConfig(hidden=32, max_seq_len=16))
    tokens = torch.randint(0, 256, (2, 9))
    assert plain.mhc_head is None and not plain.engram_layers and not plain.sharded_parameters()
    assert plain(tokens).shape == (2, 9, 256)


def test_bad_inputs_name_themselves(seed):
    model = _model(_small_v4())
    with pytest.raises(ValueError, match="tokens_BS: expected entries in \\[0, 256\\)"):
        model(torch.tensor([[1, 2, 256]]))
    with pytest.raises(ValueError, match="tokens_BS: expected entries"):
        model(torch.tensor([[1, -3, 2]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with torch.no_grad():
        model.embed.weight[5, 0] = float("nan")
    with pytest.raises(ValueError, match="expected finite values"):
        model(torch.tensor([[1, 5, 2]]))
    hc = mhc.HyperConnection(MHCConfig(n=4), 8)
    with pytest.raises(ValueError, match="model.mhc.n"):
        hc(torch.randn(1, 2, 3, 8), torch.nn.Identity())
    four_streams = r"^x_BSND: expected \[B, S, 4, D\] \(4 streams, model.mhc.n\), got shape "
    with pytest.raises(ValueError, match=four_streams + r"\(2, 8\)"):
        hc(torch.randn(2, 8), torch.nn.Identity())
    with pytest.raises(ValueError, match=four_streams + r"\(1, 2, 2, 8\)"):
        mhc.MHCHead(MHCConfig(n=4), 8)(torch.randn(1, 2, 2, 8))
    x = torch.randn(1, 2, 4, 8)
    x[0, 1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="x_TND: expected finite"):
        hc(x, torch.nn.Identity())
    memory = Engram(EngramConfig(layers=(0,)), layer_id=0, vocab_size=50, hidden=8, streams=1, group=None, seed=0)
    with pytest.raises(ValueError, match="ids_BS: expected entries in \\[0, 50\\)"):
        memory(torch.randn(1, 3, 1, 8), torch.tensor([[1, 50, 2]]))


def test_config_errors_name_the_path():
    with pytest.raises(ValueError, match="model.mhc.n"):
        MHCConfig(n=0)
    with pytest.raises(ValueError, match="model.mhc.sinkhorn_iters"):
        MHCConfig(sinkhorn_iters=0)
    with pytest.raises(ValueError, match="model.engram.max_ngram"):
        EngramConfig(max_ngram=1)
    with pytest.raises(ValueError, match="model.engram.layers"):
        EngramConfig(layers=(1, 1))
    with pytest.raises(ValueError, match="model.engram.layers"):
        dataclasses.replace(preset("v4").model, num_layers=2)  # the preset's Engram sits on layer 2
    cfg = preset("v4").model
    assert cfg.mhc.n == 4 and cfg.engram.layers == (0, 2)
    assert EngramConfig(layers=[2, 0]).layers == (2, 0)
    assert dataclasses.asdict(cfg)["engram"]["layers"] == (0, 2)
