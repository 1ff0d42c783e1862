"""``bench kernels`` cases of ``kernels.permute``: the expert layout, expand and unexpand, and the
expand fused with an FP8 cast or a cast back."""

from __future__ import annotations

import math
from collections.abc import Callable

from .kernels_cases import Case, Inputs, nbytes

def _case_expert_layout(inp: Inputs, tk) -> Case:
    from kernels import permute
    from kernels.permute import reference

    s, idx, cap = inp.shape, inp.topk_idx_TK, inp.capacity
    return Case(
        "expert_layout", lambda: permute.expert_layout(idx, s.experts, alignment=s.alignment, num_rows=cap),
        lambda topk_idx_TK: reference.expert_layout(topk_idx_TK, s.experts, alignment=s.alignment, num_rows=cap),
        (idx,), bytes=nbytes(idx) + s.experts * 8 + s.tokens * s.topk * 4 + cap * 4,
        bytes_note="read idx [T,K] i64; write counts, offsets [E] i32, pos [T,K] i32, src [P_cap] i32 "
                   "(static capacity: no host sync)",
    )


def _case_expand(inp: Inputs, tk) -> Case:
    from kernels import permute
    from kernels.permute import reference

    x, layout = inp.x_TD, inp.layout
    return Case(
        "expand", lambda: permute.expand(x, layout), reference.expand, (x, layout),
        bytes=nbytes(x, layout.pos_TK, layout.src_P) + layout.num_rows * x.shape[1] * x.element_size(),
        bytes_note="read x [T,D] once + pos [T,K] + src [P]; write [P,D] (padding rows included)",
    )


def _case_unexpand(inp: Inputs, tk) -> Case:
    from kernels import permute
    from kernels.permute import reference

    y, layout, s = inp.y_PD, inp.layout, inp.shape
    row = y.shape[1] * y.element_size()
    return Case(
        "unexpand", lambda: permute.unexpand(y, layout), reference.unexpand, (y, layout),
        bytes=inp.routed * row + nbytes(layout.pos_TK) + s.tokens * s.topk * row,
        bytes_note="read the routed rows of y [P,D] + pos [T,K]; write [T,K,D]",
    )


def _case_expand_per_token_cast(inp: Inputs, tk) -> Case:
    from kernels import permute, quant
    from kernels.permute import reference

    x, layout = inp.x_TD, inp.layout
    p, d = layout.num_rows, x.shape[1]
    out_bytes = p * d + p * math.ceil(d / 128) * 4
    index_bytes = nbytes(layout.pos_TK, layout.src_P)
    return Case(
        "expand_per_token_cast", lambda: permute.expand_per_token_cast(x, layout), reference.expand_per_token_cast,
        (x, layout), bytes=nbytes(x) + index_bytes + out_bytes,
        bytes_note="read x [T,D] bf16 once + pos, src; write e4m3 [P,D] + f32 scales [P,D/128]",
        unfused=lambda: quant.per_token_cast(permute.expand(x, layout)),
        unfused_bytes=nbytes(x) + index_bytes + p * d * 2 + p * d * 2 + out_bytes,
        unfused_note="expand (writes bf16 [P,D]), then per_token_cast (reads it)",
    )


def _case_expand_cast_back(inp: Inputs, tk) -> Case:
    from kernels import permute, quant
    from kernels.permute import reference

    q, sf, layout = inp.q_TD, inp.sf_TG, inp.layout
    p, (t, d) = layout.num_rows, q.shape
    in_bytes = nbytes(q, sf, layout.pos_TK, layout.src_P)
    return Case(
        "expand_cast_back", lambda: permute.expand_cast_back(q, sf, layout), reference.expand_cast_back, (q, sf, layout),
        bytes=in_bytes + p * d * 2,
        bytes_note="read e4m3 [T,D] + f32 scales [T,D/128] once + pos, src; write bf16 [P,D] (padding rows included)",
        unfused=lambda: permute.expand(quant.cast_back(q, sf, block=(1, 128)), layout),
        unfused_bytes=in_bytes + t * d * 2 + t * d * 2 + p * d * 2,
        unfused_note="cast_back (writes bf16 [T,D]), then expand (reads it)",
    )


CASES: dict[str, Callable[..., Case]] = {
    "expert_layout": _case_expert_layout,
    "expand": _case_expand,
    "unexpand": _case_unexpand,
    "expand_per_token_cast": _case_expand_per_token_cast,
    "expand_cast_back": _case_expand_cast_back,
}
