"""mHC references against slow per-token loops written independently here (Python floats), and
their explicit backwards against finite differences (gradcheck, float64)."""

import math

import pytest
import torch

from kernels import mhc
from kernels.mhc import functions

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Slow formulations: per token, per element, in Python floats.


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def slow_norm_fn(x, fn, eps):
    t, n, d = x.shape
    flat, w = x.reshape(t, n * d).tolist(), fn.tolist()
    out = []
    for row in flat:
        rstd = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        out.append([sum(wk * v for wk, v in zip(wrow, row)) * rstd for wrow in w])
    return out


def slow_sinkhorn(mat, iters, eps):
    n = len(mat)
    p = []
    for row in mat:
        e = [math.exp(v) for v in row]
        p.append([v / sum(e) + eps for v in e])

    def cols(p):
        s = [sum(p[i][j] for i in range(n)) + eps for j in range(n)]
        return [[p[i][j] / s[j] for j in range(n)] for i in range(n)]

    def rows(p):
        return [[v / (sum(row) + eps) for v in row] for row in p]

    p = cols(p)
    for _ in range(iters - 1):
        p = cols(rows(p))
    return p


def slow_split(mixes, scale, base, n, pre_eps, post_mult, sinkhorn_eps, iters):
    pres, posts, combs = [], [], []
    for row in mixes:
        a = [m * scale[0 if k < n else 1 if k < 2 * n else 2] + b for k, (m, b) in enumerate(zip(row, base))]
        pres.append([sigmoid(v) + pre_eps for v in a[:n]])
        posts.append([post_mult * sigmoid(v) for v in a[n : 2 * n]])
        logits = [[a[2 * n + i * n + j] for j in range(n)] for i in range(n)]
        combs.append(slow_sinkhorn(logits, iters, sinkhorn_eps))
    return pres, posts, combs


def slow_pre_apply(x, pre):
    t, n, d = x.shape
    xs = x.tolist()
    return [[sum(pre[s][i] * xs[s][i][k] for i in range(n)) for k in range(d)] for s in range(t)]


def slow_post(f, x, post, comb):
    t, n, d = x.shape
    xs, fs = x.tolist(), f.tolist()
    out = []
    for s in range(t):
        mixed = [[sum(comb[s][i][j] * xs[s][i][k] for i in range(n)) for k in range(d)] for j in range(n)]
        out.append([[post[s][j] * fs[s][k] + mixed[j][k] for k in range(d)] for j in range(n)])
    return out


def draw_params(n, d, dtype=torch.float32, rows=None):
    m = n * (n + 2) if rows is None else rows
    fn = torch.randn(m, n * d, dtype=dtype) / math.sqrt(n * d)
    scale = torch.rand(3 if rows is None else 1, dtype=dtype) + 0.5
    base = torch.randn(m, dtype=dtype) * 0.5
    return fn, scale, base


def close(actual, expected, rtol=1e-10, atol=1e-12):
    torch.testing.assert_close(actual.to(F64), torch.tensor(expected, dtype=F64), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# Forward against the slow formulations.


@pytest.mark.parametrize("n", [1, 2, 4])
def test_norm_fn_matches_loops(seed, n):
    x = torch.randn(5, n, 6, dtype=F64)
    fn, _, _ = draw_params(n, 6, F64)
    close(mhc.norm_fn(x, fn, eps=1e-6), slow_norm_fn(x, fn, 1e-6))


def test_norm_fn_computes_bfloat16_streams_in_float32(seed):
    x = torch.randn(7, 4, 16).bfloat16()
    fn, _, _ = draw_params(4, 16)
    mixes = mhc.norm_fn(x, fn)
    assert mixes.dtype == torch.float32
    close(mixes, slow_norm_fn(x.double(), fn.double(), 1e-6), rtol=1e-5, atol=1e-5)


def test_round_to_tf32(seed):
    t = torch.randn(1000) * 10.0 ** torch.randint(-5, 5, (1000,))
    r = mhc.round_to_tf32(t)
    assert (r.view(torch.int32) & 0x1FFF == 0).all()  # 10 mantissa bits left
    assert ((r - t).abs() <= t.abs() * 2.0**-11).all()  # nearest: within half a TF32 ulp
    # ties round away from zero: 1 + 2^-11 is halfway between 1 and 1 + 2^-10
    assert mhc.round_to_tf32(torch.tensor([1 + 2.0**-11, -(1 + 2.0**-11)])).tolist() == [1 + 2.0**-10, -(1 + 2.0**-10)]
    x = torch.randn(3, 2, 8)
    fn, _, _ = draw_params(2, 8)
    torch.testing.assert_close(mhc.norm_fn(x, fn, tf32=True), mhc.norm_fn(x, mhc.round_to_tf32(fn)), rtol=0, atol=0)
    assert not torch.equal(mhc.norm_fn(x, fn, tf32=True), mhc.norm_fn(x, fn))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("iters", [1, 3, 20])
def test_sinkhorn_matches_loops(seed, n, iters):
    logits = torch.randn(4, n, n, dtype=F64) * 2
    expected = [slow_sinkhorn(m, iters, 1e-6) for m in logits.tolist()]
    close(mhc.sinkhorn(logits, iters=iters, eps=1e-6), expected)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sinkhorn_doubly_stochastic(seed, n, dtype):
    """At iters=20, for logits in [-1, 1], every row and every column sums to 1 within 1e-5.

    (Columns always do, the last step divides by them; rows converge more slowly for wide logits:
    N(0, 1) logits at N = 2..4 leave row errors up to ~1e-2 at 20 iterations.)"""
    logits = torch.rand(4096, n, n, dtype=dtype) * 2 - 1
    comb = mhc.sinkhorn(logits, iters=20)
    assert (comb > 0).all()
    assert (comb.sum(-1) - 1).abs().max() < 1e-5
    assert (comb.sum(-2) - 1).abs().max() < 1e-5


@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_sinkhorn_matches_loops(seed, n):
    m = n * (n + 2)
    mixes = torch.randn(5, m, dtype=F64)
    scale = torch.rand(3, dtype=F64) + 0.5
    base = torch.randn(m, dtype=F64)
    opts = dict(pre_eps=1e-3, post_mult=2.0, sinkhorn_eps=1e-6, iters=7)
    pre_, post_, comb = mhc.split_sinkhorn(mixes, scale, base, **opts)
    pres, posts, combs = slow_split(mixes.tolist(), scale.tolist(), base.tolist(), n, *opts.values())
    close(pre_, pres)
    close(post_, posts)
    close(comb, combs)


def test_pre_apply_and_post_match_loops(seed):
    t, n, d = 4, 3, 5
    x = torch.randn(t, n, d, dtype=F64)
    pre_ = torch.rand(t, n, dtype=F64)
    f = torch.randn(t, d, dtype=F64)
    post_ = torch.rand(t, n, dtype=F64) * 2
    comb = torch.rand(t, n, n, dtype=F64)  # not symmetric: post must apply comb transposed
    close(mhc.pre_apply(x, pre_), slow_pre_apply(x, pre_.tolist()))
    close(mhc.post(f, x, post_, comb), slow_post(f, x, post_.tolist(), comb.tolist()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_rounds_once_to_the_stream_dtype(seed, dtype):
    t, n, d = 6, 4, 32
    x = torch.randn(t, n, d).to(dtype)
    f = torch.randn(t, d).to(dtype)
    post_, comb = torch.rand(t, n) * 2, torch.rand(t, n, n)
    out = mhc.post(f, x, post_, comb)
    assert out.dtype == dtype
    exact = torch.tensor(slow_post(f.double(), x.double(), post_.tolist(), comb.tolist()), dtype=F64)
    tol = 2.0**-8 if dtype == torch.bfloat16 else 1e-6  # half an ulp, plus float32 accumulation
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pre_matches_loops(seed, n):
    t, d = 3, 4
    x = torch.randn(t, n, d, dtype=F64)
    fn, scale, base = draw_params(n, d, F64)
    opts = dict(norm_eps=1e-6, pre_eps=1e-6, post_mult=2.0, sinkhorn_eps=1e-6, iters=20)
    y, post_, comb = mhc.pre(x, fn, scale, base, **opts)
    mixes = slow_norm_fn(x, fn, 1e-6)
    pres, posts, combs = slow_split(mixes, scale.tolist(), base.tolist(), n, 1e-6, 2.0, 1e-6, 20)
    close(y, slow_pre_apply(x, pres))
    close(post_, posts)
    close(comb, combs)


@pytest.mark.parametrize("n", [1, 4])
def test_pre_fused_matches_loops(seed, n):
    """The fused op against the loops written here, not against ``pre`` (on the CPU both are the
    reference, sharing helpers)."""
    t, d = 3, 4
    x = torch.randn(t, n, d, dtype=F64)
    fn, scale, base = draw_params(n, d, F64)
    y, post_, comb = mhc.pre_fused(x, fn, scale, base, norm_eps=1e-6, pre_eps=1e-6, post_mult=2.0, sinkhorn_eps=1e-6,
                                   iters=20)
    pres, posts, combs = slow_split(slow_norm_fn(x, fn, 1e-6), scale.tolist(), base.tolist(), n, 1e-6, 2.0, 1e-6, 20)
    close(y, slow_pre_apply(x, pres))
    close(post_, posts)
    close(comb, combs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pre_fused_equals_pre(seed, dtype):
    x = torch.randn(9, 4, 16).to(dtype)
    fn, scale, base = draw_params(4, 16)
    for tf32 in (False, True):
        unfused = mhc.pre(x, fn, scale, base, tf32=tf32)
        fused = mhc.pre_fused(x, fn, scale, base, tf32=tf32)
        assert unfused[0].dtype == dtype and fused[0].dtype == dtype
        for a, b in zip(unfused, fused):
            assert torch.equal(a, b)


def test_head_matches_loops(seed):
    t, n, d = 4, 3, 5
    x = torch.randn(t, n, d, dtype=F64)
    fn, scale, base = draw_params(n, d, F64, rows=n)
    y = mhc.head(x, fn, scale, base, norm_eps=1e-6, pre_eps=1e-6)
    mixes = slow_norm_fn(x, fn, 1e-6)
    w = [[sigmoid(m * scale.item() + b) + 1e-6 for m, b in zip(row, base.tolist())] for row in mixes]
    close(y, slow_pre_apply(x, w))


def test_expand_copies_the_embedding(seed):
    h = torch.randn(5, 7).bfloat16()
    x = mhc.expand(h, 3)
    assert x.shape == (5, 3, 7) and x.dtype == torch.bfloat16 and x.is_contiguous()
    for i in range(3):
        assert torch.equal(x[:, i], h)


def test_zero_tokens(seed):
    x = torch.randn(0, 4, 8, requires_grad=True)
    fn, scale, base = (p.requires_grad_() for p in draw_params(4, 8))
    y, post_, comb = mhc.pre(x, fn, scale, base)
    assert y.shape == (0, 8) and post_.shape == (0, 4) and comb.shape == (0, 4, 4)
    out = mhc.post(torch.randn(0, 8), x, post_, comb)
    assert out.shape == (0, 4, 8)
    hfn, hscale, hbase = draw_params(4, 8, rows=4)
    assert mhc.head(x, hfn, hscale, hbase).shape == (0, 8)
    (y.sum() + out.sum()).backward()
    assert x.grad.shape == (0, 4, 8)
    for p in (fn, scale, base):  # sums over no tokens
        assert torch.equal(p.grad, torch.zeros_like(p))


def test_replay_matches_sequential_loops(seed):
    t, n, d, layers = 3, 2, 4, 4
    x0 = torch.randn(t, n, d, dtype=F64)
    pres = [torch.rand(t, n, dtype=F64) for _ in range(layers)]
    posts = [torch.rand(t, n, dtype=F64) for _ in range(layers - 1)]
    combs = [torch.rand(t, n, n, dtype=F64) for _ in range(layers - 1)]
    fs = [torch.randn(t, d, dtype=F64) for _ in range(layers - 1)]
    ys, xs = mhc.replay(x0, pres, posts, combs, fs)
    assert len(ys) == layers and len(xs) == layers - 1
    x = x0
    for layer in range(layers):
        close(ys[layer], slow_pre_apply(x, pres[layer].tolist()))
        if layer < layers - 1:
            x = torch.tensor(slow_post(fs[layer], x, posts[layer].tolist(), combs[layer].tolist()), dtype=F64)
            close(xs[layer], x.tolist())


# ---------------------------------------------------------------------------------------------
# Backward: gradcheck of every explicit backward in float64.


def leaf(*shape, scale=1.0, positive=False):
    t = torch.rand(*shape, dtype=F64) + 0.1 if positive else torch.randn(*shape, dtype=F64)
    return (t * scale).requires_grad_()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("iters", [1, 20])
def test_sinkhorn_gradcheck(seed, n, iters):
    logits = leaf(3, n, n)
    assert torch.autograd.gradcheck(lambda a: mhc.sinkhorn(a, iters=iters, eps=1e-6), (logits,))


def test_sinkhorn_backward_keeps_only_the_logits(seed):
    logits = leaf(4, 3, 3)
    comb = mhc.sinkhorn(logits, iters=20)
    saved = comb.grad_fn.saved_tensors
    assert len(saved) == 1 and torch.equal(saved[0], logits)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_split_sinkhorn_gradcheck(seed, n):
    m = n * (n + 2)
    args = (leaf(3, m), leaf(3, positive=True), leaf(m))

    def fn(mixes, scale, base):
        return mhc.split_sinkhorn(mixes, scale, base, pre_eps=1e-3, iters=10)

    assert torch.autograd.gradcheck(fn, args)
    pre_, _, comb = fn(*args)  # unused outputs get no gradient (None) in backward
    (pre_.sum() + comb[:, 0].sum()).backward()
    assert all(a.grad is not None and torch.isfinite(a.grad).all() for a in args)


@pytest.mark.parametrize("n", [1, 3])
def test_norm_fn_gradcheck(seed, n):
    x, fn = leaf(3, n, 4), leaf(n * (n + 2), n * 4, scale=0.3)
    assert torch.autograd.gradcheck(lambda a, b: mhc.norm_fn(a, b, eps=1e-6), (x, fn))


def test_pre_apply_and_post_gradcheck(seed):
    t, n, d = 3, 3, 4
    assert torch.autograd.gradcheck(mhc.pre_apply, (leaf(t, n, d), leaf(t, n, positive=True)))
    args = (leaf(t, d), leaf(t, n, d), leaf(t, n, positive=True), leaf(t, n, n, positive=True))
    assert torch.autograd.gradcheck(mhc.post, args)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_pre_gradcheck(seed, n):
    d = 3
    args = (leaf(2, n, d), leaf(n * (n + 2), n * d, scale=0.3), leaf(3, positive=True), leaf(n * (n + 2), scale=0.5))
    assert torch.autograd.gradcheck(lambda *a: mhc.pre(*a, iters=20), args)


def test_head_and_expand_gradcheck(seed):
    n, d = 3, 4
    args = (leaf(3, n, d), leaf(n, n * d, scale=0.3), leaf(1, positive=True), leaf(n))
    assert torch.autograd.gradcheck(mhc.head, args)
    assert torch.autograd.gradcheck(lambda h: mhc.expand(h, 3), (leaf(4, d),))


# Per gradient, scaled to each tensor: |got - want| <= tol * (|want| + rms(want)). The streams' and
# F's gradients are bfloat16 (sums of paths each rounded to bfloat16, then rounded again: up to
# 0.0065 seen); the parameters' float32 (float32 sums over tokens and the 39 Sinkhorn
# normalizations: up to 1e-6 seen).
BACKWARD_TOL = {"x": 2.0**-6, "fn": 1e-5, "scale": 1e-5, "base": 1e-5, "f": 2.0**-6}


def _excess(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """The largest ``|got - want| / (tol * (|want| + rms(want)))``: <= 1 within the tolerance."""
    got, want = got.double(), want.double()
    return float(((got - want).abs() / (tol * (want.abs() + want.square().mean().sqrt()))).max())


def _float32_backward_and_plain_autograd():
    """The explicit backwards, run in float32 on bfloat16 streams, and torch autograd through the
    forward formulas written with plain ops in float64: ``{name: (got, want)}``."""
    t, n, d = 6, 4, 16
    x = torch.randn(t, n, d).bfloat16().requires_grad_()
    fn, scale, base = (p.requires_grad_() for p in draw_params(n, d))
    f = torch.randn(t, d).bfloat16().requires_grad_()
    y, post_, comb = mhc.pre(x, fn, scale, base)
    out = mhc.post(f, x, post_, comb)
    gy, gout = torch.randn(t, d), torch.randn(t, n, d)
    torch.autograd.backward([y, out], [gy.bfloat16(), gout.bfloat16()])

    leaves = [a.detach().double().requires_grad_() for a in (x, fn, scale, base, f)]
    x64, fn64, scale64, base64, f64 = leaves
    flat = x64.reshape(t, -1)
    mixes = flat @ fn64.T * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    a = mixes * torch.cat([scale64[0].expand(n), scale64[1].expand(n), scale64[2].expand(n * n)]) + base64
    pre64 = torch.sigmoid(a[:, :n]) + 1e-6
    post64 = 2 * torch.sigmoid(a[:, n : 2 * n])
    c = torch.softmax(a[:, 2 * n :].reshape(t, n, n), -1) + 1e-6
    c = c / (c.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + 1e-6)
        c = c / (c.sum(-2, keepdim=True) + 1e-6)
    y64 = (pre64[:, :, None] * x64).sum(1)
    out64 = post64[:, :, None] * f64[:, None, :] + torch.einsum("tij,tid->tjd", c, x64)
    torch.autograd.backward([y64, out64], [gy.bfloat16().double(), gout.bfloat16().double()])
    return {name: (got.grad, want.grad) for name, got, want in zip(BACKWARD_TOL, (x, fn, scale, base, f), leaves)}


def test_backward_in_float32_matches_autograd_of_plain_ops(seed):
    for name, (got, want) in _float32_backward_and_plain_autograd().items():
        excess = _excess(got, want, BACKWARD_TOL[name])
        assert excess <= 1, f"{name}: {excess:.3g} times its tolerance {BACKWARD_TOL[name]}"


def test_backward_tolerances_bind(seed):
    """Each gradient's tolerance fails a small corruption of it: any one element off by 5% of
    itself plus the tensor's RMS, or the smallest fifth of its elements zeroed."""
    for name, (got, want) in _float32_backward_and_plain_autograd().items():
        tol, want = BACKWARD_TOL[name], want.double()
        rms = float(want.square().mean().sqrt())
        for i in (0, int(want.abs().argmax()), want.numel() - 1):
            bumped = got.double().flatten().clone()
            bumped[i] += 0.05 * (abs(float(want.flatten()[i])) + rms)
            assert _excess(bumped.view_as(want), want, tol) > 1, (name, i)
        if want.numel() >= 5:
            small = want.abs() <= want.abs().quantile(0.2)
            assert _excess(torch.where(small, 0.0, got.double()), want, tol) > 1, name


def test_pre_recompute_reruns_the_pre_path_in_backward(seed, monkeypatch):
    calls = []
    norm_fn_fwd = functions.norm_fn_fwd
    monkeypatch.setattr(functions, "norm_fn_fwd", lambda *a: calls.append(1) or norm_fn_fwd(*a))
    x = torch.randn(5, 4, 8, dtype=F64)
    params = draw_params(4, 8, F64)
    grads = {}
    for recompute in (False, True):
        calls.clear()
        leaves = [t.clone().requires_grad_() for t in (x, *params)]
        y, post_, comb = mhc.pre(*leaves, recompute=recompute)
        (y.square().sum() + post_.sum() + (comb * comb.detach()).sum()).backward()
        grads[recompute] = [t.grad for t in leaves]
        assert len(calls) == (2 if recompute else 1)
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Bad input.


def _pre_args(n=4, d=8, **override):
    fn, scale, base = draw_params(n, d)
    args = dict(x_TND=torch.randn(3, n, d), fn_MK=fn, scale_3=scale, base_M=base)
    args.update(override)
    return args


_X = torch.randn(3, 4, 8)


def _nan_x():
    x = torch.randn(3, 4, 8)
    x[1, 2, 3] = float("nan")
    return x


BAD_INPUTS = [
    (lambda: mhc.pre(**_pre_args(fn_MK=torch.randn(24, 36))), ValueError, "fn_MK"),  # D mismatch
    (lambda: mhc.pre(**_pre_args(x_TND=torch.randn(3, 3, 8))), ValueError, "fn_MK"),  # N mismatch
    (lambda: mhc.pre(**_pre_args(fn_MK=torch.randn(24, 32).bfloat16())), TypeError, "fn_MK"),
    (lambda: mhc.pre(**_pre_args(x_TND=_nan_x())), ValueError, "x_TND"),
    (lambda: mhc.pre(**_pre_args(x_TND=torch.randn(3, 32))), ValueError, "x_TND"),
    (lambda: mhc.pre(**_pre_args(scale_3=torch.ones(2))), ValueError, "scale_3"),
    (lambda: mhc.pre(**_pre_args(base_M=torch.ones(23))), ValueError, "base_M"),
    (lambda: mhc.pre(**_pre_args(base_M=torch.full((24,), float("inf")))), ValueError, "base_M"),
    (lambda: mhc.pre(**_pre_args(), iters=0), ValueError, "iters"),
    (lambda: mhc.pre(**_pre_args(), sinkhorn_eps=-1.0), ValueError, "sinkhorn_eps"),
    (lambda: mhc.pre_fused(**_pre_args(fn_MK=torch.randn(24, 32).requires_grad_())), ValueError, "fn_MK"),
    (lambda: mhc.split_sinkhorn(torch.randn(3, 10), torch.ones(3), torch.ones(10)), ValueError, "mixes_TM"),
    (lambda: mhc.sinkhorn(torch.randn(3, 2, 3)), ValueError, "logits_TNN"),
    (lambda: mhc.sinkhorn(torch.full((3, 2, 2), float("nan"))), ValueError, "logits_TNN"),
    (lambda: mhc.pre_apply(torch.randn(3, 4, 8), torch.rand(3, 3)), ValueError, "pre_TN"),
    (lambda: mhc.post(torch.randn(3, 8), _X, torch.rand(3, 4), torch.rand(3, 4, 3)), ValueError, "comb_TNN"),
    (lambda: mhc.post(torch.randn(3, 7), _X, torch.rand(3, 4), torch.rand(3, 4, 4)), ValueError, "f_TD"),
    (lambda: mhc.head(_X, torch.randn(24, 32), torch.ones(1), torch.zeros(4)), ValueError, "fn_NK"),
    (lambda: mhc.expand(torch.randn(3, 8), 0), ValueError, "n"),
    (lambda: mhc.replay(_X, [torch.rand(3, 4)], [], [], [torch.randn(3, 8)] * 2), ValueError, "f_list"),
]


@pytest.mark.parametrize("call, error, argname", BAD_INPUTS)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}:"):
        call()
