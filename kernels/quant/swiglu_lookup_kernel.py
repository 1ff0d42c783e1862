"""SwiGLU fused with the per-token FP8 cast for many bfloat16 tokens, SiLU read from a table.

A bfloat16 gate is one of 65536 values, and outside a band of magnitudes its exact SiLU
(``g / (1 + expf(-g))`` with IEEE operations, as PyTorch's CUDA kernels evaluate it) is a multiple
of the gate: ``g * 0.5`` where ``|g| <= 2**-25`` (the denominator rounds to 2), ``g`` where ``g >=
127.5`` (it rounds to 1) and ``g * 0`` (``-0``, or NaN for ``-inf``) where ``g <= -127.5`` (it
overflows). So each CTA computes, once, the exact SiLU of every gate in the band (bfloat16 bits
``0x3300`` to ``0x42ff`` and the same negated: 8192 values, 64 KiB of shared memory) and then reads
it: ``silu(g) = g * factor + value`` with the gate's magnitude clamped to the band, the entry of each
end holding its factor (``value = -0``, which adds nothing) and every other entry ``factor = 0``.
A value then costs about 25 SASS instructions with the loop's share, against the tile kernel's
40 (docs/design/quant.md has the figures).

The CTAs are persistent (a few an SM, each loops over the tensor), so the table is built once per
CTA; each thread takes one 16-byte vector of gates and of ups an iteration, and a scale group's
threads meet their amax by shuffles. The next iteration's vectors are loaded before this one's
math, so every thread keeps a load in flight.

Shape suffixes: T tokens, I intermediate (``x_TI2 = [gate | up]`` is ``[T, 2 * I]``), G groups.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.tiles import PASS_CONFIGS, scale_and_inverse, sm_count, to_e4m3

KEY_LOW, KEY_HIGH = 0x3300, 0x42FF  # bfloat16 bits of 2**-25 and 127.5: the band's ends
BAND_KEYS = KEY_HIGH - KEY_LOW + 1
VEC = 8  # bfloat16 gates (and ups) a thread loads as one 16-byte vector
THREADS = 768  # x 2 CTAs an SM, 40 registers: 45.1 us at 16384 x 2048 (1024 x 1: 50.6)
CTAS_PER_SM = 2
MIN_TOKENS = 16384  # fewer tokens: not measured to pay for a table a CTA (docs/design/quant.md)


def supports_lookup(num_tokens: int, inter: int, dtype: torch.dtype, group: int, clamp: float | None) -> bool:
    """Whether :func:`get_swiglu_lookup_cast_kernel` takes this call: bfloat16 gates (the table
    holds bfloat16 values), unclamped (a clamped gate need not be one), whole scale groups of 1 to 32
    vectors a row, and enough tokens that each CTA's table (8192 SiLUs) is a small part of its work."""
    return (dtype == torch.bfloat16 and clamp is None and VEC <= group <= 32 * VEC and inter % group == 0
            and num_tokens >= MIN_TOKENS)


@T.macro
def silu_exact(g):
    return T.ieee_fdiv(g, T.ieee_add(T.float32(1), T.exp(-g)))


@T.macro
def band_entry(table, e):
    """Entry ``e`` of the table: key ``KEY_LOW + e // 2`` (a magnitude's bfloat16 bits), sign ``e % 2``."""
    key = T.uint32(KEY_LOW) + T.cast(e // 2, "uint32")
    negative = T.cast(e % 2, "uint32")
    g = T.reinterpret((negative << 31) | (key << 16), "float32")
    table[e, 0] = T.if_then_else(key == T.uint32(KEY_LOW), T.float32(0.5),
                                 T.if_then_else(key == T.uint32(KEY_HIGH), T.float32(1) - T.cast(negative, "float32"),
                                                T.float32(0)))
    table[e, 1] = T.if_then_else(T.Or(key == T.uint32(KEY_LOW), key == T.uint32(KEY_HIGH)),
                                 T.reinterpret(T.uint32(0x80000000), "float32"), silu_exact(g))


@T.macro
def silu_lookup(table, g):
    """The exact SiLU of a bfloat16 gate ``g`` (as float32) from the table."""
    band = T.min(T.max(T.abs(g), T.float32(2.0**-25)), T.float32(127.5))
    e = ((T.reinterpret(band, "uint32") >> 16) - T.uint32(KEY_LOW)) * 2 + (T.reinterpret(g, "uint32") >> 31)
    return T.ieee_fmaf(g, table[e, 0], table[e, 1])


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_swiglu_lookup_cast_kernel(inter: int, group: int, round_sf: bool, pack_sf: bool, ctas: int,
                                  weighted: bool = False, threads: int = THREADS, min_blocks: int = CTAS_PER_SM,
                                  prefetch: bool = True):
    """``(x_TI2, q_TI, sf_TG, weights_T)`` kernel over ``ctas`` persistent CTAs: ``silu(gate) * up``
    in float32 (times ``weights_T[t]`` when ``weighted``, else never read), cast to e4m3 with one
    scale per ``group`` columns, as :func:`kernels.quant.swiglu_kernel.get_swiglu_forward_kernel`
    computes it. ``threads``, ``min_blocks`` and ``prefetch`` are for tuning sweeps."""
    num_tokens = T.dynamic("num_tokens")
    lanes = group // VEC  # threads of a scale group
    row_vecs = inter // VEC
    x_dtype, q_dtype, sf_dtype = "bfloat16", "float8_e4m3fn", "uint8" if pack_sf else "float32"

    @T.macro
    def load(x_TI2, total, u, gate, up):
        """Vector ``u`` of the output's gates and ups (nothing past ``total``)."""
        if u < total:
            row = T.cast(u // row_vecs, "int64")
            for j in T.vectorized(VEC):
                gate[j] = x_TI2[row, u % row_vecs * VEC + j]
            for j in T.vectorized(VEC):
                up[j] = x_TI2[row, inter + u % row_vecs * VEC + j]

    @T.prim_func
    def swiglu_lookup_cast(
        x_TI2: T.Tensor[(num_tokens, 2 * inter), x_dtype],
        q_TI: T.Tensor[(num_tokens, inter), q_dtype],
        sf_TG: T.Tensor[(num_tokens, inter // group), sf_dtype],
        weights_T: T.Tensor[(num_tokens,), T.float32],
    ):
        with T.Kernel(ctas, threads=threads) as cta:
            if min_blocks > 1:  # registers capped so that many CTAs fit an SM (768 x 2: 40 a thread)
                T.annotate_min_blocks_per_sm(min_blocks)
            tid = T.get_thread_binding()
            table = T.alloc_shared((2 * BAND_KEYS, 2), "float32")
            gate = T.alloc_local((VEC,), "bfloat16")
            up = T.alloc_local((VEC,), "bfloat16")
            next_gate = T.alloc_local((VEC,), "bfloat16")
            next_up = T.alloc_local((VEC,), "bfloat16")
            y = T.alloc_local((VEC,), "float32")
            q = T.alloc_local((VEC,), "float8_e4m3fn")
            amax = T.alloc_local((1,), "float32")
            total = num_tokens * row_vecs  # vectors of the output
            stride = ctas * threads
            first = cta * threads + tid
            # every lane of a warp runs the same iterations (the shuffles need the whole warp);
            # a lane past the end loads and stores nothing, and its whole group is past it
            trips = T.ceildiv(total - (first - tid % 32), stride)

            if prefetch:
                load(x_TI2, total, first, next_gate, next_up)  # in flight while the table is built
            for s in T.serial(T.ceildiv(2 * BAND_KEYS, threads)):
                if s * threads + tid < 2 * BAND_KEYS:
                    band_entry(table, s * threads + tid)
            T.sync_threads()
            for it in T.serial(trips):
                u = first + it * stride
                if prefetch:
                    for j in T.vectorized(VEC):
                        gate[j] = next_gate[j]
                    for j in T.vectorized(VEC):
                        up[j] = next_up[j]
                    load(x_TI2, total, u + stride, next_gate, next_up)
                else:
                    load(x_TI2, total, u, gate, up)
                row = T.cast(u // row_vecs, "int64")
                amax[0] = T.float32(0)
                for j in T.unroll(VEC):
                    y[j] = T.ieee_mul(silu_lookup(table, T.cast(gate[j], "float32")), T.cast(up[j], "float32"))
                    if weighted:
                        y[j] = T.ieee_mul(y[j], T.if_then_else(u < total, weights_T[row], T.float32(0)))
                    amax[0] = T.max(amax[0], T.abs(y[j]))
                for delta in [lanes >> k for k in range(1, lanes.bit_length())]:
                    amax[0] = T.max(amax[0], T.shfl_xor(amax[0], delta))
                sf, inv = scale_and_inverse(amax[0], round_sf, pack_sf)
                if u < total:
                    if tid % lanes == 0:
                        sf_TG[row, u % row_vecs // lanes] = sf
                    for j in T.vectorized(VEC):
                        q[j] = to_e4m3(y[j] * inv)
                    for j in T.vectorized(VEC):
                        q_TI[row, u % row_vecs * VEC + j] = q[j]

    return swiglu_lookup_cast


def lookup_ctas(device: torch.device) -> int:
    """The persistent grid: ``CTAS_PER_SM`` CTAs on every SM."""
    return sm_count(device) * CTAS_PER_SM
