"""FP8 grouped GEMMs for the routed experts in plain PyTorch: the specification of the gemm kernels.

Both GEMMs take e4m3 operands with DeepSeek-V3's scales (:mod:`kernels.quant.reference`: the
dequantization of ``q`` is ``q.float() * sf`` broadcast over its block) over an expert-major
layout (:class:`kernels.permute.ExpertLayout`): ``offsets_E`` holds the cumulative ends of the
experts' row segments, each a multiple of 128 rows long; rows at or past ``offsets_E[-1]`` are
capacity that belongs to no expert.

- :func:`grouped_fp8_mm` (the forward ``x @ W`` and the data gradient ``dy @ W^T``): each
  segment's rows times its expert's matrix, transposed. Activations carry per-token scales (1 x
  128 along K), the weights per-block ones (128 x 128).
- :func:`grouped_fp8_mm_wgrad` (the weight gradient ``x^T @ dy`` per expert, a K-grouped GEMM):
  both operands carry per-channel scales (one per 128 rows per column), and both are K-major, the
  rows contiguous (:func:`kernels.gemm.k_major` makes such copies).

The result is the float32 matmul of the dequantized operands, segment by segment, then rounded to
the output dtype. A kernel computes the same products in another summation order (each 128-wide
chunk's sum is scaled, then added), so it matches within float32 rounding of the sums.

Shape suffixes: P layout rows, K reduction columns, N output columns, E experts, G = ceil(K / 128)
and J = ceil(N / 128) scale groups; for the weight gradient R layout rows (the reduction), M and N
the output's rows and columns, C = ceil(R / 128) row chunks.
"""

from __future__ import annotations

import torch

from kernels.validate import check_dtype, check_tensor

E4M3 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # DeepSeek-V3's scale group (and the layout's alignment these GEMMs assume)
WGRAD_DTYPES = (torch.float32, torch.bfloat16)


def grouped_fp8_mm(
    a_PK: torch.Tensor, sa_PG: torch.Tensor, b_ENK: torch.Tensor, sb_EJG: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """``out[rows of e] = dequant(a)[rows of e] @ dequant(b[e])^T`` for every expert ``e``.

    Args:
        a_PK: ``[P, K]`` float8_e4m3fn, the layout's rows.
        sa_PG: ``[P, ceil(K / 128)]`` float32, per-token scales (``kernels.quant.per_token_cast``).
        b_ENK: ``[E, N, K]`` float8_e4m3fn, each expert's matrix stored N x K (K contiguous).
        sb_EJG: ``[E, ceil(N / 128), ceil(K / 128)]`` float32, per-block scales
            (``kernels.quant.per_block_cast`` of each ``b[e]``).
        offsets_E: ``[E]`` int32, the segments' cumulative ends: non-decreasing multiples of 128,
            at most P.

    Returns:
        ``out_PN`` ``[P, N]`` bfloat16. Rows at or past ``offsets_E[-1]`` are zeros here; the
        kernel leaves them unwritten (whatever the memory held), so callers read rows below
        ``offsets_E[-1]`` only.
    """
    p, k = check_tensor("a_PK", a_PK, dtype=E4M3, ndim=2).shape
    e, n, _ = check_tensor("b_ENK", b_ENK, dtype=E4M3, shape=(None, None, k), device=a_PK.device).shape
    g, j = _cdiv(k, SCALE_BLOCK), _cdiv(n, SCALE_BLOCK)
    check_tensor("sa_PG", sa_PG, dtype=torch.float32, shape=(p, g), device=a_PK.device)
    check_tensor("sb_EJG", sb_EJG, dtype=torch.float32, shape=(e, j, g), device=a_PK.device)
    ends = check_offsets(offsets_E, e, p, a_PK.device)
    a_deq = _dequant(a_PK, sa_PG, (1, SCALE_BLOCK))
    out_PN = torch.zeros((p, n), dtype=torch.float32, device=a_PK.device)
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            b_deq = _dequant(b_ENK[expert], sb_EJG[expert], (SCALE_BLOCK, SCALE_BLOCK))
            out_PN[start:end] = a_deq[start:end] @ b_deq.T
        start = end
    return out_PN.to(torch.bfloat16)


def grouped_fp8_mm_wgrad(
    a_MR: torch.Tensor, sa_CM: torch.Tensor, b_NR: torch.Tensor, sb_CN: torch.Tensor, offsets_E: torch.Tensor,
    *, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``out[e] = dequant(a)[:, rows of e] @ dequant(b)[:, rows of e]^T`` for every expert ``e``.

    For a weight stored ``[E, D_in, D_out]`` (``GroupedExperts``' layout), ``a`` is the layer's
    input ``x_PD`` and ``b`` its output's gradient, both K-major: ``out`` is then the weight's
    gradient in the weight's own layout.

    Args:
        a_MR: ``[M, R]`` float8_e4m3fn, the rows contiguous (the transpose of a per-channel cast's
            ``[R, M]`` bytes; R at least ``offsets_E[-1]``).
        sa_CM: ``[ceil(R / 128), M]`` float32, its per-channel scales (``kernels.quant.
            per_channel_cast`` of the ``[R, M]`` matrix, unchanged: ``sa_CM[c, m]`` scales
            ``a_MR[m, 128 c : 128 (c + 1)]``).
        b_NR: ``[N, R]`` float8_e4m3fn, likewise.
        sb_CN: ``[ceil(R / 128), N]`` float32, likewise.
        offsets_E: ``[E]`` int32, the segments' cumulative ends: non-decreasing multiples of 128,
            at most R.
        out_dtype: float32 (a gradient accumulated across steps in full precision) or bfloat16.

    Returns:
        ``out_EMN`` ``[E, M, N]`` ``out_dtype``; zeros for an expert with no rows.
    """
    check_dtype("out_dtype", out_dtype, WGRAD_DTYPES)
    m, r = check_tensor("a_MR", a_MR, dtype=E4M3, ndim=2).shape
    n = check_tensor("b_NR", b_NR, dtype=E4M3, shape=(None, r), device=a_MR.device).shape[0]
    c = _cdiv(r, SCALE_BLOCK)
    check_tensor("sa_CM", sa_CM, dtype=torch.float32, shape=(c, m), device=a_MR.device)
    check_tensor("sb_CN", sb_CN, dtype=torch.float32, shape=(c, n), device=a_MR.device)
    ends = check_offsets(offsets_E, None, r, a_MR.device)
    a_deq = _dequant(a_MR, sa_CM.T, (1, SCALE_BLOCK))
    b_deq = _dequant(b_NR, sb_CN.T, (1, SCALE_BLOCK))
    out_EMN = torch.zeros((len(ends), m, n), dtype=torch.float32, device=a_MR.device)
    start = 0
    for expert, end in enumerate(ends):
        out_EMN[expert] = a_deq[:, start:end] @ b_deq[:, start:end].T
        start = end
    return out_EMN.to(out_dtype)


def check_offsets(offsets_E: object, num_experts: int | None, rows: int, device: torch.device) -> list[int]:
    """``offsets_E`` as a list (one host sync): int32 ``[num_experts]`` (any length when None) of
    non-decreasing multiples of 128, none above ``rows``."""
    check_tensor("offsets_E", offsets_E, dtype=torch.int32, shape=None if num_experts is None else (num_experts,),
                 ndim=1, device=device)
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    if any(end % SCALE_BLOCK or end < start for start, end in zip(starts, ends)) or (ends and ends[-1] > rows):
        raise ValueError(
            f"offsets_E: expected non-decreasing multiples of {SCALE_BLOCK} up to {rows}, got {ends}")
    return ends


def _dequant(q: torch.Tensor, sf: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q.float() * sf`` with each scale over its ``block`` (ragged edges cut off)."""
    rows, cols = q.shape
    sf_full = sf.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * sf_full


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
