"""Weighted reduce kernel, optionally fused with FP8 dequantization of the expert outputs (see
:mod:`kernels.reduce.reference` for the function).

One CTA per (token, column tile): each thread owns one 16-byte vector of the token's output
(:func:`kernels.quant.tiles.vector_layout`), and for k = 0 .. K-1 adds ``w[t, k] * y[pos[t, k]]``
(dequantized with its per-token scale for e4m3 ``y``) into float32 registers. Every product and
sum is an IEEE round-to-nearest operation in the reference's order (no FMA), so the result is
bit-exact. A masked route (-1) reads nothing.

Shape suffixes: T tokens, K routes per token, P layout rows, D hidden, G scale groups.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.quant.reference import E4M3, FLOAT_DTYPES, SCALE_DTYPES
from kernels.quant.tiles import PASS_CONFIGS, check_cuda, tl_dtype, unpack_scale, vector_layout, vector_width
from kernels.validate import check_dtype, check_index_range, check_positive, check_tensor


def reduce_tile(num_cols: int, y_bytes: int) -> tuple[int, int, int]:
    """``(tile_n, threads, vec)``: up to 128 threads x one vector each (at least 2-byte lanes, so an
    e4m3 row moves 8 bytes a thread and an output row 16)."""
    vec = vector_width(num_cols, max(2, y_bytes))
    threads = 32
    while threads < 128 and threads * vec < num_cols:
        threads *= 2
    return threads * vec, threads, vec


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_weighted_reduce_kernel(
    num_cols: int, topk: int, y_dtype: str, index_dtype: str, out_dtype: str, group: int, packed: bool
):
    """``(y_PD, sf_PG, pos_TK, weights_TK, out_TD)`` kernel; ``sf_PG`` is read only for e4m3 ``y``
    (pass any ``[P, G]`` tensor of the scale dtype otherwise)."""
    num_tokens, num_rows = T.dynamic("num_tokens"), T.dynamic("num_rows")
    tile_n, threads, vec = reduce_tile(num_cols, T.dtype(y_dtype).bytes)
    dequantize = y_dtype == "float8_e4m3fn"
    sf_dtype = "uint8" if packed else "float32"

    @T.prim_func
    def weighted_reduce(
        y_PD: T.Tensor[(num_rows, num_cols), y_dtype],
        sf_PG: T.Tensor[(num_rows, T.ceildiv(num_cols, group)), sf_dtype],
        pos_TK: T.Tensor[(num_tokens, topk), index_dtype],
        weights_TK: T.Tensor[(num_tokens, topk), "float32"],
        out_TD: T.Tensor[(num_tokens, num_cols), out_dtype],
    ):
        with T.Kernel(num_tokens, T.ceildiv(num_cols, tile_n), threads=threads) as (t, pn):
            acc = T.alloc_fragment((1, tile_n), "float32")
            y_frag = T.alloc_fragment((1, tile_n), y_dtype)
            T.annotate_layout({acc: vector_layout(1, tile_n, threads, vec), y_frag: vector_layout(1, tile_n, threads, vec)})
            T.clear(acc)
            for k in T.unroll(topk):
                row = pos_TK[t, k]
                weight = weights_TK[t, k]
                if row >= 0:
                    T.copy(y_PD[row : row + 1, pn * tile_n : (pn + 1) * tile_n], y_frag, disable_tma=True)
                    for i, j in T.Parallel(1, tile_n):
                        y = T.cast(y_frag[i, j], "float32")
                        if dequantize:
                            y = T.ieee_mul(y, unpack_scale(sf_PG[row, (pn * tile_n + j) // group], packed))
                        acc[i, j] = T.ieee_add(acc[i, j], T.ieee_mul(weight, y))
            for i, j in T.Parallel(1, tile_n):
                out_TD[t, pn * tile_n + j] = T.cast(acc[i, j], out_dtype)

    return weighted_reduce


def weighted_reduce(
    y_PD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    sf_PG: torch.Tensor | None = None,
    group: int = 128,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.reduce.reference.weighted_reduce` (same arguments, same
    bits); tensors must be on a CUDA device and are copied first if not contiguous."""
    check_tensor("y_PD", y_PD, dtype=(*FLOAT_DTYPES, E4M3), ndim=2)
    check_cuda("y_PD", y_PD)
    p, d = y_PD.shape
    check_tensor("pos_TK", pos_TK, dtype=(torch.int32, torch.int64), ndim=2, device=y_PD.device)
    check_tensor("weights_TK", weights_TK, dtype=torch.float32, shape=pos_TK.shape, device=y_PD.device)
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
    else:
        sf_PG = y_PD.new_empty((p, -(-d // group)), dtype=torch.float32)  # never read

    t, k = pos_TK.shape
    if t == 0 or d == 0 or k == 0 or p == 0:  # no token, or no row any route could read
        return torch.zeros((t, d), dtype=out_dtype, device=y_PD.device)
    out_TD = torch.empty((t, d), dtype=out_dtype, device=y_PD.device)
    kernel = get_weighted_reduce_kernel(
        d, k, tl_dtype(y_PD.dtype), tl_dtype(pos_TK.dtype), tl_dtype(out_dtype), group, sf_PG.dtype == torch.uint8
    )
    kernel(y_PD.contiguous(), sf_PG.contiguous(), pos_TK.contiguous(), weights_TK.contiguous(), out_TD)
    return out_TD
