"""``bench kernels`` cases of ``kernels.reduce`` and ``kernels.transpose``: the weighted reduce (bf16,
and FP8 rows dequantized on the way), the batched transpose and the scales to DeepGEMM's MN-major
layout."""

from __future__ import annotations

import math
from collections.abc import Callable

from .kernels_cases import Case, Inputs, nbytes

def _case_weighted_reduce(inp: Inputs, tk) -> Case:
    from kernels import reduce
    from kernels.reduce import reference

    y, pos, w = inp.y_PD, inp.layout.pos_TK, inp.weights_TK
    row = y.shape[1] * y.element_size()
    return Case(
        "weighted_reduce", lambda: reduce.weighted_reduce(y, pos, w), reference.weighted_reduce, (y, pos, w),
        bytes=inp.routed * row + nbytes(pos, w) + pos.shape[0] * row,
        bytes_note="read the routed rows of y [P,D] bf16 + pos, weights [T,K]; write [T,D] bf16",
    )


def _case_weighted_reduce_fp8(inp: Inputs, tk) -> Case:
    from kernels import quant, reduce
    from kernels.reduce import reference

    q, sf, pos, w = inp.q_PD, inp.sf_PG, inp.layout.pos_TK, inp.weights_TK
    d, groups = q.shape[1], sf.shape[1]
    t = pos.shape[0]

    def ref(q_PD, pos_TK, weights_TK, sf_PG):
        return reference.weighted_reduce(q_PD, pos_TK, weights_TK, sf_PG=sf_PG)

    fused_bytes = inp.routed * (d + groups * 4) + nbytes(pos, w) + t * d * 2
    p = q.shape[0]
    return Case(
        "weighted_reduce_fp8", lambda: reduce.weighted_reduce(q, pos, w, sf_PG=sf), ref, (q, pos, w, sf),
        bytes=fused_bytes,
        bytes_note="read the routed rows of q [P,D] e4m3 and their f32 scales + pos, weights; write [T,D] bf16",
        exact=True,
        unfused=lambda: reduce.weighted_reduce(quant.cast_back(q, sf, block=(1, 128)), pos, w),
        unfused_bytes=p * (d + groups * 4) + p * d * 2 + inp.routed * d * 2 + nbytes(pos, w) + t * d * 2,
        unfused_note="cast_back to bf16 [P,D], then weighted_reduce of it",
    )


def _case_batched_transpose(inp: Inputs, tk) -> Case:
    from kernels import transpose
    from kernels.transpose import reference

    s = inp.shape
    x = inp.x_TD.view(s.transpose_batch, s.tokens // s.transpose_batch, s.hidden)
    return Case(
        "batched_transpose", lambda: transpose.batched_transpose(x), reference.batched_transpose, (x,),
        bytes=2 * nbytes(x), bytes_note="read [B,T/B,D] bf16; write [B,D,T/B]",
    )


def _case_sf_to_mn_major(inp: Inputs, tk) -> Case:
    from kernels import transpose
    from kernels.quant import reference as quant
    from kernels.transpose import reference

    _, sf_TG = quant.per_token_cast(inp.x_TD, round_sf=True, pack_sf=True)

    def ref(sf):
        return reference.sf_to_mn_major(sf, pack_ue8m0=True)

    t, groups = sf_TG.shape
    return Case(
        "sf_to_mn_major", lambda: transpose.sf_to_mn_major(sf_TG, pack_ue8m0=True), ref, (sf_TG,),
        bytes=nbytes(sf_TG) + math.ceil(t / 4) * 4 * math.ceil(groups / 4) * 4,
        bytes_note="read UE8M0 exponents [T,D/128] u8; write int32 words [D/512,T] (MN-major, TMA-aligned)",
    )


CASES: dict[str, Callable[..., Case]] = {
    "weighted_reduce": _case_weighted_reduce,
    "weighted_reduce_fp8": _case_weighted_reduce_fp8,
    "batched_transpose": _case_batched_transpose,
    "sf_to_mn_major": _case_sf_to_mn_major,
}
