"""Permute references against slow per-expert, per-route loops written independently here."""

import pytest
import torch

from kernels.permute import ExpertLayout, expand, expert_layout, max_rows, unexpand


def draw_topk_idx(num_tokens, topk, num_experts):
    """Random routes with masked (-1) entries and, when E > 2, an expert that gets nothing."""
    idx_TK = torch.randint(-1, num_experts, (num_tokens, topk))
    if num_experts > 2:
        idx_TK[idx_TK == num_experts - 2] = 0
    return idx_TK


def slow_layout(idx, num_experts, alignment, num_rows):
    """Expert by expert, routes in ascending t * K + k, each segment padded to the alignment."""
    counts = [sum(e == x for row in idx for e in row) for x in range(num_experts)]
    offsets, end = [], 0
    for c in counts:
        end += -(-c // alignment) * alignment
        offsets.append(end)
    topk = len(idx[0]) if idx else 0
    pos = [[-1] * topk for _ in idx]
    src = [-1] * (end if num_rows is None else num_rows)
    for x in range(num_experts):
        row = offsets[x - 1] if x else 0
        for t, experts in enumerate(idx):
            for k, e in enumerate(experts):
                if e == x:
                    pos[t][k], src[row] = row, t * topk + k
                    row += 1
    return counts, offsets, pos, src


@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
@pytest.mark.parametrize("alignment", [1, 4, 128])
@pytest.mark.parametrize("num_experts", [1, 8])
@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_expert_layout(seed, num_tokens, topk, num_experts, alignment, static):
    idx_TK = draw_topk_idx(num_tokens, topk, num_experts).to(torch.int32)
    num_rows = max_rows(num_tokens, topk, num_experts, alignment) if static else None
    layout = expert_layout(idx_TK, num_experts, alignment=alignment, num_rows=num_rows)
    counts, offsets, pos, src = slow_layout(idx_TK.tolist(), num_experts, alignment, num_rows)
    for t in (layout.counts_E, layout.offsets_E, layout.pos_TK, layout.src_P):
        assert t.dtype == torch.int32
    assert layout.counts_E.tolist() == counts
    assert layout.offsets_E.tolist() == offsets
    assert layout.pos_TK.view(num_tokens, topk).tolist() == pos
    assert layout.src_P.tolist() == src
    assert layout.num_rows == len(src) and layout.alignment == alignment


def test_max_rows_is_reached():
    # Every count is 1 more than a multiple of the alignment: each expert pads alignment - 1 rows.
    idx_TK = torch.tensor([0, 1, 2, 3, 3, 3, 3, 3]).view(8, 1)
    assert max_rows(8, 1, 4, 4) == 20
    assert expert_layout(idx_TK, 4, alignment=4).num_rows == 20
    assert expert_layout(idx_TK, 4, alignment=4, num_rows=20).offsets_E.tolist() == [4, 8, 12, 20]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [0, 5, 37])
def test_expand(seed, num_tokens, dtype):
    topk, hidden = 3, 24
    idx_TK = draw_topk_idx(num_tokens, topk, 8)
    layout = expert_layout(idx_TK, 8, alignment=4, num_rows=max_rows(num_tokens, topk, 8, 4))
    x_TD = torch.randn(num_tokens, hidden).mul(10).to(dtype)
    x_PD = expand(x_TD, layout)
    assert x_PD.dtype == dtype and x_PD.shape == (layout.num_rows, hidden)
    bits = x_TD.view(torch.uint8) if dtype == torch.float8_e4m3fn else x_TD
    expected = [bits[r // topk].tolist() if r >= 0 else [0] * hidden for r in layout.src_P.tolist()]
    got = x_PD.view(torch.uint8) if dtype == torch.float8_e4m3fn else x_PD
    assert got.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [0, 5, 37])
def test_unexpand(seed, num_tokens, dtype):
    topk, hidden = 2, 16
    layout = expert_layout(draw_topk_idx(num_tokens, topk, 8), 8, alignment=4, num_rows=num_tokens * topk + 40)
    y_PD = torch.randn(layout.num_rows, hidden).mul(10).to(dtype)
    y_TKD = unexpand(y_PD, layout)
    assert y_TKD.dtype == dtype and y_TKD.shape == (num_tokens, topk, hidden)
    bits = y_PD.view(torch.uint8) if dtype == torch.float8_e4m3fn else y_PD
    expected = [[bits[p].tolist() if p >= 0 else [0] * hidden for p in row] for row in layout.pos_TK.tolist()]
    got = y_TKD.view(torch.uint8) if dtype == torch.float8_e4m3fn else y_TKD
    assert got.tolist() == expected


def test_unexpand_inverts_expand(seed):
    idx_TK = draw_topk_idx(29, 4, 6)
    layout = expert_layout(idx_TK, 6, alignment=8)
    x_TD = torch.randn(29, 12)
    y_TKD = unexpand(expand(x_TD, layout), layout)
    routed_TK = idx_TK >= 0
    assert torch.equal(y_TKD[routed_TK], x_TD[:, None].expand(-1, 4, -1)[routed_TK])
    assert (y_TKD[~routed_TK] == 0).all()


IDX = torch.tensor([[0, 1], [2, -1]])
LAYOUT = expert_layout(IDX, 4, alignment=4)
BAD_INPUTS = [
    (lambda: expert_layout(IDX.float(), 4), TypeError, "topk_idx_TK"),
    (lambda: expert_layout(IDX[0], 4), ValueError, "topk_idx_TK"),
    (lambda: expert_layout(IDX + 2, 4), ValueError, "topk_idx_TK"),
    (lambda: expert_layout(IDX - 1, 4), ValueError, "topk_idx_TK"),
    (lambda: expert_layout(IDX, 0), ValueError, "num_experts"),
    (lambda: expert_layout(IDX, 4, alignment=0), ValueError, "alignment"),
    (lambda: expert_layout(IDX, 4, alignment=4, num_rows=11), ValueError, "num_rows"),
    (lambda: expert_layout(IDX, 4, alignment=4, num_rows=12), ValueError, "num_rows"),  # needed, < max_rows
    (lambda: expert_layout(IDX, 4, alignment=4, routes_per_token=1), ValueError, "topk_idx_TK"),
    (lambda: expert_layout(IDX, 4, alignment=4, routes_per_token=0), ValueError, "routes_per_token"),
    (lambda: expert_layout(IDX, 4, num_rows=-1), ValueError, "num_rows"),
    (lambda: expand(torch.zeros(3, 8), LAYOUT), ValueError, "x_TD"),
    (lambda: expand(torch.zeros(2), LAYOUT), ValueError, "x_TD"),
    (lambda: expand([[0.0]], LAYOUT), TypeError, "x_TD"),
    (lambda: expand(torch.zeros(2, 8), IDX), TypeError, "layout"),
    (lambda: unexpand(torch.zeros(11, 8), LAYOUT), ValueError, "y_PD"),
    (lambda: unexpand(torch.zeros(12, 8), None), TypeError, "layout"),
    (lambda: max_rows(-1, 2, 4, 4), ValueError, "num_tokens"),
    (lambda: max_rows(8, 2.0, 4, 4), ValueError, "topk"),
    (lambda: max_rows(8, 2, 0, 4), ValueError, "num_experts"),
    (lambda: max_rows(8, 2, 4, 0), ValueError, "alignment"),
]


@pytest.mark.parametrize("call, error, argname", BAD_INPUTS)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()


def test_a_static_capacity_counts_the_routes_a_token_can_have():
    """A receiver's tokens have at most min(K, E_local) routes to its experts: its capacity is
    max_rows over that many, less than over K."""
    idx_TK = torch.tensor([[0, -1, -1], [-1, 1, -1]])
    layout = expert_layout(idx_TK, 2, alignment=4, num_rows=max_rows(2, 1, 2, 4), routes_per_token=1)
    assert layout.num_rows == 2 + 2 * 3 < max_rows(2, 3, 2, 4) and layout.offsets_E.tolist() == [4, 8]


def test_layout_is_frozen():
    assert isinstance(LAYOUT, ExpertLayout) and LAYOUT.num_rows == 12
    with pytest.raises(AttributeError):
        LAYOUT.alignment = 8
