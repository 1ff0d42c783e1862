"""Routing references against slow per-token, per-expert loops written independently here."""

import math
import struct

import pytest
import torch

from kernels.routing import (
    expert_counts,
    hash_route,
    score,
    sequence_balance_stats,
    topk_route,
    topk_weights,
)

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


def f32(v: float) -> float:
    """Rounds a Python float to the nearest float32 (a sum of two float32 done in double and rounded
    so equals the float32 sum)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def slow_score(row: list[float], scoring: str) -> list[float]:
    if scoring == "softmax":
        top = max(row)
        exps = [math.exp(v - top) for v in row]
        return [e / sum(exps) for e in exps]
    if scoring == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) for v in row]
    return [math.sqrt(math.log1p(math.exp(v))) for v in row]


def slow_route(scores, bias, topk, num_groups, topk_groups, normalize, factor):
    """Per token: biased selection scores, best groups by top-2 sum, best experts; ties to lower index."""
    num_experts = len(bias)
    size = num_experts // num_groups
    idx, weights = [], []
    for row in scores:
        select = [f32(s + b) for s, b in zip(row, bias)]
        group_score = []
        for g in range(num_groups):
            best = sorted(select[g * size : (g + 1) * size], reverse=True)
            group_score.append(f32(best[0] + best[1]) if size > 1 else best[0])
        groups = sorted(range(num_groups), key=lambda g: (-group_score[g], g))[:topk_groups]
        allowed = [e for e in range(num_experts) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: (-select[e], e))[:topk]
        w = [row[e] for e in chosen]
        total = sum(w)
        idx.append(chosen)
        weights.append([(v / total if normalize else v) * factor for v in w])
    return idx, weights


def slow_weights(scores, idx, normalize, factor):
    out = []
    for row, chosen in zip(scores, idx):
        w = [row[e] if e >= 0 else 0.0 for e in chosen]
        total = sum(w)
        out.append([(v / total if normalize and total > 0 else v) * factor for v in w])
    return out


def draw_logits(num_tokens, num_experts, ties, dtype=torch.float32):
    if ties:  # few distinct values, so many scores tie exactly
        return (torch.randint(-2, 3, (num_tokens, num_experts)) * 0.5).to(dtype)
    return torch.randn(num_tokens, num_experts).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_score(seed, scoring, dtype):
    logits_TE = torch.randn(29, 11).mul(3).to(dtype)
    scores_TE = score(logits_TE, scoring)
    assert scores_TE.dtype == torch.float32 and scores_TE.shape == (29, 11)
    expected = [slow_score(row, scoring) for row in logits_TE.float().tolist()]
    torch.testing.assert_close(scores_TE, torch.tensor(expected), rtol=2e-6, atol=1e-7)


# (experts, num_groups, topk_groups, topk)
GROUPINGS = [(16, 1, None, 6), (16, 4, 2, 5), (16, 8, 3, 6), (16, 4, 4, 3), (12, 12, 5, 4), (12, 3, 1, 4)]
# (bias, normalize, routed_scaling_factor)
OPTIONS = [(False, False, 1.0), (True, True, 2.5), (True, False, 1.5)]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("bias, normalize, factor", OPTIONS)
@pytest.mark.parametrize("num_experts, num_groups, topk_groups, topk", GROUPINGS)
@pytest.mark.parametrize("scoring", SCORINGS)
def test_topk_route(seed, scoring, num_experts, num_groups, topk_groups, topk, bias, normalize, factor, ties):
    logits_TE = draw_logits(37, num_experts, ties)
    bias_E = None
    if bias:
        bias_E = torch.randint(-2, 3, (num_experts,)) * 0.125 if ties else torch.randn(num_experts) * 0.1
    idx_TK, weights_TK = topk_route(
        logits_TE,
        topk=topk,
        scoring=scoring,
        bias_E=bias_E,
        num_groups=num_groups,
        topk_groups=topk_groups,
        normalize=normalize,
        routed_scaling_factor=factor,
    )
    scores = score(logits_TE, scoring).tolist()
    bias = bias_E.tolist() if bias else [0.0] * num_experts
    expected_idx, expected_w = slow_route(
        scores, bias, topk, num_groups, topk_groups or num_groups, normalize, factor
    )
    assert idx_TK.dtype == torch.int64 and weights_TK.dtype == torch.float32
    assert idx_TK.tolist() == expected_idx
    torch.testing.assert_close(weights_TK, torch.tensor(expected_w), rtol=1e-6, atol=1e-7)
    same_TK = topk_weights(logits_TE, idx_TK, scoring=scoring, normalize=normalize, routed_scaling_factor=factor)
    assert torch.equal(weights_TK, same_TK)


def test_topk_route_ties_go_to_lower_index():
    logits_TE = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    idx_TK, _ = topk_route(logits_TE, topk=3, scoring="sigmoid")
    assert idx_TK.tolist() == [[1, 2, 4]]
    # Groups {0,1,2} and {3,4,5} both score 2 * sigmoid(1): the lower group wins.
    idx_TK, _ = topk_route(logits_TE, topk=2, scoring="sigmoid", num_groups=2, topk_groups=1)
    assert idx_TK.tolist() == [[1, 2]]


def test_topk_route_bf16_logits(seed):
    logits_TE = torch.randn(21, 8).to(torch.bfloat16)
    idx_TK, weights_TK = topk_route(logits_TE, topk=3, scoring="sigmoid", normalize=True)
    expected_idx, expected_w = slow_route(score(logits_TE, "sigmoid").tolist(), [0.0] * 8, 3, 1, 1, True, 1.0)
    assert idx_TK.tolist() == expected_idx
    torch.testing.assert_close(weights_TK, torch.tensor(expected_w), rtol=1e-6, atol=1e-7)


def test_bias_changes_selection_not_weights(seed):
    logits_TE = torch.randn(40, 8)
    bias_E = torch.zeros(8)
    bias_E[5] = 10.0
    plain_TK, _ = topk_route(logits_TE, topk=2, scoring="sigmoid")
    idx_TK, weights_TK = topk_route(logits_TE, topk=2, scoring="sigmoid", bias_E=bias_E)
    assert (idx_TK[:, 0] == 5).all()
    assert not torch.equal(idx_TK, plain_TK)
    assert torch.equal(weights_TK[:, 0], score(logits_TE, "sigmoid")[:, 5])


def test_topk_route_no_tokens():
    idx_TK, weights_TK = topk_route(torch.empty(0, 16), topk=4, num_groups=4, topk_groups=2, normalize=True)
    assert idx_TK.shape == (0, 4) and idx_TK.dtype == torch.int64
    assert weights_TK.shape == (0, 4) and weights_TK.dtype == torch.float32


@pytest.mark.parametrize("num_tokens", [0, 1, 23])
@pytest.mark.parametrize("normalize, factor", [(False, 1.0), (True, 2.5)])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_topk_weights_with_masked_routes(seed, scoring, normalize, factor, num_tokens):
    logits_TE = torch.randn(num_tokens, 10)
    idx_TK = torch.randint(-1, 10, (num_tokens, 4), dtype=torch.int32)
    if num_tokens:
        idx_TK[0] = -1  # a token with every route masked keeps weights 0
    weights_TK = topk_weights(logits_TE, idx_TK, scoring=scoring, normalize=normalize, routed_scaling_factor=factor)
    expected = slow_weights(score(logits_TE, scoring).tolist(), idx_TK.tolist(), normalize, factor)
    assert weights_TK.dtype == torch.float32
    torch.testing.assert_close(weights_TK, torch.tensor(expected).view(num_tokens, 4), rtol=1e-6, atol=1e-7)
    assert (weights_TK[idx_TK < 0] == 0).all()


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_topk_weights_gradient(seed, scoring, normalize):
    logits_TE = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    idx_TK = torch.tensor([[0, 3, -1], [5, 1, 2], [-1, -1, -1], [4, -1, 0]])

    def weights(x_TE):
        return topk_weights(x_TE, idx_TK, scoring=scoring, normalize=normalize, routed_scaling_factor=1.5)

    assert weights(logits_TE).dtype == torch.float64
    assert torch.autograd.gradcheck(weights, (logits_TE,))


@pytest.mark.parametrize("num_tokens", [0, 1, 33])
def test_hash_route(seed, num_tokens):
    table_VK = torch.randint(0, 64, (50, 3), dtype=torch.int32)
    token_ids_T = torch.randint(0, 50, (num_tokens,))
    idx_TK = hash_route(token_ids_T, table_VK)
    assert idx_TK.dtype == torch.int64 and idx_TK.shape == (num_tokens, 3)
    table = table_VK.tolist()
    assert idx_TK.tolist() == [table[i] for i in token_ids_T.tolist()]


@pytest.mark.parametrize("num_tokens", [0, 1, 45])
def test_expert_counts(seed, num_tokens):
    idx_TK = torch.randint(-1, 12, (num_tokens, 3))
    idx_TK[idx_TK == 7] = 3  # expert 7 gets nothing
    counts_E = expert_counts(idx_TK, 12)
    expected = [0] * 12
    for row in idx_TK.tolist():
        for e in row:
            if e >= 0:
                expected[e] += 1
    assert counts_E.dtype == torch.int32
    assert counts_E.tolist() == expected


@pytest.mark.parametrize("batch, seq_len", [(3, 17), (2, 1), (2, 0), (0, 5)])
def test_sequence_balance_stats(seed, batch, seq_len):
    num_experts, topk = 8, 3
    scores_BSE = torch.rand(batch, seq_len, num_experts) + 0.01
    idx_BSK = torch.randint(-1, num_experts, (batch, seq_len, topk))
    load_BE, prob_BE = sequence_balance_stats(scores_BSE, idx_BSK)
    load, prob = [], []
    for b in range(batch):
        counts, sums = [0] * num_experts, [0.0] * num_experts
        for s in range(seq_len):
            row = scores_BSE[b, s].tolist()
            for e in idx_BSK[b, s].tolist():
                if e >= 0:
                    counts[e] += 1
            for i in range(num_experts):
                sums[i] += row[i] / sum(row)
        load.append([num_experts * c / (topk * seq_len) if seq_len else 0.0 for c in counts])
        prob.append([v / seq_len if seq_len else 0.0 for v in sums])
    assert load_BE.dtype == prob_BE.dtype == torch.float32
    torch.testing.assert_close(load_BE, torch.tensor(load).view(batch, num_experts), rtol=1e-6, atol=0)
    torch.testing.assert_close(prob_BE, torch.tensor(prob).view(batch, num_experts), rtol=1e-5, atol=1e-7)


def test_balanced_routing_gives_aux_loss_one():
    # Uniform scores and every expert chosen equally often: f_i = 1, P_i = 1/E, sum_i f_i P_i = 1.
    idx_BSK = torch.arange(8).repeat(2, 4).view(2, 16, 2)
    load_BE, prob_BE = sequence_balance_stats(torch.full((2, 16, 8), 0.3), idx_BSK)
    assert torch.equal(load_BE, torch.ones(2, 8))
    torch.testing.assert_close((load_BE * prob_BE).sum(-1).mean(), torch.tensor(1.0))


L = torch.randn(4, 8)
IDX = torch.zeros(4, 2, dtype=torch.int64)
BAD_INPUTS = [
    (lambda: score(L.long(), "softmax"), TypeError, "logits_TE"),
    (lambda: score(L[0], "softmax"), ValueError, "logits_TE"),
    (lambda: score(torch.tensor([[0.0, float("nan")]]), "softmax"), ValueError, "logits_TE"),
    (lambda: score(torch.tensor([[0.0, float("inf")]]), "sigmoid"), ValueError, "logits_TE"),
    (lambda: score(L, "relu"), ValueError, "scoring"),
    (lambda: score([[0.0]], "softmax"), TypeError, "logits_TE"),
    (lambda: topk_route(torch.tensor([[float("nan")] * 8]), topk=2), ValueError, "logits_TE"),
    (lambda: topk_route(L, topk=2, num_groups=3), ValueError, "num_groups"),
    (lambda: topk_route(L, topk=2, num_groups=0), ValueError, "num_groups"),
    (lambda: topk_route(L, topk=9), ValueError, "topk"),
    (lambda: topk_route(L, topk=0), ValueError, "topk"),
    (lambda: topk_route(L, topk=2, routed_scaling_factor="2"), ValueError, "routed_scaling_factor"),
    (lambda: topk_route(L, topk=2, routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor"),
    (lambda: topk_route(L, topk=5, num_groups=4, topk_groups=2), ValueError, "topk"),
    (lambda: topk_route(L, topk=2, num_groups=4, topk_groups=5), ValueError, "topk_groups"),
    (lambda: topk_route(L, topk=2, num_groups=4, topk_groups=0), ValueError, "topk_groups"),
    (lambda: topk_route(L, topk=2, bias_E=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "bias_E"),
    (lambda: topk_route(L, topk=2, bias_E=torch.zeros(7)), ValueError, "bias_E"),
    (lambda: topk_route(L, topk=2, bias_E=torch.full((8,), float("nan"))), ValueError, "bias_E"),
    (lambda: topk_weights(L, IDX.float()), TypeError, "topk_idx_TK"),
    (lambda: topk_weights(L, IDX[:3]), ValueError, "topk_idx_TK"),
    (lambda: topk_weights(L, IDX + 8), ValueError, "topk_idx_TK"),
    (lambda: topk_weights(L, IDX - 2), ValueError, "topk_idx_TK"),
    (lambda: hash_route(torch.tensor([0, 10]), torch.zeros(10, 2, dtype=torch.int64)), ValueError, "token_ids_T"),
    (lambda: hash_route(torch.tensor([-1]), torch.zeros(10, 2, dtype=torch.int64)), ValueError, "token_ids_T"),
    (lambda: hash_route(torch.tensor([0.0]), torch.zeros(10, 2, dtype=torch.int64)), TypeError, "token_ids_T"),
    (lambda: hash_route(torch.tensor([0]), torch.zeros(10, dtype=torch.int64)), ValueError, "table_VK"),
    (lambda: hash_route(torch.tensor([0]), torch.zeros(10, 2)), TypeError, "table_VK"),
    (lambda: expert_counts(IDX + 8, 8), ValueError, "topk_idx_TK"),
    (lambda: expert_counts(IDX[0], 8), ValueError, "topk_idx_TK"),
    (lambda: expert_counts(IDX, 0), ValueError, "num_experts"),
    (lambda: sequence_balance_stats(L, IDX), ValueError, "scores_BSE"),
    (lambda: sequence_balance_stats(L.long()[None], IDX[None]), TypeError, "scores_BSE"),
    (lambda: sequence_balance_stats(L[None], IDX[None, :3]), ValueError, "topk_idx_BSK"),
    (lambda: sequence_balance_stats(L[None], IDX[None] + 8), ValueError, "topk_idx_BSK"),
]


@pytest.mark.parametrize("call, error, argname", BAD_INPUTS)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()
