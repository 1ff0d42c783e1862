"""The casts back of :mod:`kernels.quant.scaled_cast_kernel`'s casts: ``cast_back_fp4`` (e2m1
values with UE8M0 or two-level e4m3 scales) and ``cast_back_e4m3_sf`` (see
:mod:`kernels.quant.reference` for the function computed).

A CTA takes one token; each output element is its value (an e2m1 code decoded by arithmetic:
``m / 2`` for exponent 0, ``(2 + m) * 2**(e - 2)`` otherwise, both exact) times its group's
float32 multiplier, one product rounded once to the output dtype, as the reference.

Shape suffixes: T tokens, D hidden, H packed bytes (``D / 2``), G scale groups.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.quant.reference import E4M3, FLOAT_DTYPES
from kernels.quant.scaled_cast_kernel import THREADS, supports_group
from kernels.tiles import PASS_CONFIGS, check_cuda, tl_dtype, unpack_scale
from kernels.validate import check_dtype, check_tensor


def e2m1_value(code):
    """The float32 value of an e2m1 code (int32, 0..15; an expression built here, in Python)."""
    e, m = (code & 7) >> 1, code & 1
    mag = T.if_then_else(e == 0, T.cast(m, "float32") * T.float32(0.5),
                         T.cast(2 + m, "float32") * T.reinterpret((e + 125) << 23, "float32"))
    return T.if_then_else(code >= 8, -mag, mag)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_per_token_scaled_cast_back_kernel(num_cols: int, group: int, fmt: str, sf_format: str, out_dtype: str):
    """``(q, sf_TG[, gsf_T], out_TD)`` kernel, the arguments as
    :func:`kernels.quant.scaled_cast_kernel.get_per_token_scaled_cast_kernel`'s outputs."""
    num_rows = T.dynamic("num_rows")
    groups = -(-num_cols // group)
    tile_n = groups * group
    q_cols, q_dtype = (num_cols // 2, "uint8") if fmt == "e2m1" else (num_cols, "float8_e4m3fn")
    sf_dtype = "uint8" if sf_format == "ue8m0" else "float8_e4m3fn"
    gsf_dtype = "float32"

    @T.macro
    def body(q, sf_TG, gsf_T, out_TD):
        with T.Kernel(num_rows, threads=THREADS) as row:
            for i, j in T.Parallel(1, tile_n):
                if j < num_cols:
                    if sf_format == "ue8m0":
                        scale = unpack_scale(sf_TG[row + i, j // group], True)
                    else:
                        scale = T.cast(sf_TG[row + i, j // group], "float32") * gsf_T[row + i]
                    if fmt == "e2m1":
                        code = (T.cast(q[row + i, j // 2], "int32") >> ((j % 2) * 4)) & 15
                        out_TD[row + i, j] = T.cast(e2m1_value(code) * scale, out_dtype)
                    else:
                        out_TD[row + i, j] = T.cast(T.cast(q[row + i, j], "float32") * scale, out_dtype)

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
        gsf_T: T.Tensor[(num_rows,), gsf_dtype],
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
