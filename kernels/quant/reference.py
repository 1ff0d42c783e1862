"""FP8 (e4m3) casts and SwiGLU in plain PyTorch: the specification of the quant kernels.

The three casts are one blockwise cast over a 2-D tensor with different block shapes:

==============  ===========  =========================================================
cast            block        scales
==============  ===========  =========================================================
per-token       (1, group)   ``sf_TG``: one per token per ``group`` hidden columns
per-block       (b, b)       ``[ceil(M/b), ceil(N/b)]``: one per b x b tile
per-channel     (b, 1)       ``[ceil(M/b), N]``: one per ``b`` rows per column
==============  ===========  =========================================================

Blocks at ragged edges (sizes not multiples of the block) use the elements that exist.

Scale convention (DeepSeek's, so tensors interoperate with DeepGEMM/DeepEP), per block:
``amax = max(max |x|, 1e-4)`` in float32, then either

- ``sf = amax / 448`` and ``q = e4m3(clamp(x * (448 / amax), -448, 448))``, or
- with ``round_sf`` (UE8M0): ``sf = 2**ceil(log2(amax / 448))`` (exact, from the float32 bits) and
  ``q = e4m3(clamp(x / sf, -448, 448))``; with ``pack_sf`` the scales are returned as uint8
  exponents ``log2(sf) + 127`` instead of float32.

The cast to e4m3 rounds to nearest even. Dequantization is ``q.float() * sf`` broadcast per block.

FP4 (e2m1: sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) per token,
values rounded to nearest even on that grid and saturated at +-6, two a byte: element ``2j`` in the
low nibble of byte ``j``, ``2j + 1`` in the high nibble (TileKernels' and the PTX ``e2m1x2``
order); a value keeps its sign bit even where it rounds to 0 (negative zero and values that
underflow to it included, as TileKernels' cast does). The width must be even. Two
scale conventions:

- UE8M0 (MXFP4, groups of 32 by default): ``sf = 2**ceil(log2(amax / 6))``, ``q = e2m1(x / sf)``,
  scales as uint8 exponents ``log2(sf) + 127``.
- e4m3 scales under a per-token float32 scale (NVFP4's two levels, groups of 16 by default; also
  for e4m3 values, groups of 128): ``row = max(max |x_t|, 1e-4)``, ``gsf_t = row / (448 * QMAX)``
  (QMAX: 6 for e2m1, 448 for e4m3), ``sf = e4m3(max((amax / row) * 448, 2**-9))`` per group, and
  the group's dequantization multiplier ``scale = float(sf) * gsf_t``: ``q = cast(x * (1 / scale))``
  (saturating), dequantized as ``q.float() * scale``. The largest group's scale is 448, exactly
  representable, so no scale saturates; 2**-9 (e4m3's least subnormal) keeps an all-zero group's
  scale from being 0.

Shape suffixes: T tokens, D hidden, G scale groups along the last dim, M/N matrix rows/columns,
I intermediate (the SwiGLU output width; its input ``x_TI2`` is ``[T, 2 * I]``), P rows of an
expert-major layout (:class:`kernels.permute.ExpertLayout`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.validate import check_dtype, check_positive, check_tensor

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.uint8)
E2M1_MAX = 6.0
E4M3_LEAST = 2.0**-9  # the least positive e4m3 value (subnormal)
# Rounding to nearest even on the e2m1 grid: a magnitude's code is how many of these it passes, where
# a tie (0.25, 1.25, 2.5, 5) goes to the even code below it and (0.75, 1.75, 3.5) to the even code above.
E2M1_ABOVE = (0.25, 1.25, 2.5, 5.0)  # counted when the magnitude is greater
E2M1_FROM = (0.75, 1.75, 3.5)  # counted when the magnitude is at least this
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def per_token_cast(
    x_TD: torch.Tensor, *, group: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts each token to e4m3 with one scale per ``group`` hidden columns.

    Args:
        x_TD: ``[T, D]`` float32, bfloat16 or float16.
        group: columns per scale.
        round_sf: round scales up to powers of two (UE8M0).
        pack_sf: return scales as uint8 exponents (needs ``round_sf``).

    Returns:
        ``q_TD`` ``[T, D]`` float8_e4m3fn and ``sf_TG`` ``[T, ceil(D / group)]`` float32 (uint8 when
        packed).
    """
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, ndim=2)
    check_positive("group", group)
    return _blockwise_cast(x_TD, (1, group), round_sf=round_sf, pack_sf=pack_sf)


def per_block_cast(
    x_MN: torch.Tensor, *, block: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts a matrix to e4m3 with one scale per ``block x block`` tile.

    Args:
        x_MN: ``[M, N]`` float32, bfloat16 or float16.
        block: tile side.
        round_sf, pack_sf: as in :func:`per_token_cast`.

    Returns:
        ``q_MN`` ``[M, N]`` float8_e4m3fn and scales ``[ceil(M / block), ceil(N / block)]`` float32
        (uint8 when packed).
    """
    check_tensor("x_MN", x_MN, dtype=FLOAT_DTYPES, ndim=2)
    check_positive("block", block)
    return _blockwise_cast(x_MN, (block, block), round_sf=round_sf, pack_sf=pack_sf)


def per_channel_cast(
    x_MN: torch.Tensor, *, block: int = 128, round_sf: bool = False, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts a matrix to e4m3 with one scale per ``block`` rows (tokens) per column.

    Args:
        x_MN: ``[M, N]`` float32, bfloat16 or float16.
        block: rows per scale.
        round_sf, pack_sf: as in :func:`per_token_cast`.

    Returns:
        ``q_MN`` ``[M, N]`` float8_e4m3fn and scales ``[ceil(M / block), N]`` float32 (uint8 when
        packed).
    """
    check_tensor("x_MN", x_MN, dtype=FLOAT_DTYPES, ndim=2)
    check_positive("block", block)
    return _blockwise_cast(x_MN, (block, 1), round_sf=round_sf, pack_sf=pack_sf)


def cast_back(
    q: torch.Tensor,
    sf: torch.Tensor,
    *,
    block: tuple[int, int],
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantizes the output of any of the three casts: ``q.float() * sf`` broadcast per block.

    Args:
        q: ``[M, N]`` float8_e4m3fn.
        sf: ``[ceil(M / block[0]), ceil(N / block[1])]`` float32, or uint8 exponents (packed).
        block: ``(rows, cols)`` per scale: ``(1, group)`` per-token, ``(b, b)`` per-block,
            ``(b, 1)`` per-channel.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    check_tensor("q", q, dtype=E4M3, ndim=2)
    block_m, block_n = _check_block(block)
    m, n = q.shape
    check_tensor("sf", sf, dtype=SCALE_DTYPES, shape=(_cdiv(m, block_m), _cdiv(n, block_n)), device=q.device)
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    sf_f32 = _unpack_sf(sf) if sf.dtype == torch.uint8 else sf
    sf_MN = sf_f32.repeat_interleave(block_m, dim=0).repeat_interleave(block_n, dim=1)[:m, :n]
    return (q.float() * sf_MN).to(out_dtype)


def requant(
    q: torch.Tensor,
    sf: torch.Tensor,
    *,
    in_block: tuple[int, int],
    out_block: tuple[int, int],
    round_sf: bool = False,
    pack_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-casts e4m3 data from one scale layout to another (per-token to per-block for a
    weight-gradient GEMM's operand, say): exactly the cast with ``out_block`` of the float32
    dequantization ``cast_back(q, sf, block=in_block, out_dtype=torch.float32)`` (one float32
    product an element), which the kernel never writes to memory.

    With power-of-two scales on both sides (UE8M0 in, ``round_sf``) each value becomes
    ``q * 2**(e_in - e_out)``, rounded once, so the result dequantizes to the input exactly wherever
    that is an e4m3 value. The out-scale is at most its block's largest in-scale (unless all are
    below the casts' ``2**-22`` floor), so a value moves down by ``k = e_out - e_in`` binary places
    (up where ``k < 0``, never past 448) and rounds (to nearest even, on e4m3's ``2**-9`` subnormal
    step) only where it leaves the normal range (``|q| < 2**(k - 6)``) with bits below ``2**(k - 9)``.

    Args:
        q: ``[M, N]`` float8_e4m3fn.
        sf: its scales over ``in_block``, as :func:`cast_back` takes them.
        in_block, out_block: ``(rows, cols)`` per scale, in and out (``(1, g)`` per-token,
            ``(b, b)`` per-block, ``(b, 1)`` per-channel).
        round_sf, pack_sf: as in :func:`per_token_cast`.

    Returns:
        ``q_MN`` ``[M, N]`` float8_e4m3fn and scales ``[ceil(M / out_block[0]), ceil(N /
        out_block[1])]`` float32 (uint8 when packed).
    """
    x_MN = cast_back(q, sf, block=_check_block(in_block, "in_block"), out_dtype=torch.float32)
    return _blockwise_cast(x_MN, _check_block(out_block, "out_block"), round_sf=round_sf, pack_sf=pack_sf)


def per_block_cast_lossless(
    q: torch.Tensor, sf: torch.Tensor, *, in_block: tuple[int, int], block: int = 128, pack_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-casts e4m3 data with power-of-two (UE8M0) scales to ``block x block`` UE8M0 scales from
    the scales alone (no amax over the data): a block's out-scale is its largest in-scale,
    ``2**e_out = max 2**e_in`` (computed as :func:`requant`'s scale of an amax of ``448 * max sf``,
    so a float32 in-scale that is not a power of two is rounded up to one, and an out-scale is at
    least ``2**-22``, the casts' floor, which no scale the casts make is below). Each value
    becomes ``q * 2**(e_in - e_out)``, shifted down by ``k = e_out - e_in >= 0`` places, never
    saturating.

    Lossless: the result dequantizes to exactly the input's dequantization wherever every shifted
    value is an e4m3 value: where ``k = 0``, where ``|q| >= 2**(k - 6)`` (it stays normal), or where
    ``q``'s lowest set bit is at least ``2**(k - 9)``. Otherwise such a value rounds to nearest even
    on e4m3's ``2**-9`` step (to zero at or below ``2**-10``); nothing reports it.

    Args:
        q: ``[M, N]`` float8_e4m3fn.
        sf: its scales over ``in_block``: float32 powers of two, or uint8 exponents.
        in_block: ``(rows, cols)`` per in-scale.
        block: the out tile's side.
        pack_sf: return the out-scales as uint8 exponents instead of float32.

    Returns:
        ``q_MN`` ``[M, N]`` float8_e4m3fn and scales ``[ceil(M / block), ceil(N / block)]`` float32
        (uint8 when packed).
    """
    x_MN = cast_back(q, sf, block=_check_block(in_block, "in_block"), out_dtype=torch.float32)
    sf_f32 = _unpack_sf(sf) if sf.dtype == torch.uint8 else sf
    block_m, block_n = in_block
    sf_MN = sf_f32.repeat_interleave(block_m, dim=0).repeat_interleave(block_n, dim=1)[: q.shape[0], : q.shape[1]]
    out_block = (check_positive("block", block), block)
    return _blockwise_cast(x_MN, out_block, round_sf=True, pack_sf=pack_sf, amax_MN=sf_MN * E4M3_MAX)


def per_token_cast_fp4(x_TD: torch.Tensor, *, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts each token to e2m1 with power-of-two (UE8M0) scales, one per ``group`` columns (MXFP4).

    Args:
        x_TD: ``[T, D]`` float32, bfloat16 or float16, ``D`` even.
        group: columns per scale.

    Returns:
        ``q_TH`` ``[T, D / 2]`` uint8, two e2m1 codes a byte (module doc), and ``sf_TG``
        ``[T, ceil(D / group)]`` uint8 exponents ``log2(sf) + 127``.
    """
    x_f32, amax_TG = _group_amax(x_TD, group, even=True)
    exponent = _ceil_log2(amax_TG.clamp(min=AMAX_FLOOR) / torch.full_like(amax_TG, E2M1_MAX))
    q_TH = pack_e2m1(_per_group(x_f32, _pow2(-exponent), group))
    return q_TH, (exponent + 127).to(torch.uint8)


def per_token_cast_fp4_e4m3_sf(
    x_TD: torch.Tensor, *, group: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Casts each token to e2m1 with e4m3 scales per ``group`` columns under a float32 scale per
    token (NVFP4's two levels, per token; module doc).

    Args:
        x_TD: ``[T, D]`` float32, bfloat16 or float16, ``D`` even.
        group: columns per scale.

    Returns:
        ``q_TH`` ``[T, D / 2]`` uint8 (two e2m1 codes a byte), ``sf_TG`` ``[T, ceil(D / group)]``
        float8_e4m3fn and ``gsf_T`` ``[T]`` float32.
    """
    x_f32, amax_TG = _group_amax(x_TD, group, even=True)
    scale_TG, sf_TG, gsf_T = _two_level_scales(amax_TG, E2M1_MAX)
    q_TH = pack_e2m1(_per_group(x_f32, torch.ones_like(scale_TG) / scale_TG, group))
    return q_TH, sf_TG, gsf_T


def per_token_cast_e4m3_sf(
    x_TD: torch.Tensor, *, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`per_token_cast` with e4m3 scales under a float32 scale per token (module doc).

    Args:
        x_TD: ``[T, D]`` float32, bfloat16 or float16.
        group: columns per scale.

    Returns:
        ``q_TD`` ``[T, D]`` float8_e4m3fn, ``sf_TG`` ``[T, ceil(D / group)]`` float8_e4m3fn and
        ``gsf_T`` ``[T]`` float32.
    """
    x_f32, amax_TG = _group_amax(x_TD, group, even=False)
    scale_TG, sf_TG, gsf_T = _two_level_scales(amax_TG, E4M3_MAX)
    q_TD = _per_group(x_f32, torch.ones_like(scale_TG) / scale_TG, group).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q_TD, sf_TG, gsf_T


def cast_back_fp4(
    q_TH: torch.Tensor,
    sf_TG: torch.Tensor,
    *,
    group: int,
    gsf_T: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantizes :func:`per_token_cast_fp4` (uint8 UE8M0 scales) or
    :func:`per_token_cast_fp4_e4m3_sf` (e4m3 scales and ``gsf_T``): ``e2m1 value * scale``, one
    float32 product, rounded once to ``out_dtype``.

    Args:
        q_TH: ``[T, H]`` uint8, two e2m1 codes a byte.
        sf_TG: ``[T, ceil(2H / group)]`` uint8 exponents or float8_e4m3fn.
        group: columns per scale.
        gsf_T: ``[T]`` float32 with e4m3 scales, else None.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``[T, 2H]`` in ``out_dtype``.
    """
    check_tensor("q_TH", q_TH, dtype=torch.uint8, ndim=2)
    scale_TG = _group_scales(sf_TG, gsf_T, q_TH, 2 * q_TH.shape[1], group, (torch.uint8, E4M3))
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    return _per_group(unpack_e2m1(q_TH), scale_TG, group).to(out_dtype)


def cast_back_e4m3_sf(
    q_TD: torch.Tensor, sf_TG: torch.Tensor, gsf_T: torch.Tensor, *, group: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantizes :func:`per_token_cast_e4m3_sf`: ``q.float() * (float(sf) * gsf)``.

    Args:
        q_TD: ``[T, D]`` float8_e4m3fn.
        sf_TG: ``[T, ceil(D / group)]`` float8_e4m3fn.
        gsf_T: ``[T]`` float32.
        group: columns per scale.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``[T, D]`` in ``out_dtype``.
    """
    check_tensor("q_TD", q_TD, dtype=E4M3, ndim=2)
    scale_TG = _group_scales(sf_TG, gsf_T, q_TD, q_TD.shape[1], group, (E4M3,))
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    return _per_group(q_TD.float(), scale_TG, group).to(out_dtype)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 values to e2m1 codes (uint8, 0..15), rounded to nearest even, saturated at +-6, the
    sign bit the value's (-0.0 gives code 8); NaN gives code 0."""
    mag = v.abs()
    code = sum((mag > t).to(torch.uint8) for t in E2M1_ABOVE) + sum((mag >= t).to(torch.uint8) for t in E2M1_FROM)
    return code | ((torch.signbit(v) & ~v.isnan()).to(torch.uint8) << 3)


def pack_e2m1(v_TD: torch.Tensor) -> torch.Tensor:
    """``[T, D]`` float32 (D even) to ``[T, D / 2]`` uint8, element ``2j`` in the low nibble."""
    codes = e2m1_codes(v_TD)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(q_TH: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` uint8 of two e2m1 codes to ``[T, 2H]`` float32 (the inverse of :func:`pack_e2m1`
    on the grid; a negative zero stays -0.0)."""
    codes = torch.stack([q_TH & 0xF, q_TH >> 4], dim=-1).flatten(1)
    values = torch.tensor(E2M1_VALUES, device=q_TH.device)[(codes & 7).long()]
    return torch.where(codes >= 8, -values, values)


def _group_amax(x_TD: torch.Tensor, group: int, *, even: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates a per-token cast's input; returns it in float32 and each group's amax ``[T, G]``."""
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, ndim=2)
    check_positive("group", group)
    if even and x_TD.shape[1] % 2:
        raise ValueError(f"x_TD: expected an even width (two e2m1 values a byte), got shape {tuple(x_TD.shape)}")
    t, d = x_TD.shape
    g = _cdiv(d, group)
    x_f32 = x_TD.float()
    amax_TG = F.pad(x_f32.abs(), (0, g * group - d)).view(t, g, group).amax(dim=2)
    return x_f32, amax_TG


def _two_level_scales(amax_TG: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale_TG float32, sf_TG e4m3, gsf_T float32)`` of the two-level convention (module doc)."""
    row_T = amax_TG.amax(dim=1) if amax_TG.shape[1] else amax_TG.new_zeros(amax_TG.shape[0])
    row_T = row_T.clamp(min=AMAX_FLOOR)
    gsf_T = row_T / torch.full_like(row_T, E4M3_MAX * qmax)
    ratio_TG = amax_TG / row_T[:, None]
    sf_TG = (ratio_TG * E4M3_MAX).clamp(min=E4M3_LEAST).to(E4M3)
    return sf_TG.float() * gsf_T[:, None], sf_TG, gsf_T


def _per_group(v_TD: torch.Tensor, per_group_TG: torch.Tensor, group: int) -> torch.Tensor:
    """``v * per_group`` with each group's factor broadcast over its columns (float32)."""
    return v_TD * per_group_TG.repeat_interleave(group, dim=1)[:, : v_TD.shape[1]]


def _group_scales(sf_TG, gsf_T, q, width: int, group: int, sf_dtypes) -> torch.Tensor:
    """Validates a per-token cast back's scales; returns each group's float32 multiplier."""
    check_positive("group", group)
    check_tensor("sf_TG", sf_TG, dtype=sf_dtypes, shape=(q.shape[0], _cdiv(width, group)), device=q.device)
    if sf_TG.dtype == torch.uint8:
        if gsf_T is not None:
            raise ValueError("gsf_T: expected None with UE8M0 (uint8) scales, got a tensor")
        return _unpack_sf(sf_TG)
    check_tensor("gsf_T", gsf_T, dtype=torch.float32, shape=(q.shape[0],), device=q.device)
    return sf_TG.float() * gsf_T[:, None]


def swiglu(
    x_TI2: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` computed in float32, where ``x_TI2 = [gate | up]`` along the last dim.

    Args:
        x_TI2: ``[T, 2 * I]`` float32, bfloat16 or float16; the first half of each row is the gate.
        rows: int32 ``[1]`` on ``x_TI2``'s device, the rows wanted (a layout's ``offsets_E[-1:]``,
            read on the device, no host sync): rows at or past ``rows[0]`` of the result are
            unspecified (the kernel skips them; this reference computes them). None: all rows.
        weights_T: float32 ``[T]`` on ``x_TI2``'s device, each row's weight (its route's router
            weight), multiplied into the float32 result: ``(silu(gate) * up) * weights_T[t]``.
            None: no weight.
        clamp: a positive limit (compared in float32) applied before the activation, as in models
            that clamp SwiGLU's inputs: the gate from above only (``min(gate, clamp)``), up from
            both sides (``up.clamp(-clamp, clamp)``). None: no clamp.

    Returns:
        ``y_TI`` ``[T, I]`` in ``x_TI2.dtype``.
    """
    check_rows(rows, x_TI2)
    return _swiglu_f32(x_TI2, weights_T, clamp).to(x_TI2.dtype)


def check_rows(rows: torch.Tensor | None, x_TI2: torch.Tensor) -> None:
    if rows is not None:
        check_tensor("rows", rows, dtype=torch.int32, shape=(1,), device=x_TI2.device)


def swiglu_per_token_cast(
    x_TI2: torch.Tensor,
    *,
    group: int = 128,
    round_sf: bool = False,
    pack_sf: bool = False,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`swiglu` fused with :func:`per_token_cast` of its float32 result (never rounded to
    ``x_TI2.dtype`` in between).

    Args:
        x_TI2: ``[T, 2 * I]`` float32, bfloat16 or float16, ``[gate | up]``.
        group, round_sf, pack_sf: as in :func:`per_token_cast`.
        weights_T, clamp: as in :func:`swiglu` (the weight is applied before the cast).

    Returns:
        ``q_TI`` ``[T, I]`` float8_e4m3fn and ``sf_TG`` ``[T, ceil(I / group)]`` float32 (uint8 when
        packed).
    """
    check_positive("group", group)
    y_TI = _swiglu_f32(x_TI2, weights_T, clamp)
    return _blockwise_cast(y_TI, (1, group), round_sf=round_sf, pack_sf=pack_sf)


def swiglu_backward(
    x_TI2: torch.Tensor,
    grad_TI: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gradient of :func:`swiglu` with respect to its input (and its weights), computed in float32.

    With ``g, u`` the (clamped) gate and up, ``s = sigmoid(g)``, ``silu'(g) = s * (1 + g * (1 - s))``
    and ``gw = grad * weights_T[t]`` (``grad`` itself without weights): ``d gate = gw * u *
    silu'(g)`` and ``d up = gw * (g * s)``, each zero where its input was clamped (gate above
    ``clamp``, up outside ``[-clamp, clamp]``; at the limit itself the gradient passes, as torch's
    clamp lets it); ``d weights_T[t] = sum over I of grad * silu(g) * u``.

    Args:
        x_TI2: ``[T, 2 * I]`` float32, bfloat16 or float16, the forward input ``[gate | up]``.
        grad_TI: ``[T, I]`` float32, bfloat16 or float16, the gradient of the output.
        rows: as in :func:`swiglu` (rows of the results at or past ``rows[0]`` are unspecified).
        weights_T, clamp: as in :func:`swiglu`.

    Returns:
        ``grad_TI2`` ``[T, 2 * I]`` in ``x_TI2.dtype``, ``[d gate | d up]``; with ``weights_T``,
        the pair ``(grad_TI2, grad_weights_T)``, the latter float32 ``[T]``.
    """
    check_rows(rows, x_TI2)
    gate_TI, up_TI = _clamped_gate_up(x_TI2, clamp)
    check_tensor("grad_TI", grad_TI, dtype=FLOAT_DTYPES, shape=gate_TI.shape, device=x_TI2.device)
    grad_TI = grad_TI.float()
    weighted_TI = grad_TI if weights_T is None else grad_TI * check_weights(weights_T, x_TI2)[:, None]
    sig_TI = torch.sigmoid(gate_TI)
    d_gate_TI = weighted_TI * up_TI * (sig_TI * (1 + gate_TI * (1 - sig_TI)))
    d_up_TI = weighted_TI * (gate_TI * sig_TI)
    if clamp is not None:
        gate_in_TI, up_in_TI = _split_gate_up(x_TI2)
        d_gate_TI = torch.where(gate_in_TI > clamp, 0.0, d_gate_TI)
        d_up_TI = torch.where(up_in_TI.abs() > clamp, 0.0, d_up_TI)
    grad_TI2 = torch.cat([d_gate_TI, d_up_TI], dim=1).to(x_TI2.dtype)
    if weights_T is None:
        return grad_TI2
    return grad_TI2, (grad_TI * (F.silu(gate_TI) * up_TI)).sum(dim=1)


def _blockwise_cast(
    x_MN: torch.Tensor, block: tuple[int, int], *, round_sf: bool, pack_sf: bool, amax_MN: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one cast behind all three layouts; ``x_MN`` is already validated. ``amax_MN``: the
    magnitudes the scales follow, in place of ``|x_MN|``."""
    if pack_sf and not round_sf:
        raise ValueError("pack_sf: expected round_sf=True (only power-of-two scales pack), got round_sf=False")
    block_m, block_n = block
    m, n = x_MN.shape
    gm, gn = _cdiv(m, block_m), _cdiv(n, block_n)
    # Zero padding leaves every block's amax unchanged; the padding is cut off again at the end.
    x_padded = F.pad(x_MN.float(), (0, gn * block_n - n, 0, gm * block_m - m))
    blocks = x_padded.view(gm, block_m, gn, block_n)
    source = x_padded if amax_MN is None else F.pad(amax_MN, (0, gn * block_n - n, 0, gm * block_m - m))
    amax = source.view(gm, block_m, gn, block_n).abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR)
    # Correctly rounded float32 divisions, tensor by tensor: torch computes `scalar / tensor` as a
    # multiplication by the rounded reciprocal, and CUDA does the same for `tensor / scalar`.
    e4m3_max = torch.full_like(amax, E4M3_MAX)
    if round_sf:
        exponent = _ceil_log2(amax / e4m3_max)
        sf = _pow2(exponent)
        inv_sf = _pow2(-exponent)  # x * 2**-e equals x / 2**e bit for bit
    else:
        sf = amax / e4m3_max
        inv_sf = e4m3_max / amax
    q_padded = (blocks * inv_sf[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q_MN = q_padded.view(gm * block_m, gn * block_n)[:m, :n].clone(memory_format=torch.contiguous_format)
    if pack_sf:
        return q_MN, (exponent + 127).to(torch.uint8)
    return q_MN, sf


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(v))`` for positive normal float32 ``v``, from its bits, as int32."""
    bits = v.view(torch.int32)
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**exponent`` for int32 exponents in [-126, 127]."""
    return ((exponent + 127) << 23).view(torch.float32)


def _unpack_sf(sf_u8: torch.Tensor) -> torch.Tensor:
    """uint8 exponents ``e + 127`` to float32 ``2**e`` (the casts produce codes 1..254 only)."""
    return _pow2(sf_u8.to(torch.int32) - 127)


def _split_gate_up(x_TI2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates ``x_TI2`` and returns its gate and up halves in float32."""
    check_tensor("x_TI2", x_TI2, dtype=FLOAT_DTYPES, ndim=2)
    width = x_TI2.shape[1]
    if width % 2:
        raise ValueError(f"x_TI2: expected an even last dim ([gate | up]), got shape {tuple(x_TI2.shape)}")
    x_f32 = x_TI2.float()
    return x_f32[:, : width // 2], x_f32[:, width // 2 :]


def _clamped_gate_up(x_TI2: torch.Tensor, clamp: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 gate and up halves, clamped as :func:`swiglu` says."""
    gate_TI, up_TI = _split_gate_up(x_TI2)
    if check_clamp(clamp) is None:
        return gate_TI, up_TI
    return gate_TI.clamp(max=clamp), up_TI.clamp(-clamp, clamp)


def check_clamp(clamp: object) -> float | None:
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp > 0):
        raise ValueError(f"clamp: expected a positive number or None, got {clamp!r}")
    return clamp


def check_weights(weights_T: torch.Tensor, x_TI2: torch.Tensor) -> torch.Tensor:
    return check_tensor("weights_T", weights_T, dtype=torch.float32, shape=(x_TI2.shape[0],), device=x_TI2.device)


def _swiglu_f32(x_TI2: torch.Tensor, weights_T: torch.Tensor | None = None, clamp: float | None = None) -> torch.Tensor:
    gate_TI, up_TI = _clamped_gate_up(x_TI2, clamp)
    y_TI = F.silu(gate_TI) * up_TI
    return y_TI if weights_T is None else y_TI * check_weights(weights_T, x_TI2)[:, None]


def _check_block(block: object, name: str = "block") -> tuple[int, int]:
    if not isinstance(block, tuple) or len(block) != 2:
        raise ValueError(f"{name}: expected a (rows, cols) tuple of two positive ints, got {block!r}")
    return check_positive(name, block[0]), check_positive(name, block[1])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
