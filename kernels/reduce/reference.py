"""Weighted reduction of expert outputs back to tokens in plain PyTorch: the specification.

After the experts ran on an expert-major layout (one row per route, see ``kernels.permute``), each
token's output is the router-weighted sum of its routes' rows. Routes marked -1 (dropped, or owned
elsewhere) are skipped, so a token with no routes gets zeros.

Shape suffixes: T tokens, K routes per token (top-k), P layout rows, D hidden, G scale groups along
D (``ceil(D / group)``), S rows returned to a home rank, W ranks.
"""

from __future__ import annotations

import torch

from kernels.permute.reference import ExpertLayout
from kernels.quant.reference import E4M3, FLOAT_DTYPES, SCALE_DTYPES, cast_back
from kernels.validate import check_dtype, check_index_range, check_positive, check_tensor


def weighted_reduce(
    y_PD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
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
        weights_TK: ``[T, K]`` float32 router weights (ignored where ``pos_TK`` is -1); None for
            weights of 1 (a plain sum of the rows: combine's home sum).
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
        term = y_PD[rows].float()
        out_TD[has_route_T] += term if weights_TK is None else weights_TK[has_route_T, route, None] * term
    return out_TD.to(out_dtype)


def weighted_reduce_backward(
    grad_TD: torch.Tensor, y_PD: torch.Tensor, weights_TK: torch.Tensor, layout: ExpertLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``weighted_reduce(y_PD, layout.pos_TK, weights_TK)`` given ``grad_TD``.

    Each route (t, k) with a row ``p = pos_TK[t, k]`` gets ``grad_PD[p] = grad[t] * weights[t, k]``
    (one float32 product per element, rounded to ``y_PD``'s dtype) and ``grad_weights[t, k] =
    sum_d y[p, d] * grad[t, d]`` (float32; summed in no particular order). Padding rows of the
    layout get zeros; rows past its last segment (``offsets_E[-1]``, the unused part of a static
    capacity) are unspecified (zeros here, unwritten by the kernel: a capacity costs nothing).

    Args:
        grad_TD: ``[T, D]`` float32, bfloat16 or float16, ``y_PD``'s dtype.
        y_PD: ``[P, D]`` the rows the forward reduced, ``P = layout.num_rows``.
        weights_TK: ``[T, K]`` float32 router weights (ignored where ``pos_TK`` is -1).
        layout: the :class:`ExpertLayout` that ``y_PD`` follows (``pos_TK`` and ``src_P`` inverse).

    Returns:
        ``(grad_PD [P, D] y's dtype, grad_weights_TK [T, K] float32, 0 for masked routes)``.
    """
    check_weighted_reduce_backward_args(grad_TD, y_PD, weights_TK, layout)
    pos_TK = layout.pos_TK.long()
    routed_TK = pos_TK >= 0
    rows_N = pos_TK[routed_TK]  # N: routes with a row
    grad_ND = grad_TD.float()[routed_TK.nonzero()[:, 0]]
    grad_weights_TK = torch.zeros(pos_TK.shape, dtype=torch.float32, device=y_PD.device)
    grad_weights_TK[routed_TK] = (y_PD[rows_N].float() * grad_ND).sum(1)
    grad_PD = torch.zeros_like(y_PD)
    grad_PD[rows_N] = (grad_ND * weights_TK[routed_TK][:, None]).to(y_PD.dtype)
    return grad_PD, grad_weights_TK


def reduce_sum_home(y_PD: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor, rows_SD: torch.Tensor,
                    home_TW: torch.Tensor, *, rank: int, sf_SG: torch.Tensor | None = None,
                    group: int = 128) -> torch.Tensor:
    """A combine's home side with the home rank's own rows reduced in: what
    ``kernels.comm.reduce_put`` storing token t's own row home and then the unit-weight sum over the
    returned rows (``ep_runtime``'s ``sum_home``) give, bit for bit, without the row's trip through
    memory. Token t's routes to this rank are reduced (:func:`weighted_reduce`, in ``rows_SD``'s
    dtype, as ``reduce_put`` stores them) and summed with the rows the other ranks returned,
    ``rows_SD[home_TW[t, w]]``, in float32 in rank order, the own row at position ``rank``.

    With e4m3 ``rows_SD`` (combine's FP8 transport: ``reduce_put`` into ``TokenRegions``) the
    returned rows are dequantized with ``sf_SG`` (``q.float() * sf``), the own row stays in
    ``y_PD``'s dtype (it never travels), and the sum is in ``y_PD``'s dtype.

    Args:
        y_PD: [P, D] expert outputs; pos_TK, weights_TK: [T, K] routes of this rank's own received
            rows (token t's row ``rank * T_max + t``), as ``reduce_put`` takes them.
        rows_SD: [S, D] this rank's copy of the region the other ranks returned rows into.
        home_TW: [T, W] int32 or int64 rows of ``rows_SD`` (-1: none); column ``rank`` only says
            whether token t has a route here (>= 0).
        rank: this rank.
        sf_SG: [S, ceil(D / group)] float32 scales of e4m3 ``rows_SD`` (None otherwise).
        group: columns per scale.

    Returns:
        [T, D] in ``rows_SD``'s dtype (``y_PD``'s for e4m3 rows).
    """
    out_dtype = check_reduce_sum_home_args(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank, sf_SG, group)
    num_rows, num_tokens = rows_SD.shape[0], home_TW.shape[0]
    others = [w for w in range(home_TW.shape[1]) if w != rank]
    check_index_range("home_TW", home_TW[:, others], num_rows)
    own_TD = weighted_reduce(y_PD, pos_TK, weights_TK, out_dtype=out_dtype)
    if rows_SD.dtype == E4M3:
        rows_SD, own_TD = cast_back(rows_SD, sf_SG, block=(1, group), out_dtype=torch.float32), own_TD.float()
    rows_TW = home_TW.long().clone()
    own = torch.arange(num_rows, num_rows + num_tokens, device=home_TW.device)
    rows_TW[:, rank] = torch.where(home_TW[:, rank] >= 0, own, -1)
    return weighted_reduce(torch.cat([rows_SD, own_TD]), rows_TW, None, out_dtype=out_dtype)


def check_reduce_sum_home_args(y_PD, pos_TK, weights_TK, rows_SD, home_TW, rank, sf_SG=None, group=128) -> torch.dtype:
    """Validates :func:`reduce_sum_home`'s arguments but for ``home_TW``'s values (shared with its
    kernel, which reads an out-of-range row as -1: checking costs a host sync); returns the output
    dtype."""
    check_tensor("rows_SD", rows_SD, dtype=(*FLOAT_DTYPES, E4M3), ndim=2)
    check_tensor("y_PD", y_PD, dtype=FLOAT_DTYPES, ndim=2, device=rows_SD.device)
    out_dtype = y_PD.dtype if rows_SD.dtype == E4M3 else rows_SD.dtype
    check_weighted_reduce_args(y_PD, pos_TK, weights_TK, None, 128, out_dtype, values=False)
    check_tensor("rows_SD", rows_SD, shape=(None, y_PD.shape[1]))
    if rows_SD.dtype == E4M3:
        check_positive("group", group)
        check_tensor("sf_SG", sf_SG, dtype=torch.float32, shape=(rows_SD.shape[0], -(-y_PD.shape[1] // group)),
                     device=rows_SD.device)
    elif sf_SG is not None:
        raise ValueError(f"sf_SG: expected None with {rows_SD.dtype} rows_SD (scales only with float8_e4m3fn)")
    check_tensor("home_TW", home_TW, dtype=(torch.int32, torch.int64), shape=(pos_TK.shape[0], None),
                 device=y_PD.device)
    if type(rank) is not int or not 0 <= rank < home_TW.shape[1]:
        raise ValueError(f"rank: expected a column of home_TW's {home_TW.shape[1]}, got {rank!r}")
    return out_dtype


def check_weighted_reduce_backward_args(grad_TD, y_PD, weights_TK, layout, *, values: bool = True) -> None:
    """Validates :func:`weighted_reduce_backward`'s arguments (shared with its kernel, which skips
    the ``values`` check: a host sync)."""
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout: expected an ExpertLayout, got {type(layout).__name__}")
    check_weighted_reduce_backward_tensors(grad_TD, y_PD, weights_TK, layout.pos_TK, layout.src_P)
    if values:
        check_index_range("layout.pos_TK", layout.pos_TK, layout.num_rows)


def check_weighted_reduce_backward_tensors(grad_TD, y_PD, weights_TK, pos_TK, src_P) -> None:
    """:func:`check_weighted_reduce_backward_args` but for the layout's type and values, given its
    ``pos_TK`` and ``src_P`` (one per row)."""
    check_tensor("y_PD", y_PD, dtype=FLOAT_DTYPES, shape=(src_P.shape[0], None), device=pos_TK.device)
    check_tensor("grad_TD", grad_TD, dtype=y_PD.dtype, shape=(pos_TK.shape[0], y_PD.shape[1]), device=y_PD.device)
    check_tensor("weights_TK", weights_TK, dtype=torch.float32, shape=pos_TK.shape, device=y_PD.device)


def check_weighted_reduce_args(y_PD, pos_TK, weights_TK, sf_PG, group, out_dtype, *, values: bool = True) -> torch.dtype:
    """Validates :func:`weighted_reduce`'s arguments (shared with its kernel, which skips the
    ``values`` check: it costs a host sync); returns the output dtype (``y_PD``'s, bfloat16 for
    e4m3 input, unless ``out_dtype`` is given)."""
    check_tensor("y_PD", y_PD, dtype=(*FLOAT_DTYPES, E4M3), ndim=2)
    p, d = y_PD.shape
    check_tensor("pos_TK", pos_TK, dtype=(torch.int32, torch.int64), ndim=2, device=y_PD.device)
    if weights_TK is not None:
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
