"""Weighted reduction of expert outputs back to tokens in plain PyTorch: the specification.

After the experts ran on an expert-major layout (one row per route, see ``kernels.permute``), each
token's output is the router-weighted sum of its routes' rows. Routes marked -1 (dropped, or owned
elsewhere) are skipped, so a token with no routes gets zeros.

Shape suffixes: T tokens, K routes per token (top-k), P layout rows, D hidden, G scale groups along
D (``ceil(D / group)``).
"""

from __future__ import annotations

import torch

from kernels.quant.reference import E4M3, FLOAT_DTYPES, SCALE_DTYPES, cast_back
from kernels.validate import check_dtype, check_index_range, check_positive, check_tensor


def weighted_reduce(
    y_PD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    sf_PG: torch.Tensor | None = None,
    group: int = 128,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[t] = sum over k with pos[t, k] != -1 of weights[t, k] * y[pos[t, k]]``.

    The sum is accumulated in float32 in the order k = 0 .. K-1 (each term rounded to float32, then
    added).

    Args:
        y_PD: ``[P, D]`` float32, bfloat16 or float16; or float8_e4m3fn together with ``sf_PG``.
        pos_TK: ``[T, K]`` int32 or int64, the layout row of each route, or -1 for none.
        weights_TK: ``[T, K]`` float32 router weights (ignored where ``pos_TK`` is -1).
        sf_PG: ``[P, ceil(D / group)]`` per-token scales of an e4m3 ``y_PD``, float32 or uint8
            exponents (packed UE8M0); rows are dequantized (``q.float() * sf``) before the sum.
            Only with an e4m3 ``y_PD``.
        group: hidden columns per scale in ``sf_PG``.
        out_dtype: float32, bfloat16 or float16; default ``y_PD.dtype``, bfloat16 for e4m3 input.

    Returns:
        ``out_TD`` ``[T, D]`` in ``out_dtype``.
    """
    out_dtype = check_weighted_reduce_args(y_PD, pos_TK, weights_TK, sf_PG, group, out_dtype)
    d = y_PD.shape[1]
    if y_PD.dtype == E4M3:
        y_PD = cast_back(y_PD, sf_PG, block=(1, group), out_dtype=torch.float32)

    t, k = pos_TK.shape
    out_TD = torch.zeros(t, d, dtype=torch.float32, device=y_PD.device)
    for route in range(k):
        has_route_T = pos_TK[:, route] >= 0
        rows = pos_TK[has_route_T, route]
        out_TD[has_route_T] += weights_TK[has_route_T, route, None] * y_PD[rows].float()
    return out_TD.to(out_dtype)


def check_weighted_reduce_args(y_PD, pos_TK, weights_TK, sf_PG, group, out_dtype, *, values: bool = True) -> torch.dtype:
    """Validates :func:`weighted_reduce`'s arguments (shared with its kernel, which skips the
    ``values`` check: it costs a host sync); returns the output dtype (``y_PD``'s, bfloat16 for
    e4m3 input, unless ``out_dtype`` is given)."""
    check_tensor("y_PD", y_PD, dtype=(*FLOAT_DTYPES, E4M3), ndim=2)
    p, d = y_PD.shape
    check_tensor("pos_TK", pos_TK, dtype=(torch.int32, torch.int64), ndim=2, device=y_PD.device)
    check_tensor("weights_TK", weights_TK, dtype=torch.float32, shape=pos_TK.shape, device=y_PD.device)
    if values:
        check_index_range("pos_TK", pos_TK, p)
    check_positive("group", group)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if y_PD.dtype == E4M3 else y_PD.dtype
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    if y_PD.dtype == E4M3:
        if sf_PG is None:
            raise ValueError("sf_PG: expected per-token scales with a float8_e4m3fn y_PD, got None")
        check_tensor("sf_PG", sf_PG, dtype=SCALE_DTYPES, shape=(p, -(-d // group)), device=y_PD.device)
    elif sf_PG is not None:
        raise ValueError(f"sf_PG: expected None with a {y_PD.dtype} y_PD (scales only with float8_e4m3fn)")
    return out_dtype
