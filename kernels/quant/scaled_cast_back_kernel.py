"""The casts back of :mod:`kernels.quant.scaled_cast_kernel`'s casts: ``cast_back_fp4`` (e2m1
values with UE8M0 or two-level e4m3 scales) and ``cast_back_e4m3_sf`` (see
:mod:`kernels.quant.reference` for the function computed).

A CTA covers the same tile of whole scale groups as the FP8 cast back
(:func:`kernels.tiles.blockwise_tile`, sized by the output's 16-byte vectors): the thread that
stores an output vector loads the bytes it comes from (half as many for e2m1), reads its group's
scale from global memory, and writes each value (an e2m1 code decoded from its bits,
:func:`e2m1_value`) times the group's float32 multiplier, one product rounded once to the output
dtype, as the reference.

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
            for i, j in T.Parallel(tile_m, tile_n):
                row, g = pm * tile_m + i, pn * tile_g + j // group
                if sf_format == "ue8m0":
                    scale = unpack_scale(sf_TG[row, g], True)
                else:
                    scale = T.cast(sf_TG[row, g], "float32") * gsf_T[row]
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
