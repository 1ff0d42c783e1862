"""The per-token casts with FP4 values or e4m3 scales: ``per_token_cast_fp4`` (e2m1, UE8M0 scales),
``per_token_cast_fp4_e4m3_sf`` (e2m1, e4m3 scales under a float32 scale per token) and
``per_token_cast_e4m3_sf`` (e4m3 values, the same two-level scales); one factory, specialised on
the value format and the scales (see :mod:`kernels.quant.reference` for the function computed).

A CTA takes one whole token in registers (the two-level scales need the row's amax before any
group's scale), loaded with 16-byte vectors (:func:`kernels.tiles.vector_layout`); each group's
amax is reduced across the threads that hold it, the scales written, and the values cast and
stored straight from the registers. An e2m1 byte holds two neighbouring values, which lie in one
thread's vector, and the bytes leave as vectors. Every input byte is read once and every output
byte written once. The bytes match the reference's for finite inputs; a row holding an infinity or a
NaN does not (the arithmetic encoders take finite values, and bfloat16's UE8M0 exponent from an
infinite amax's bits is 126 where the reference's division gives 128).

The e2m1 code is found by one float addition, not a comparison against each of the grid's seven
midpoints (:func:`e2m1_code`): the cast ran at 52% of the copy bandwidth, compute-bound, with the
comparisons and one-byte stores from a row staged in shared memory. bfloat16 under UE8M0 scales
(MXFP4 from bfloat16 activations) rounds two values at a time in bfloat16x2 arithmetic instead
(``ENCODER_SOURCE``), its exponents taken from amax's bits with no division: 1097 -> 544 SASS
instructions a thread at 7168 columns, 88.5 -> 72.2 us at 16384 x 7168 on an H200.

bfloat16 under e4m3 scales (NVFP4's two levels) multiplies in float32, as the reference, and rounds
each pair of products to odd into bfloat16, which the same bfloat16x2 rounding then takes to the
reference's codes; the scales' divisions share one reciprocal of the row amax, corrected by the
remainder (the arithmetic of CUDA's own division), and the registers are held to 64 a thread. At
16384 x 7168 on an H200: 1243 -> 779 SASS instructions a thread, 132.8 -> 75.1 us (93.6% of copy),
where a skeleton loading the row, reducing both amaxes and storing the same bytes takes 70.7 us.

Shape suffixes: T tokens, D hidden, H packed bytes (``D / 2``), G scale groups.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.quant import reference
from kernels.quant.reference import (
    AMAX_FLOOR,
    E2M1_MAX,
    E4M3,
    E4M3_LEAST,
    E4M3_MAX,
    FLOAT_DTYPES,
)
from kernels.tiles import PASS_CONFIGS, abs_of, check_cuda, is_pow2, tl_dtype, to_e4m3, vector_layout, vector_width
from kernels.validate import check_tensor

FORMATS = ("e2m1", "e4m3")  # the values' format
SCALES = ("ue8m0", "e4m3")  # the scales' format
MAX_THREADS = 1024
MAX_VECTORS = 16  # a thread's share of the row in 16-byte vectors; wider rows run the reference
REFERENCES = {
    ("e2m1", "ue8m0"): reference.per_token_cast_fp4,
    ("e2m1", "e4m3"): reference.per_token_cast_fp4_e4m3_sf,
    ("e4m3", "e4m3"): reference.per_token_cast_e4m3_sf,
}


def supports_group(group: object) -> bool:
    """Groups the per-token scaled kernels (this cast and its cast back) take: powers of two, 2 to 1024."""
    return type(group) is int and is_pow2(group) and 2 <= group <= 1024


def row_tile(num_cols: int, group: int, vec: int) -> tuple[int, int]:
    """``(tile_n, threads)``: a row padded to whole groups and whole warps of vectors, dealt to the
    most threads (up to ``MAX_THREADS``) that take equal shares (7 vectors each at 7168 columns)."""
    unit = max(group, 32 * vec)
    tile_n = -(-num_cols // unit) * unit
    vectors = tile_n // vec
    return tile_n, min(MAX_THREADS, vectors & -vectors)


def supports(num_cols: int, group: object, elem_bytes: int) -> bool:
    """Rows this cast takes: a group :func:`supports_group` takes, at most ``MAX_VECTORS`` vectors a
    thread (:func:`row_tile`)."""
    if not supports_group(group):
        return False
    vec = vector_width(num_cols, elem_bytes)
    tile_n, threads = row_tile(num_cols, group, vec)
    return tile_n // vec <= MAX_VECTORS * threads


# The encoder of bfloat16 pairs under UE8M0 scales (``T.import_source``; ``T.call_extern`` of
# ``ep_e2m1x2_bf16_pow2``): a pair of neighbouring values, read from a thread's registers, to the
# byte that holds their codes (element ``2j`` in the low nibble). It rounds as :func:`e2m1_code`,
# by one addition, with bfloat16's 7 mantissa bits: ``C = 2**(6 + k)`` (relative to the
# magnitude), and ``C`` carries ``2k`` in its low bits already (an even amount, so the tie to even
# is unchanged): the sum's low bits are the code.
ENCODER_SOURCE = r"""
// The byte [sign1 code1 sign0 code0] of two 16-bit halves that hold a code in bits 0-2 and its sign
// in bit 15: one product moves the four fields side by side into the top byte, no two overlapping.
__device__ __forceinline__ unsigned char ep_e2m1_byte(unsigned halves) {
  return (unsigned char)(((halves & 0x80078007u) * 0x01001001u) >> 24);
}

// bfloat16 values under a power-of-two scale: two at a time in bfloat16x2 arithmetic. ``scale2``
// holds 2**(16 - e) in both halves, so y = x * 2**(16 - e), and |y| <= 6 * 2**16 (the scale is at
// least amax / 6). Values the reference's float32 x * 2**-e gives code 0 come out below 2**15 (or
// zero, where y underflows) and round to 0 here too; the fma's -0 addend keeps every product's sign,
// zeros included, so a code's sign bit is x's, as the reference's. Then k comes from
// max(|y|, 2**16) and C is 2**(22 + k) with 2k in its low bits (bfloat16 has 7 mantissa bits).
__device__ __forceinline__ unsigned char ep_e2m1x2_bf16_pow2(const void* x, unsigned scale2) {
  unsigned y, p, r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(*(const unsigned*)x), "r"(scale2), "r"(0x80008000u));
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(p) : "r"(y), "r"(0x47804780u));  // max(|y|, 2**16)
  p &= 0x7F807F80u;  // 2**(16 + k), each half
  unsigned c = p + (p >> 6) + 0x01E201E2u;  // + 6 << 7 - 2 * (127 + 16): 2**(22 + k) + 2k
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(y), "r"(c | (y & 0x80008000u)));  // +-(|y| + C)
  return ep_e2m1_byte(r);
}

// Division and reciprocal rounded to nearest even by the fast path of CUDA's own IEEE division and
// reciprocal, without its range check, which every operand here passes (normal, with a normal
// result): rcp.approx refined by one Newton step is the rounded reciprocal, and a / b is a * rb
// corrected once by its remainder. Sharing rb across a row's divisions keeps one reciprocal a row.
__device__ __forceinline__ float ep_rcp(float b) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
  return __fmaf_rn(y, __fmaf_rn(-b, y, 1.0f), y);
}

__device__ __forceinline__ float ep_div_by(float a, float b, float rb) {
  float q = __fmul_rn(a, rb);
  return __fmaf_rn(__fmaf_rn(-q, b, a), rb, q);
}

// 2**(127 - e) for a float of biased exponent e at most 253: the power of two taking it to [1, 2)
__device__ __forceinline__ float ep_unit_scale(float b) {
  return __uint_as_float((254u - min(__float_as_uint(b) >> 23, 253u)) << 23);
}

// bfloat16 values under any float32 scale, a 16-byte vector of eight to its four bytes. Each pair:
// y = x * inv in float32, as the reference, then rounded to odd into bfloat16 (its top half, the
// lowest bit set where the bottom half is not zero). The e2m1 grid needs 2 bits of precision and
// bfloat16 holds 8 (at least 2 more), so rounding y's bfloat16 to nearest even onto the grid gives
// y's own code: no midpoint is odd, so the bfloat16 lands on one only where y is that midpoint.
// Then as above with k from max(|y|, 1) and C = 2**(6 + k), y saturated at 6 first (an e4m3 scale
// rounded down leaves |y| up to 9); the four bytes are gathered by byte permutes.
// (one pair: its byte in bits 24-31)
__device__ __forceinline__ unsigned ep_e2m1x2_bf16_scaled_top(unsigned u, float inv) {
  unsigned y, sticky, p, r;
  unsigned a = __float_as_uint(__uint_as_float(u << 16) * inv);
  unsigned b = __float_as_uint(__uint_as_float(u & 0xFFFF0000u) * inv);
  asm("min.u16x2 %0, %1, %2;" : "=r"(sticky) : "r"(__byte_perm(a, b, 0x5410)), "r"(0x00010001u));
  y = __byte_perm(a, b, 0x7632) | sticky;
  asm("min.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(y) : "r"(y), "r"(0x40C040C0u));  // +-min(|y|, 6)
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(p) : "r"(y), "r"(0x3F803F80u));  // max(|y|, 1)
  p &= 0x7F807F80u;  // 2**k, each half
  unsigned c = p + (p >> 6) + 0x02020202u;  // + 6 << 7 - 2 * 127: 2**(6 + k) + 2k
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(y), "r"(c | (y & 0x80008000u)));  // +-(|y| + C)
  return (r & 0x80078007u) * 0x01001001u;  // as ep_e2m1_byte, before the shift
}

__device__ __forceinline__ void ep_e2m1x8_bf16_scaled(const void* x, float inv, void* out) {
  uint4 v = *(const uint4*)x;
  unsigned lo = __byte_perm(ep_e2m1x2_bf16_scaled_top(v.x, inv), ep_e2m1x2_bf16_scaled_top(v.y, inv), 0x0073);
  unsigned hi = __byte_perm(ep_e2m1x2_bf16_scaled_top(v.z, inv), ep_e2m1x2_bf16_scaled_top(v.w, inv), 0x0073);
  *(unsigned*)out = __byte_perm(lo, hi, 0x5410);
}
"""


def e2m1_code(v):
    """The e2m1 code (0..15, as int32) of a finite float32 value, as
    :func:`kernels.quant.reference.e2m1_codes` (an expression built here, in Python).

    The magnitude, saturated at 6, is rounded to nearest even onto the grid by one float addition:
    with ``C = 2**(22 + k)`` for ``k = max(exponent, 0)`` (steps of 0.5 below 2, 1 below 4, 2 up
    to 6), ``m + C`` keeps ``round(m / step)`` in its lowest mantissa bits, and the code is that
    count plus ``2k``; the sign bit is the value's (a negative zero's too)."""
    mag = T.min(T.abs(v), T.float32(E2M1_MAX))
    k = T.max(T.reinterpret(mag, "int32") >> 23, 127) - 127
    steps = T.reinterpret(mag + T.reinterpret((k + 149) << 23, "float32"), "int32") & 7
    return steps + 2 * k + T.if_then_else(T.copysign(T.float32(1), v) < T.float32(0), 8, 0)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_per_token_scaled_cast_kernel(num_cols: int, group: int, fmt: str, sf_format: str, in_dtype: str):
    """``(x_TD, q, sf_TG[, gsf_T])`` kernel: ``q`` is ``[T, D / 2]`` uint8 for ``fmt="e2m1"``,
    ``[T, D]`` e4m3 for ``"e4m3"``; ``sf_TG`` uint8 exponents for ``sf_format="ue8m0"`` (e2m1
    only), e4m3 for ``"e4m3"``, which adds ``gsf_T``."""
    assert fmt in FORMATS and sf_format in SCALES and (fmt, sf_format) != ("e4m3", "ue8m0")
    num_rows = T.dynamic("num_rows")
    groups = -(-num_cols // group)
    vec = vector_width(num_cols, T.dtype(in_dtype).bytes)
    tile_n, threads = row_tile(num_cols, group, vec)
    tile_g = tile_n // group  # groups past ``groups`` are columns past the row, loaded as zero
    qmax = E2M1_MAX if fmt == "e2m1" else E4M3_MAX
    q_cols, q_dtype = (num_cols // 2, "uint8") if fmt == "e2m1" else (num_cols, "float8_e4m3fn")
    sf_dtype = "uint8" if sf_format == "ue8m0" else "float8_e4m3fn"
    packed_pow2 = fmt == "e2m1" and sf_format == "ue8m0" and in_dtype == "bfloat16"  # ENCODER_SOURCE
    # bfloat16 under e4m3 scales, rows of whole tiles of 16-byte vectors (ep_e2m1x8_bf16_scaled, its
    # stores unguarded) and groups of whole vectors (a call's eight values share one scale); other
    # widths and groups take the float32 encoder
    packed_scaled = (fmt == "e2m1" and sf_format == "e4m3" and in_dtype == "bfloat16" and vec == 8 and group % 8 == 0
                     and tile_n == num_cols)

    @T.macro
    def body(x_TD, q, sf_TG, gsf_T):
        with T.Kernel(num_rows, threads=threads) as row:
            if packed_pow2 or sf_format == "e4m3":
                T.import_source(ENCODER_SOURCE)
            if packed_scaled:
                # at most 64 registers a thread (eight CTAs of 128 threads an SM): 82.6 -> 76.7 us
                T.annotate_min_blocks_per_sm(max(1, 1024 // threads))
            x_frag = T.alloc_fragment((1, tile_n), in_dtype)
            T.annotate_layout({x_frag: vector_layout(1, tile_n, threads, vec)})
            T.copy(x_TD[row, 0], x_frag, disable_tma=True)
            abs_frag = T.alloc_fragment((1, tile_n), in_dtype)
            abs_of(x_frag, abs_frag)
            amax = T.alloc_fragment((1, tile_g), in_dtype)
            T.reduce_max(T.reshape(abs_frag, [1, tile_g, group]), amax, dim=2)
            inv_frag = T.alloc_fragment((1, tile_g), "uint32" if packed_pow2 else "float32")
            if sf_format == "ue8m0":
                for i, g in T.Parallel(1, tile_g):
                    clamped = T.max(T.cast(amax[i, g], "float32"), T.float32(AMAX_FLOOR))
                    if packed_pow2:
                        # ceil(log2(amax / 6)) from amax's bits (6 = 1.5 * 4), no division: the
                        # reference's rounded quotient is a power of two only where the exact one is
                        bits = T.reinterpret(clamped, "int32")
                        exponent = (bits >> 23) - 129 + T.if_then_else((bits & 0x7FFFFF) > 0x400000, 1, 0)
                        # 2**(16 - e) as bfloat16, in both halves
                        inv_frag[i, g] = T.cast((143 - exponent) << 7, "uint32") * T.uint32(0x10001)
                    else:
                        bits = T.reinterpret(T.ieee_fdiv(clamped, T.float32(qmax)), "int32")
                        exponent = (bits >> 23) - 127 + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)
                        inv_frag[i, g] = T.reinterpret((127 - exponent) << 23, "float32")
                    if g < groups:
                        sf_TG[row, g] = T.cast(exponent + 127, "uint8")
            else:
                row_amax = T.alloc_fragment((1,), in_dtype)
                T.reduce_max(amax, row_amax, dim=1)
                top = T.alloc_var(T.float32)
                unit = T.alloc_var(T.float32)
                rcp_top = T.alloc_var(T.float32)
                gsf = T.alloc_var(T.float32)
                top = T.max(T.cast(row_amax[0], "float32"), T.float32(AMAX_FLOOR))
                # every group's amax / top from one reciprocal (no division a group): top taken by a
                # power of two to [1, 2) (to [2, 4) past 2**127), its amax with it
                unit = T.call_extern("float32", "ep_unit_scale", top)
                rcp_top = T.call_extern("float32", "ep_rcp", top * unit)
                top_q = T.float32(E4M3_MAX * qmax)
                gsf = T.call_extern("float32", "ep_div_by", top, top_q, T.call_extern("float32", "ep_rcp", top_q))
                if T.get_thread_binding() == 0:
                    gsf_T[row] = gsf
                for i, g in T.Parallel(1, tile_g):
                    ratio = T.call_extern("float32", "ep_div_by", T.cast(amax[i, g], "float32") * unit,
                                          top * unit, rcp_top)
                    sf = to_e4m3(T.max(ratio * T.float32(E4M3_MAX), T.float32(E4M3_LEAST)))
                    if g < groups:
                        sf_TG[row, g] = sf
                    inv_frag[i, g] = T.call_extern("float32", "ep_rcp", T.cast(sf, "float32") * gsf)
            if packed_pow2:
                packed = T.alloc_fragment((1, tile_n // 2), "uint8")
                T.annotate_layout({packed: vector_layout(1, tile_n // 2, threads, vec // 2)})
                for i, p in T.Parallel(1, tile_n // 2):
                    pair = T.address_of(x_frag[i, 2 * p])
                    packed[i, p] = T.call_extern("uint8", "ep_e2m1x2_bf16_pow2", pair, inv_frag[i, 2 * p // group])
                T.copy(packed, q[row, 0])
            elif packed_scaled:
                for i, c in T.Parallel(1, tile_n // 8):
                    T.call_extern("handle", "ep_e2m1x8_bf16_scaled", T.address_of(x_frag[i, 8 * c]),
                                  inv_frag[i, 8 * c // group], T.address_of(q[row, 4 * c]))
            elif fmt == "e2m1":
                nibbles = T.alloc_fragment((1, tile_n), "uint8")
                for i, j in T.Parallel(1, tile_n):
                    code = e2m1_code(T.cast(x_frag[i, j], "float32") * inv_frag[i, j // group])
                    nibbles[i, j] = T.cast(code << (j % 2 * 4), "uint8")
                packed = T.alloc_fragment((1, tile_n // 2), "uint8")
                T.reduce_sum(T.reshape(nibbles, [1, tile_n // 2, 2]), packed, dim=2)
                T.copy(packed, q[row, 0])
            else:
                for i, j in T.Parallel(1, tile_n):
                    q[row, j] = to_e4m3(T.cast(x_frag[i, j], "float32") * inv_frag[i, j // group])

    if sf_format == "ue8m0":

        @T.prim_func
        def per_token_scaled_cast(
            x_TD: T.Tensor[(num_rows, num_cols), in_dtype],
            q: T.Tensor[(num_rows, q_cols), q_dtype],
            sf_TG: T.Tensor[(num_rows, groups), sf_dtype],
        ):
            body(x_TD, q, sf_TG, None)

        return per_token_scaled_cast

    @T.prim_func
    def per_token_scaled_cast(
        x_TD: T.Tensor[(num_rows, num_cols), in_dtype],
        q: T.Tensor[(num_rows, q_cols), q_dtype],
        sf_TG: T.Tensor[(num_rows, groups), sf_dtype],
        gsf_T: T.Tensor[(num_rows,), T.float32],
    ):
        body(x_TD, q, sf_TG, gsf_T)

    return per_token_scaled_cast
def per_token_scaled_cast(
    x_TD: torch.Tensor, *, group: int, fmt: str, sf_format: str
) -> tuple[torch.Tensor, ...]:
    """The TileLang twin of the reference's ``per_token_cast_fp4`` (``fmt="e2m1"``,
    ``sf_format="ue8m0"``), ``per_token_cast_fp4_e4m3_sf`` (``"e2m1"``, ``"e4m3"``) and
    ``per_token_cast_e4m3_sf`` (``"e4m3"``, ``"e4m3"``): same arguments, same results.

    Args:
        x_TD: ``[T, D]`` float32, bfloat16 or float16 on a CUDA device (``D`` even for e2m1;
            copied first if not contiguous); :func:`supports` says which widths.
        group: columns per scale, a power of two from 2 to 1024.
        fmt, sf_format: see above.

    Returns:
        ``(q, sf_TG)`` with UE8M0 scales, ``(q, sf_TG, gsf_T)`` with e4m3 scales.
    """
    check_tensor("x_TD", x_TD, dtype=FLOAT_DTYPES, ndim=2)
    check_cuda("x_TD", x_TD)
    if fmt not in FORMATS or sf_format not in SCALES or (fmt, sf_format) == ("e4m3", "ue8m0"):
        raise ValueError(f"fmt, sf_format: expected e2m1 with ue8m0 or e4m3 scales, or e4m3 with e4m3 scales, "
                         f"got {fmt!r}, {sf_format!r}")
    t, d = x_TD.shape
    if fmt == "e2m1" and d % 2:
        raise ValueError(f"x_TD: expected an even width (two e2m1 values a byte), got shape {tuple(x_TD.shape)}")
    if not supports(d, group, x_TD.element_size()):
        raise ValueError(f"group: expected a power of two in [2, 1024] and rows of at most {MAX_VECTORS} vectors a thread, "
                         f"got group {group} with shape {tuple(x_TD.shape)}")
    device = x_TD.device
    q = (torch.empty((t, d // 2), dtype=torch.uint8, device=device) if fmt == "e2m1"
         else torch.empty((t, d), dtype=E4M3, device=device))
    sf_TG = torch.empty((t, -(-d // group)), dtype=torch.uint8 if sf_format == "ue8m0" else E4M3, device=device)
    out = (q, sf_TG) if sf_format == "ue8m0" else (q, sf_TG, torch.empty(t, dtype=torch.float32, device=device))
    if t == 0:
        return out
    if d == 0:  # no groups; the reference gives the floor's per-token scale
        return REFERENCES[fmt, sf_format](x_TD, group=group)
    get_per_token_scaled_cast_kernel(d, group, fmt, sf_format, tl_dtype(x_TD.dtype))(x_TD.contiguous(), *out)
    return out
