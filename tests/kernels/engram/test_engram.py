"""Engram references against slow loops written independently here (Python ints and floats), the
gate's explicit backward against finite differences (gradcheck, float64) and autograd."""

import math

import pytest
import torch

from kernels import engram

F64 = torch.float64


def is_prime(p: int) -> bool:
    return p >= 2 and all(p % q for q in range(2, math.isqrt(p) + 1))


def small_config(layer_id=3, layer_ids=(3, 5), vocab_size=50, max_ngram=3, num_heads=4, table_size=(31, 47)):
    return engram.make_hash_config(
        layer_id, layer_ids=layer_ids, vocab_size=vocab_size, max_ngram=max_ngram, num_heads=num_heads,
        table_size=table_size,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Hash.


def slow_hash(ids, config, compress=None, pad_id=0):
    tok = [[compress[i] for i in row] for row in ids] if compress is not None else ids
    pad = compress[pad_id] if compress is not None else pad_id
    sizes, offsets, k_heads = config.column_sizes, config.offsets, config.num_heads
    out = []
    for row in tok:
        out_row = []
        for s in range(len(row)):
            cols = []
            for n in range(2, config.max_ngram + 1):
                h = 0
                for k in range(n):
                    h ^= (row[s - k] if s - k >= 0 else pad) * config.multipliers[k]
                for head in range(k_heads):
                    c = (n - 2) * k_heads + head
                    cols.append(h % sizes[c] + offsets[c])
            out_row.append(cols)
        out.append(out_row)
    return out


@pytest.mark.parametrize("max_ngram", [2, 3, 4])
@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "compressed"])
def test_hash_matches_loops(seed, max_ngram, compressed):
    vocab = 1000
    config = engram.make_hash_config(
        1, layer_ids=[1, 4], vocab_size=vocab, max_ngram=max_ngram, num_heads=3, table_size=10007, seed=seed
    )
    if compressed:
        compress = torch.randint(0, vocab, (5000,))
        ids = torch.randint(0, 5000, (3, 11), dtype=torch.int32)
        idx = engram.ngram_hash(ids, config, compress_V=compress, pad_id=7)
        expected = slow_hash(ids.tolist(), config, compress.tolist(), pad_id=7)
    else:
        ids = torch.randint(0, vocab, (3, 11))
        idx = engram.ngram_hash(ids, config, pad_id=2)
        expected = slow_hash(ids.tolist(), config, pad_id=2)
    assert idx.dtype == torch.int64 and idx.shape == (3, 11, (max_ngram - 1) * 3)
    assert idx.tolist() == expected


def test_hash_with_the_largest_ids_and_multipliers_stays_exact(seed):
    """Products reach almost 2**63: int64 must neither wrap nor go negative."""
    vocab = 129280
    config = engram.make_hash_config(0, layer_ids=[0], vocab_size=vocab, max_ngram=3, num_heads=2, table_size=646400)
    assert max(config.multipliers) * (vocab - 1) < 2**63
    assert max(config.multipliers) > 2**63 // vocab // 4  # drawn from the whole range, not just small ones
    ids = torch.cat([torch.full((1, 4), vocab - 1), torch.randint(0, vocab, (1, 60))], dim=1)
    assert engram.ngram_hash(ids, config).tolist() == slow_hash(ids.tolist(), config)


def test_hash_indices_in_bounds_and_deterministic(seed):
    config = small_config()
    ids = torch.randint(0, config.vocab_size, (4, 200))
    idx = engram.ngram_hash(ids, config)
    sizes = torch.tensor(config.column_sizes)
    offsets = torch.tensor(config.offsets)
    assert (idx >= offsets).all() and (idx < offsets + sizes).all()
    assert idx.max() < config.num_rows
    assert all(len(idx[..., c].unique()) > sizes[c] // 2 for c in range(config.num_columns))  # spread out
    assert torch.equal(engram.ngram_hash(ids, config), idx)
    assert small_config() == config
    assert torch.equal(engram.ngram_hash(ids, small_config()), idx)


def test_hash_column_of_order_n_depends_on_the_last_n_tokens_only(seed):
    config = small_config(max_ngram=4, table_size=50)
    ids = torch.randint(0, config.vocab_size, (1, 30))
    idx = engram.ngram_hash(ids, config)
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % config.vocab_size
    diff = engram.ngram_hash(changed, config) != idx
    k = config.num_heads
    for n in range(2, 5):
        cols = slice((n - 2) * k, (n - 1) * k)
        moved = diff[0, :, cols].any(-1).nonzero().flatten().tolist()
        assert set(moved) <= set(range(10, 10 + n)) and 10 in moved


def test_hash_pads_on_the_left(seed):
    config = small_config()
    ids = torch.randint(0, config.vocab_size, (1, 6))
    with_pad = torch.cat([torch.full((1, 2), 9), ids], dim=1)
    # a sequence that starts with two pad tokens hashes its later positions like one padded implicitly
    assert torch.equal(engram.ngram_hash(with_pad, config, pad_id=9)[:, 2:], engram.ngram_hash(ids, config, pad_id=9))
    assert not torch.equal(engram.ngram_hash(ids, config, pad_id=9), engram.ngram_hash(ids, config, pad_id=8))


def test_primes_distinct_across_heads_orders_and_layers():
    layer_ids = [7, 0, 3]

    def build(lid, ids=layer_ids, seed=0):
        return engram.make_hash_config(
            lid, layer_ids=ids, vocab_size=100, max_ngram=4, num_heads=3, table_size=(50, 60, 50), seed=seed
        )

    configs = [build(lid) for lid in layer_ids]
    primes = [p for c in configs for p in c.column_sizes]
    assert len(primes) == 3 * 3 * 3 == len(set(primes))
    assert all(is_prime(p) for p in primes)
    for c in configs:
        for start, sizes in zip((50, 60, 50), c.table_sizes):
            assert all(p >= start for p in sizes) and list(sizes) == sorted(sizes)
        assert all(m % 2 == 1 and 1 <= m <= (2**63 - 1) // 100 for m in c.multipliers)
    # layers take primes in ascending layer id, whatever the order of layer_ids
    by_id = {c.layer_id: c for c in configs}
    assert by_id[0].table_sizes == ((53, 59, 61), (67, 71, 73), (79, 83, 89))
    assert by_id[3].table_sizes[0] == (97, 101, 103)
    assert build(3, ids=[0, 3, 7]) == by_id[3]
    # multipliers differ between layers and seeds; primes do not depend on the seed
    assert len({c.multipliers for c in configs}) == 3
    reseeded = build(3, seed=1)
    assert reseeded.multipliers != by_id[3].multipliers and reseeded.table_sizes == by_id[3].table_sizes


def test_config_offsets():
    config = small_config()
    sizes = config.column_sizes
    assert config.offsets == tuple(sum(sizes[:c]) for c in range(len(sizes)))
    assert config.num_rows == sum(sizes) and config.num_columns == 2 * 4 == len(sizes)
    assert config.max_ngram == 3 and config.num_heads == 4


# ---------------------------------------------------------------------------------------------
# Gate.


def slow_gate(x, k, v, wh, we, clamp, eps, add_residual=True):
    t, n, d = x.shape
    xs, ks, vs, whs, wes = x.tolist(), k.tolist(), v.tolist(), wh.tolist(), we.tolist()
    out = []
    for s in range(t):
        rows = []
        for h in range(n):
            rx = 1 / math.sqrt(sum(a * a for a in xs[s][h]) / d + eps)
            rk = 1 / math.sqrt(sum(a * a for a in ks[s][h]) / d + eps)
            dot = sum(xs[s][h][i] * whs[h][i] * ks[s][h][i] * wes[h][i] for i in range(d)) * rx * rk / math.sqrt(d)
            g = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), clamp)), dot))) if dot else 0.5
            rows.append([(xs[s][h][i] if add_residual else 0.0) + g * vs[s][i] for i in range(d)])
        out.append(rows)
    return out


def gate_inputs(t=5, n=3, d=8, dtype=F64):
    return (
        torch.randn(t, n, d, dtype=dtype),
        torch.randn(t, n, d, dtype=dtype),
        torch.randn(t, d, dtype=dtype),
        (torch.rand(n, d, dtype=dtype) + 0.5),
        (torch.rand(n, d, dtype=dtype) + 0.5),
    )


@pytest.mark.parametrize("add_residual", [True, False])
def test_gate_matches_loops(seed, add_residual):
    args = gate_inputs()
    out = engram.gate(*args, clamp=1e-6, eps=1e-6, add_residual=add_residual)
    expected = slow_gate(*args, 1e-6, 1e-6, add_residual)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)


def test_gate_bfloat16(seed):
    args = [a.bfloat16() for a in gate_inputs(t=6, n=4, d=64, dtype=torch.float32)]
    out = engram.gate(*args)
    assert out.dtype == torch.bfloat16
    expected = torch.tensor(slow_gate(*(a.double() for a in args), 1e-6, 1e-6), dtype=F64)
    torch.testing.assert_close(out.double(), expected, rtol=2.0**-8, atol=1e-5)


@pytest.mark.parametrize("add_residual", [True, False])
def test_gate_gradcheck(seed, add_residual):
    args = [a.requires_grad_() for a in gate_inputs(t=4, n=2, d=5)]
    assert torch.autograd.gradcheck(lambda *a: engram.gate(*a, clamp=1e-6, eps=1e-6, add_residual=add_residual), args)


def test_gate_backward_with_clamped_tokens_matches_autograd(seed):
    """Half of the (token, stream) pairs have |dot| < clamp: no gradient flows through their dot."""
    args = gate_inputs(t=16, n=2, d=8)
    x, k, v, wh, we = args
    rx = torch.rsqrt(x.square().mean(-1) + 1e-6)
    rk = torch.rsqrt(k.square().mean(-1) + 1e-6)
    dot = (x * wh * k * we).sum(-1) * rx * rk / math.sqrt(8)
    clamp = dot.abs().median().item()
    grad_out = torch.randn_like(x)

    leaves = [a.clone().requires_grad_() for a in args]
    engram.gate(*leaves, clamp=clamp, eps=1e-6).backward(grad_out)

    plain = [a.clone().requires_grad_() for a in args]
    px, pk, pv, pwh, pwe = plain
    pdot = (px * pwh * pk * pwe).sum(-1) * torch.rsqrt(px.square().mean(-1) + 1e-6) * torch.rsqrt(
        pk.square().mean(-1) + 1e-6
    ) / math.sqrt(8)
    g = torch.sigmoid(pdot.sign() * pdot.abs().clamp_min(clamp).sqrt())
    (px + g[..., None] * pv[:, None, :]).backward(grad_out)
    for got, want in zip(leaves, plain):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
    clamped = dot.abs() < clamp
    assert clamped.any() and (~clamped).any()
    torch.testing.assert_close(leaves[1].grad[clamped], torch.zeros_like(leaves[1].grad[clamped]))


def test_gate_weight_gradient_is_summed_over_tokens(seed):
    args = gate_inputs(t=6, n=2, d=4)
    whole = [a.clone().requires_grad_() for a in args]
    engram.gate(*whole).sum().backward()
    per_token_wh = torch.zeros_like(args[3])
    for s in range(6):
        part = [a[s : s + 1].clone() for a in args[:3]] + [args[3].clone().requires_grad_(), args[4].clone()]
        engram.gate(*part).sum().backward()
        per_token_wh += part[3].grad
    torch.testing.assert_close(whole[3].grad, per_token_wh, rtol=1e-12, atol=1e-12)


def test_gate_zero_tokens():
    args = [a.requires_grad_() for a in gate_inputs(t=0, n=2, d=4)]
    out = engram.gate(*args)
    out.sum().backward()
    assert out.shape == (0, 2, 4) and torch.equal(args[3].grad, torch.zeros(2, 4))


# ---------------------------------------------------------------------------------------------
# Short convolution.


def slow_conv(x, weight, dilation, norm_weight=None, eps=1e-5):
    b, s, n, d = x.shape
    xs, ws = x.tolist(), weight.tolist()
    if norm_weight is not None:
        nw = norm_weight.tolist()
        for bi in range(b):
            for si in range(s):
                for h in range(n):
                    r = 1 / math.sqrt(sum(a * a for a in xs[bi][si][h]) / d + eps)
                    xs[bi][si][h] = [a * r * nw[h][i] for i, a in enumerate(xs[bi][si][h])]
    taps = len(ws[0][0])
    out = torch.zeros(b, s, n, d, dtype=F64)
    for bi in range(b):
        for si in range(s):
            for h in range(n):
                for i in range(d):
                    acc = 0.0
                    for w in range(taps):
                        src = si - (taps - 1 - w) * dilation
                        if src >= 0:
                            acc += ws[h][i][w] * xs[bi][src][h][i]
                    out[bi, si, h, i] = acc / (1 + math.exp(-acc))
    return out


@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize("normed", [False, True])
def test_short_conv_matches_loops(seed, dilation, normed):
    x = torch.randn(2, 13, 2, 3, dtype=F64)
    weight = torch.randn(2, 3, 4, dtype=F64)
    norm_weight = torch.rand(2, 3, dtype=F64) + 0.5 if normed else None
    out = engram.short_conv(x, weight, dilation=dilation, norm_weight_ND=norm_weight)
    torch.testing.assert_close(out, slow_conv(x, weight, dilation, norm_weight), rtol=1e-12, atol=1e-12)


def test_short_conv_is_causal(seed):
    x = torch.randn(1, 20, 2, 4)
    weight = torch.randn(2, 4, 4)
    out = engram.short_conv(x, weight, dilation=3)
    changed = x.clone()
    changed[0, 8] += 1.0
    diff = (engram.short_conv(changed, weight, dilation=3) != out).any(-1).any(-1)[0]
    assert diff.nonzero().flatten().tolist() == [8, 11, 14, 17]  # s, s + dilation, ... (kernel 4)


def test_short_conv_of_empty_sequences_or_channels_is_empty_and_differentiable():
    weight = torch.randn(2, 4, 4, requires_grad=True)
    for x in (torch.randn(3, 0, 2, 4, requires_grad=True), torch.randn(0, 5, 2, 4, requires_grad=True)):
        out = engram.short_conv(x, weight, dilation=2)
        assert out.shape == x.shape
        out.sum().backward()
        assert x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))
    with pytest.raises(ValueError, match="^weight_NDW: expected at least one tap"):
        engram.short_conv(torch.randn(1, 5, 2, 4), torch.randn(2, 4, 0), dilation=1)


# ---------------------------------------------------------------------------------------------
# Bad input.


def _nan(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


_X, _K, _V, _WH, _WE = gate_inputs(t=3, n=2, d=4, dtype=torch.float32)
_IDS = torch.tensor([[0, 1]])

BAD_INPUTS = [
    (lambda: engram.ngram_hash(torch.tensor([[0, 50]]), small_config()), ValueError, "ids_BS"),  # out of vocabulary
    (lambda: engram.ngram_hash(torch.tensor([[-1, 0]]), small_config()), ValueError, "ids_BS"),
    (lambda: engram.ngram_hash(torch.tensor([[0.0, 1.0]]), small_config()), TypeError, "ids_BS"),
    (lambda: engram.ngram_hash(_IDS, small_config(), compress_V=torch.arange(1)), ValueError, "ids_BS"),
    (lambda: engram.ngram_hash(_IDS, small_config(), compress_V=torch.tensor([0, 50])), ValueError, "compress_V"),
    (lambda: engram.ngram_hash(torch.tensor([[0, 1]]), small_config(), pad_id=50), ValueError, "pad_id"),
    (lambda: engram.ngram_hash(torch.tensor([[0, 1]]), {"layer_id": 3}), TypeError, "config"),
    (lambda: small_config(layer_id=4), ValueError, "layer_id"),
    (lambda: small_config(layer_ids=(3, 3)), ValueError, "layer_ids"),
    (lambda: small_config(max_ngram=1, table_size=31), ValueError, "max_ngram"),
    (lambda: small_config(table_size=(31,)), ValueError, "table_size"),
    (lambda: small_config(table_size=1), ValueError, "table_size"),
    (lambda: small_config(vocab_size=0), ValueError, "vocab_size"),
    (lambda: engram.HashConfig(layer_id=0, vocab_size=9, multipliers=(1, 4), table_sizes=((7,),)), ValueError,
     "multipliers"),
    (lambda: engram.gate(_X, _K[:, :1], _V, _WH, _WE), ValueError, "k_TND"),
    (lambda: engram.gate(_X, _K, _V[:, :3], _WH, _WE), ValueError, "v_TD"),
    (lambda: engram.gate(_X, _K, _V, _WH.T, _WE), ValueError, "wh_ND"),
    (lambda: engram.gate(_nan(_X), _K, _V, _WH, _WE), ValueError, "x_TND"),
    (lambda: engram.gate(_X, _K, _V, _WH, _nan(_WE)), ValueError, "we_ND"),
    (lambda: engram.gate(_X, _K, _V, _WH, _WE, clamp=0.0), ValueError, "clamp"),
    (lambda: engram.gate(_X, _K.long(), _V, _WH, _WE), TypeError, "k_TND"),
    (lambda: engram.short_conv(torch.randn(1, 5, 2, 4), torch.randn(2, 3, 4), dilation=3), ValueError, "weight_NDW"),
    (lambda: engram.short_conv(torch.randn(1, 5, 2, 4), torch.randn(2, 4, 4), dilation=0), ValueError, "dilation"),
]


@pytest.mark.parametrize("call, error, argname", BAD_INPUTS)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}:"):
        call()
