"""The casts back of :mod:`kernels.quant.scaled_cast_kernel`'s casts: ``cast_back_fp4`` (e2m1
values with UE8M0 or two-level e4m3 scales) and ``cast_back_e4m3_sf`` (see
:mod:`kernels.quant.reference` for the function computed).

A CTA covers the same tile of whole scale groups as the FP8 cast back
(:func:`kernels.tiles.blockwise_tile`, sized by the output's 16-byte vectors): the thread that
stores an output vector loads the bytes it comes from (half as many for e2m1), reads its group's
scale from global memory, and writes each value (an e2m1 code decoded from its bits,
:func:`e2m1_value`) times the group's float32 multiplier, one product rounded once to the output
dtype, as the reference. e2m1 to bfloat16 or float16 in whole vectors takes ``DECODER_SOURCE``
instead (a table of the group's eight magnitudes' outputs, each value looked up by byte permutes)
and up to four such tiles a CTA: 86.0 -> 77.0 us at 16384 x 7168 on an H200.

Shape suffixes: T tokens, D hidden, H packed bytes (``D / 2``), G scale groups.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.quant.scaled_cast_kernel import supports_group
from kernels.tiles import (
    PASS_CONFIGS,
    blockwise_tile,
    check_cuda,
    row_major,
    tl_dtype,
    unpack_scale,
    vector_layout,
    vector_width,
)
from kernels.validate import check_dtype, check_tensor


def e2m1_value(code):
    """The float32 value of an e2m1 code (int32, 0..15; an expression built here, in Python), from
    its bits: magnitudes 1 to 6 (codes 2 to 7) are ``(code + 252) << 22`` as float32 bits, 0.5 and
    0 are ``code`` times 0.5's bits, and the code's sign bit is the float's."""
    mag = code & 7
    bits = T.cast(T.if_then_else(mag >= 2, (mag + 252) << 22, mag * 0x3F000000), "uint32")
    return T.reinterpret(bits | T.cast(code & 8, "uint32") << 28, "float32")


# The decoder of eight e2m1 codes to 16-bit floats (``T.import_source``; ``T.call_extern`` of
# ``ep_e2m1x8_to_bfloat16`` or ``ep_e2m1x8_to_float16``). A code's output is its magnitude's value
# times the scale, rounded once to float32 (the reference's product) and then to the output type,
# with the code's sign: the eight magnitudes' outputs of the vector's group are computed first, as a
# table of bytes, and each value is then looked up in it by byte permutes (``prmt`` indexes eight
# bytes: one for the outputs' low bytes, one for their high bytes), four values an instruction.
DECODER_SOURCE = r"""
template <bool BF16>
__device__ __forceinline__ unsigned ep_pack16x2(float lo, float hi) {
  unsigned d;
  if (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ unsigned ep_prmt(unsigned a, unsigned b, unsigned selector) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// dst: 8 outputs (16 bytes); src: 4 bytes of codes, element 2j in byte j's low nibble.
template <bool BF16>
__device__ __forceinline__ void ep_e2m1x8_decode(void* dst, const void* src, float scale) {
  unsigned q = *(const unsigned*)src;
  // the outputs of magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6, two a word
  unsigned t0 = ep_pack16x2<BF16>(__fmul_rn(0.0f, scale), __fmul_rn(0.5f, scale));
  unsigned t1 = ep_pack16x2<BF16>(scale, __fmul_rn(1.5f, scale));
  unsigned t2 = ep_pack16x2<BF16>(__fmul_rn(2.0f, scale), __fmul_rn(3.0f, scale));
  unsigned t3 = ep_pack16x2<BF16>(__fmul_rn(4.0f, scale), __fmul_rn(6.0f, scale));
  unsigned low03 = ep_prmt(t0, t1, 0x6420u), low47 = ep_prmt(t2, t3, 0x6420u);  // low bytes, by magnitude
  unsigned high03 = ep_prmt(t0, t1, 0x7531u), high47 = ep_prmt(t2, t3, 0x7531u);
  unsigned magnitudes = q & 0x77777777u;  // selectors: a code's magnitude picks its byte
  unsigned odd_signs = q, even_signs = q << 4;  // byte j's top bit: the sign of code 2j + 1, 2j
  unsigned out[4];
  for (int half = 0; half < 2; ++half) {
    unsigned selector = magnitudes >> (16 * half);  // codes 4 * half .. 4 * half + 3
    unsigned low = ep_prmt(low03, low47, selector), high = ep_prmt(high03, high47, selector);
    for (int k = 2 * half; k < 2 * half + 2; ++k) {
      unsigned value = ep_prmt(low, high, k % 2 ? 0x7362u : 0x5140u);  // codes 2k, 2k + 1 as two outputs
      // the sign bits, by prmt's sign-replicating selectors: byte 1 from even_signs' byte k, byte 3 from odd_signs'
      unsigned signs = ep_prmt(even_signs, odd_signs, (0x8u | k) << 4 | (0xCu | k) << 12);
      out[k] = value | (signs & 0x80008000u);
    }
  }
  *(uint4*)dst = make_uint4(out[0], out[1], out[2], out[3]);
}

__device__ __forceinline__ void ep_e2m1x8_to_bfloat16(void* dst, const void* src, float scale) {
  ep_e2m1x8_decode<true>(dst, src, scale);
}

__device__ __forceinline__ void ep_e2m1x8_to_float16(void* dst, const void* src, float scale) {
  ep_e2m1x8_decode<false>(dst, src, scale);
}
"""


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_per_token_scaled_cast_back_kernel(num_cols: int, group: int, fmt: str, sf_format: str, out_dtype: str):
    """``(q, sf_TG[, gsf_T], out_TD)`` kernel, the arguments as
    :func:`kernels.quant.scaled_cast_kernel.get_per_token_scaled_cast_kernel`'s outputs."""
    num_rows = T.dynamic("num_rows")
    groups = -(-num_cols // group)
    vec = vector_width(num_cols, T.dtype(out_dtype).bytes)
    tile_m, tile_n, threads = blockwise_tile(num_cols, (1, group), vec)
    tile_g = tile_n // group
    per_byte = 2 if fmt == "e2m1" else 1  # values a byte of q
    q_cols, q_dtype = (num_cols // 2, "uint8") if fmt == "e2m1" else (num_cols, "float8_e4m3fn")
    sf_dtype = "uint8" if sf_format == "ue8m0" else "float8_e4m3fn"
    # e2m1 to 16-bit floats in whole 16-byte vectors, one group's scale each: the table decoder
    decoder = (f"ep_e2m1x8_to_{out_dtype}" if fmt == "e2m1" and vec == 8 and group % vec == 0
               and out_dtype in ("bfloat16", "float16") else None)
    if decoder is not None and tile_m == 1:
        # up to four of those one-row tiles a CTA, four vectors a thread: a thread's loads are 4
        # bytes a vector, and one vector a thread kept too few in flight (82.6 against 76.7-77.0
        # us at 16384 x 7168 on an H200; four rows a CTA 78.0, eight 89.3)
        tile_n = min(4 * tile_n, -(-num_cols // tile_n) * tile_n)
        tile_g = tile_n // group

    @T.macro
    def group_scale(sf_TG, gsf_T, row, g):
        if sf_format == "ue8m0":
            return unpack_scale(sf_TG[row, g], True)
        return T.cast(sf_TG[row, g], "float32") * gsf_T[row]

    @T.macro
    def body(q, sf_TG, gsf_T, out_TD):
        tiles_n = T.ceildiv(num_cols, tile_n)
        with T.Kernel(T.ceildiv(num_rows, tile_m) * tiles_n, threads=threads) as pid:
            pm, pn = row_major(pid, tiles_n)
            q_frag = T.alloc_fragment((tile_m, tile_n // per_byte), q_dtype)
            T.annotate_layout({q_frag: vector_layout(tile_m, tile_n // per_byte, threads, vec // per_byte)})
            T.copy(q[pm * tile_m, pn * tile_n // per_byte], q_frag, disable_tma=True)
            out_frag = T.alloc_fragment((tile_m, tile_n), out_dtype)
            T.annotate_layout({out_frag: vector_layout(tile_m, tile_n, threads, vec)})
            if decoder is not None:
                T.import_source(DECODER_SOURCE)
                for i, v in T.Parallel(tile_m, tile_n // vec):
                    row, g = pm * tile_m + i, pn * tile_g + v * vec // group
                    T.call_extern("handle", decoder, T.address_of(out_frag[i, v * vec]),
                                  T.address_of(q_frag[i, v * vec // 2]), group_scale(sf_TG, gsf_T, row, g))
            else:
                for i, j in T.Parallel(tile_m, tile_n):
                    row, g = pm * tile_m + i, pn * tile_g + j // group
                    scale = group_scale(sf_TG, gsf_T, row, g)
                    if fmt == "e2m1":
                        value = e2m1_value((T.cast(q_frag[i, j // 2], "int32") >> (j % 2 * 4)) & 15)
                    else:
                        value = T.cast(q_frag[i, j], "float32")
                    out_frag[i, j] = T.cast(value * scale, out_dtype)
            T.copy(out_frag, out_TD[pm * tile_m, pn * tile_n])

    if sf_format == "ue8m0":

        @T.prim_func
        def per_token_scaled_cast_back(
            q: T.Tensor[(num_rows, q_cols), q_dtype],
            sf_TG: T.Tensor[(num_rows, groups), sf_dtype],
            out_TD: T.Tensor[(num_rows, num_cols), out_dtype],
        ):
            body(q, sf_TG, None, out_TD)

        return per_token_scaled_cast_back

    @T.prim_func
    def per_token_scaled_cast_back(
        q: T.Tensor[(num_rows, q_cols), q_dtype],
        sf_TG: T.Tensor[(num_rows, groups), sf_dtype],
        gsf_T: T.Tensor[(num_rows,), T.float32],
        out_TD: T.Tensor[(num_rows, num_cols), out_dtype],
    ):
        body(q, sf_TG, gsf_T, out_TD)

    return per_token_scaled_cast_back


def per_token_scaled_cast_back(
    q: torch.Tensor, sf_TG: torch.Tensor, gsf_T: torch.Tensor | None, *, group: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The TileLang twin of the reference's ``cast_back_fp4`` (``q`` uint8) and ``cast_back_e4m3_sf``
    (``q`` e4m3): same arguments, same result.

    Args:
        q: ``[T, H]`` uint8 (two e2m1 codes a byte) or ``[T, D]`` float8_e4m3fn, on a CUDA device.
        sf_TG: ``[T, ceil(D / group)]`` uint8 exponents (e2m1 only) or float8_e4m3fn.
        gsf_T: ``[T]`` float32 with e4m3 scales, else None.
        group: columns per scale, a power of two from 2 to 1024.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``[T, D]`` in ``out_dtype``.
    """
    check_tensor("q", q, dtype=(torch.uint8, E4M3), ndim=2)
    check_cuda("q", q)
    if not supports_group(group):
        raise ValueError(f"group: expected a power of two in [2, 1024], got {group}")
    fmt = "e2m1" if q.dtype == torch.uint8 else "e4m3"
    t, d = q.shape[0], q.shape[1] * (2 if fmt == "e2m1" else 1)
    check_tensor("sf_TG", sf_TG, dtype=(torch.uint8, E4M3) if fmt == "e2m1" else E4M3, shape=(t, -(-d // group)),
                 device=q.device)
    sf_format = "ue8m0" if sf_TG.dtype == torch.uint8 else "e4m3"
    if sf_format == "ue8m0" and gsf_T is not None:
        raise ValueError("gsf_T: expected None with UE8M0 (uint8) scales, got a tensor")
    if sf_format == "e4m3":
        check_tensor("gsf_T", gsf_T, dtype=torch.float32, shape=(t,), device=q.device)
    check_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    out_TD = torch.empty((t, d), dtype=out_dtype, device=q.device)
    if t == 0 or d == 0:
        return out_TD
    scales = (sf_TG.contiguous(),) if gsf_T is None else (sf_TG.contiguous(), gsf_T.contiguous())
    kernel = get_per_token_scaled_cast_back_kernel(d, group, fmt, sf_format, tl_dtype(out_dtype))
    kernel(q.contiguous(), *scales, out_TD)
    return out_TD
