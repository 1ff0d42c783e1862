"""TileLang building blocks shared by the FP8 kernels: pass configs, how a tile is spread over
threads in 16-byte vectors, and the scale math of :mod:`kernels.quant.reference`.

The scale math must give the reference's bytes: the divisions ``amax / 448`` and ``448 / amax`` are
IEEE divisions (``T.ieee_fdiv``, round to nearest; never a reciprocal multiply), fast math is off,
and UE8M0 exponents come from the float32 bits.

Shape letters: M/N tile rows/columns, G scale groups.
"""

from __future__ import annotations

import functools
import math

import tilelang
import torch
from tilelang import language as T

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
VECTOR_BYTES = 16  # one ld.global.v4 / st.global.v4 per thread

PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False,
}
# Kernels that store into other ranks' copies of a region (kernels.comm): those stores lie outside
# the buffer they are given, so TileLang's out-of-bounds guards are off and they guard by hand.
PEER_PASS_CONFIGS = {**PASS_CONFIGS, tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}
# Kernels that place every CTA barrier themselves (shared slots a thread alone reads back, staged by
# kernels.rows.vector_cp_async): TileLang's automatic barriers would hold the CTA together at each
# shared access.
HAND_SYNC_PASS_CONFIGS = {**PASS_CONFIGS, tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def row_major(pid, tiles_n):
    """``(tile row, tile column)`` of CTA ``pid`` of a one-axis grid that takes the tiles of a
    ``[rows, cols]`` array row by row.

    Why not rows on the fastest grid axis: CTAs launched together then read one row's consecutive
    bytes, which DRAM serves faster than the same bytes spread over many rows (mHC pre-apply 112.0 ->
    108.8 us and post 218.1 -> 196.5 us at 8192 x 4 x 4096 bf16 on an H100); and one axis has no
    65535 cap on the rows."""
    return pid // tiles_n, pid % tiles_n


@functools.cache  # called on every op call: T.dtype takes ~0.8 us of host time, a dict look-up ~0.05
def tl_dtype(dtype: torch.dtype) -> str:
    """The TileLang name of a torch dtype (the factories are specialised on these strings)."""
    return str(T.dtype(dtype))


def check_cuda(name: str, t: torch.Tensor) -> torch.Tensor:
    """A kernel's tensor argument must live on a CUDA device."""
    if not t.is_cuda:
        raise ValueError(f"{name}: expected a tensor on a CUDA device, got one on {t.device}")
    return t


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SM count (persistent and bounded grids size themselves by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous and 16-byte aligned (vector accesses need both), else a copy."""
    if t.is_contiguous() and t.data_ptr() % VECTOR_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when int32 and contiguous (index arguments nearly always are), else an int32
    contiguous copy: checked in Python, a fraction of the host time of torch's no-op ``.to()`` and
    ``.contiguous()`` calls, which every eager launch pays."""
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def vector_width(num_cols: int, elem_bytes: int) -> int:
    """Elements per 16-byte vector, reduced so that every row starts on a vector boundary."""
    return math.gcd(VECTOR_BYTES // elem_bytes, num_cols)


def vector_layout(tile_m: int, tile_n: int, threads: int, vec: int) -> T.Fragment:
    """Row-major tile dealt out ``vec`` consecutive elements at a time to consecutive threads, so a
    warp touches one contiguous run of ``32 * vec`` elements per access (coalesced 16-byte
    vectors), and each thread holds ``tile_m * tile_n / (threads * vec)`` vectors in flight."""

    def forward(i, j):
        flat = i * tile_n + j
        return flat // vec % threads, flat // (vec * threads) * vec + flat % vec

    return T.Fragment((tile_m, tile_n), forward_fn=forward)


def blockwise_tile(num_cols: int, block: tuple[int, int], vec: int) -> tuple[int, int, int]:
    """``(tile_m, tile_n, threads)`` of a CTA for scales over ``block = (block_m, block_n)``.

    A CTA covers whole scale blocks, so each block's amax is reduced inside one CTA:
    per-token ``(1, g)``: 128 threads, up to 1024 columns x enough rows for 8 elements a thread
    (one row at 1024 columns: 115.7 us against 117.0 for 4 rows, per_token_cast at 16384 x 7168 on
    an H100);
    ``(b, b)`` and ``(b, 1)``: ``b`` rows x up to 16384 / b columns, 256 threads.
    """
    block_m, block_n = block
    if block_m == 1:
        groups = min(max(1, 1024 // block_n), 1 << max(0, math.ceil(math.log2(-(-num_cols // block_n)))))
        tile_n = block_n * groups
        tile_m = max(1, 1024 // tile_n)
        threads = 128
    else:
        tile_m = block_m
        tile_n = block_n if block_n > 1 else max(vec, 16384 // block_m)
        threads = 256
    threads = max(32, min(threads, tile_m * tile_n // vec))
    return tile_m, tile_n, threads


def supports_block(block: tuple[int, int]) -> bool:
    """Block shapes the blockwise kernels take: powers of two, at least one side > 1 (anything
    else runs the reference)."""
    block_m, block_n = block
    return is_pow2(block_m) and is_pow2(block_n) and block_n <= 1024 and block_m <= 1024 and block_m * block_n > 1


@T.macro
def scale_and_inverse(amax, round_sf: bool, pack_sf: bool):
    """``(sf as stored, multiplier that quantizes)`` for one block's float32 ``amax``."""
    clamped = T.max(amax, T.float32(AMAX_FLOOR))
    ratio = T.ieee_fdiv(clamped, T.float32(E4M3_MAX))
    if not round_sf:
        return ratio, T.ieee_fdiv(T.float32(E4M3_MAX), clamped)
    bits = T.reinterpret(ratio, "int32")
    exponent = (bits >> 23) - 127 + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)
    inverse = T.reinterpret((127 - exponent) << 23, "float32")
    if pack_sf:
        return T.cast(exponent + 127, "uint8"), inverse
    return T.reinterpret((exponent + 127) << 23, "float32"), inverse


@T.macro
def cast_per_token(x_frag, amax, sf_frag, inv_frag, q_frag, group: int, round_sf: bool, pack_sf: bool):
    """A ``[M, N]`` tile cast to e4m3 in registers, one scale per row per ``group`` columns:
    ``amax`` / ``sf_frag`` / ``inv_frag`` ``[M, N / group]`` get each group's amax (in x's dtype),
    its scale as stored and its quantizing multiplier; ``q_frag`` the e4m3 values."""
    tile_m, tile_g = amax.shape
    abs_frag = T.alloc_fragment(x_frag.shape, x_frag.dtype)
    abs_of(x_frag, abs_frag)
    T.reduce_max(T.reshape(abs_frag, [tile_m, tile_g, group]), amax, dim=2)
    for i, g in T.Parallel(tile_m, tile_g):
        sf, inv = scale_and_inverse(T.cast(amax[i, g], "float32"), round_sf, pack_sf)
        sf_frag[i, g] = sf
        inv_frag[i, g] = inv
    for i, j in T.Parallel(tile_m, x_frag.shape[1]):
        q_frag[i, j] = to_e4m3(T.cast(x_frag[i, j], "float32") * inv_frag[i, j // group])


@T.macro
def unpack_scale(sf, packed: bool):
    """A stored scale as float32: uint8 exponent codes ``e + 127`` become ``2**e``."""
    if packed:
        return T.reinterpret(T.cast(sf, "int32") << 23, "float32")
    return sf


@T.macro
def abs_of(x_frag, abs_frag):
    """``abs_frag = |x_frag|`` elementwise, for a reduction to the amax. In bfloat16 / float16 this is
    one native instruction an element (``__habs``), where TileLang's ``reduce_absmax`` computes
    ``max(x, 0 - x)`` through float32 and rounds back: 1.6x the instructions of tile-kernels' casts
    at 128 tokens, where those kernels are issue-bound (Nsight Compute)."""
    for i, j in T.Parallel(*x_frag.shape):
        abs_frag[i, j] = T.abs(x_frag[i, j])


@T.macro
def warp_amax(v):
    """The largest of a warp's float32 magnitudes ``v`` (every lane of the warp calls this): one
    ``redux.sync`` on their bits, sign cleared so that they order as the values (a -0.0 would
    otherwise outrank every positive value), in place of TileLang's five shuffle rounds (per-block
    cast at 128 x 7168: 2.53 against 2.75 us on an H100)."""
    bits = T.reinterpret(v, "uint32") & T.uint32(0x7FFFFFFF)
    return T.reinterpret(T.call_extern("uint32", "__reduce_max_sync", T.uint32(0xFFFFFFFF), bits), "float32")


@T.macro
def to_e4m3(v):
    """float32 to e4m3, saturated at +-448 and rounded to nearest even, by the conversion itself
    (``cvt.rn.satfinite.e4m3x2.f32``): for every finite or infinite value that is the reference's
    clamp then round, and NaN stays NaN as there. A clamp before it (a NaN check, a min and a max)
    cost three instructions an element and changed no byte."""
    return T.cast(v, "float8_e4m3fn")
