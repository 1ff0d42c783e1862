"""Permutation ops in plain PyTorch: the specification of the permute kernels.

Routes are laid out expert-major for grouped GEMM: expert e owns one contiguous segment of rows,
padded to a multiple of ``alignment``; ``offsets_E`` holds the segments' end rows, which is what
``torch._grouped_mm`` takes as ``offs``. Inside a segment, rows follow the flattened route index
``r = t * K + k`` in ascending order, so the layout is deterministic.

Shape suffixes:
    T  tokens
    K  routes per token (top-k)
    E  experts
    D  hidden size
    P  layout rows (routes plus padding)
    R  flattened routes, T * K

An expert index of -1 in ``topk_idx_TK`` marks a masked route (it gets no row); a row or position of
-1 in a layout marks padding or a masked route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant.reference import E4M3, FLOAT_DTYPES, cast_back, per_token_cast
from kernels.validate import check_index_range, check_positive, check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, eq=False)
class ExpertLayout:
    """Where each route sits in the expert-major layout (all tensors int32, on the routes' device).

    Attributes:
        counts_E: [E] routes per expert.
        offsets_E: [E] end row of each expert's segment (cumulative, padded); expert e's segment is
            ``[offsets_E[e-1] (0 for e = 0), offsets_E[e])``, empty when it has no routes.
        pos_TK: [T, K] row of route (t, k), -1 for a masked route.
        src_P: [P] flattened route index ``t * K + k`` held by each row, -1 for a padding row.
        alignment: every segment's length is a multiple of it.
    """

    counts_E: torch.Tensor
    offsets_E: torch.Tensor
    pos_TK: torch.Tensor
    src_P: torch.Tensor
    alignment: int

    @property
    def num_rows(self) -> int:
        """P, the rows of the layout (segments, then padding up to a static capacity if one was given)."""
        return self.src_P.shape[0]


def max_rows(num_tokens: int, topk: int, num_experts: int, alignment: int) -> int:
    """Worst-case P for T tokens with at most K routes each (``topk``: K, or fewer where the caller
    knows a token has fewer routes to these experts): every route, plus ``alignment - 1`` padding
    rows per expert. A static capacity for :func:`expert_layout` that needs no host sync."""
    for name, value in (("num_tokens", num_tokens), ("topk", topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    check_positive("num_experts", num_experts)
    check_positive("alignment", alignment)
    return num_tokens * topk + num_experts * (alignment - 1)


def expert_layout(
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    *,
    alignment: int = 128,
    num_rows: int | None = None,
    routes_per_token: int | None = None,
) -> ExpertLayout:
    """Lays the routes out expert-major, each expert's segment padded to a multiple of ``alignment``.

    Args:
        topk_idx_TK: [T, K] int32 or int64 experts in [0, num_experts), or -1 for a masked route.
        num_experts: E.
        alignment: segment lengths are multiples of it (e.g. the grouped GEMM's row tile).
        num_rows: P. None: exactly the rows needed, ``offsets_E[-1]`` (reads it on the host). An int:
            a static capacity, at least ``max_rows(T, routes_per_token, E, alignment)`` (what the
            kernel needs, so that no batch can overflow it); rows past ``offsets_E[-1]`` are padding.
        routes_per_token: the most unmasked routes a token has (default K): a receiver whose
            senders route each token to distinct experts has at most ``min(K, E)`` to its own.

    Returns:
        The :class:`ExpertLayout`.
    """
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=INDEX_DTYPES, ndim=2)
    check_positive("num_experts", num_experts)
    check_positive("alignment", alignment)
    check_index_range("topk_idx_TK", topk_idx_TK, num_experts)
    device = topk_idx_TK.device

    # Masked routes get the key E, so a stable sort puts them after every expert's routes.
    key_R = topk_idx_TK.reshape(-1).long()
    key_R = torch.where(key_R >= 0, key_R, num_experts)
    order_R = key_R.sort(stable=True).indices
    sorted_key_R = key_R[order_R]

    counts_X = torch.bincount(key_R, minlength=num_experts + 1)  # X = E + 1: the experts, then masked
    counts_E = counts_X[:num_experts]
    padded_E = (counts_E + alignment - 1) // alignment * alignment
    offsets_E = padded_E.cumsum(0)
    num_tokens, topk = topk_idx_TK.shape
    if routes_per_token is not None:
        check_positive("routes_per_token", routes_per_token)
        most = int((topk_idx_TK >= 0).sum(1).max()) if num_tokens else 0
        if most > routes_per_token:
            raise ValueError(f"topk_idx_TK: expected at most {routes_per_token} routes a token (routes_per_token), "
                             f"got a token with {most}")
    if num_rows is None:
        num_rows = int(offsets_E[-1])
    else:
        capacity = max_rows(num_tokens, routes_per_token or topk, num_experts, alignment)
        if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < capacity:
            raise ValueError(f"num_rows: expected an int >= {capacity} (max_rows for this batch) or None, "
                             f"got {num_rows!r}")

    # A route's row: its segment's start plus its rank among its expert's routes.
    first_X = counts_X.cumsum(0) - counts_X
    start_X = torch.cat([offsets_E - padded_E, offsets_E.new_full((1,), -1)])
    rank_R = torch.arange(key_R.numel(), device=device) - first_X[sorted_key_R]
    routed_R = sorted_key_R < num_experts
    row_R = torch.where(routed_R, start_X[sorted_key_R] + rank_R, -1)

    pos_R = torch.empty_like(row_R).scatter_(0, order_R, row_R)
    src_P = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    src_P[row_R[routed_R]] = order_R[routed_R]
    return ExpertLayout(
        counts_E=counts_E.to(torch.int32),
        offsets_E=offsets_E.to(torch.int32),
        pos_TK=pos_R.view(topk_idx_TK.shape).to(torch.int32),
        src_P=src_P.to(torch.int32),
        alignment=alignment,
    )


def expand(x_TD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Gathers tokens into the layout: row p holds ``x_TD[src_P[p] // K]``, padding rows are 0.
    Rows past the last segment (``offsets_E[-1]``, the unused part of a static capacity) are
    unspecified: zeros here, left unwritten by the kernel; nothing may read them.

    Args:
        x_TD: [T, D] any dtype (float8 included), on the layout's device.
        layout: from :func:`expert_layout` for this batch's ``topk_idx_TK``.

    Returns:
        x_PD: [P, D] same dtype as ``x_TD``.
    """
    _check_layout(layout)
    num_tokens, topk = layout.pos_TK.shape
    check_tensor("x_TD", x_TD, shape=(num_tokens, None), device=layout.src_P.device)
    src_P = layout.src_P.long()
    rows_N = (src_P >= 0).nonzero().squeeze(1)  # N: rows that hold a route
    bits_TD = _as_bits(x_TD)
    bits_PD = bits_TD.new_zeros(layout.num_rows, x_TD.shape[1])
    bits_PD[rows_N] = bits_TD[src_P[rows_N] // topk]
    return bits_PD.view(x_TD.dtype)


def unexpand(y_PD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Gathers layout rows back per route: ``y_TKD[t, k] = y_PD[pos_TK[t, k]]``, 0 for masked routes.

    Args:
        y_PD: [P, D] any dtype (float8 included), on the layout's device.
        layout: the :class:`ExpertLayout` that ``y_PD`` follows.

    Returns:
        y_TKD: [T, K, D] same dtype as ``y_PD``.
    """
    _check_layout(layout)
    check_tensor("y_PD", y_PD, shape=(layout.num_rows, None), device=layout.pos_TK.device)
    pos_TK = layout.pos_TK.long()
    routed_TK = pos_TK >= 0
    bits_PD = _as_bits(y_PD)
    bits_TKD = bits_PD.new_zeros(*pos_TK.shape, y_PD.shape[1])
    bits_TKD[routed_TK] = bits_PD[pos_TK[routed_TK]]
    return bits_TKD.view(y_PD.dtype)


def _check_layout(layout: object) -> None:
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout: expected an ExpertLayout, got {type(layout).__name__}")


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """One-byte dtypes (float8 among them) viewed as uint8, since not every indexing op takes float8."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


# FP8 on the way into the layout and back (the formats of :mod:`kernels.quant.reference`).
def expand_per_token_cast(
    x_TD: torch.Tensor, layout: ExpertLayout, *, group: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.permute.expand` fused with :func:`per_token_cast`: the layout's rows cast to
    e4m3, scales laid out per layout row (padding rows hold zeros and the floor scale).

    Args:
        x_TD: ``[T, D]`` float32, bfloat16 or float16, on the layout's device.
        layout: the :class:`kernels.permute.ExpertLayout` of this batch's routes.
        group, round_sf, pack_sf: as in :func:`per_token_cast`.

    Returns:
        ``q_PD`` ``[P, D]`` float8_e4m3fn and ``sf_PG`` ``[P, ceil(D / group)]`` float32 (uint8 when
        packed).
    """
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, ndim=2)
    return per_token_cast(expand(x_TD, layout), group=group, round_sf=round_sf, pack_sf=pack_sf)


def expand_cast_back(
    q_TD: torch.Tensor, sf_TG: torch.Tensor, layout: ExpertLayout, *, group: int = 128,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """:func:`cast_back` of per-token scales fused with :func:`kernels.permute.expand`: FP8 rows as
    they arrive from a dispatch, dequantized into the layout's rows (padding rows hold zeros).

    Args:
        q_TD: ``[T, D]`` float8_e4m3fn, on the layout's device. Rows no route points to may hold
            anything (unused rows of a receive buffer); they are never read into the result.
        sf_TG: ``[T, ceil(D / group)]`` float32 scales, or uint8 exponents (packed).
        layout: the :class:`kernels.permute.ExpertLayout` of the rows' routes.
        group: columns per scale.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``x_PD`` ``[P, D]`` in ``out_dtype``: row p is ``cast_back(q, sf)[src_P[p] // K]``, zeros where
        ``src_P[p]`` is -1; rows past ``offsets_E[-1]`` are unspecified, as in ``expand``.
    """
    check_tensor("q_TD", q_TD, dtype=E4M3, ndim=2)
    check_positive("group", group)
    return expand(cast_back(q_TD, sf_TG, block=(1, group), out_dtype=out_dtype), layout)
