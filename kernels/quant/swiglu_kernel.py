"""SwiGLU kernels: forward (optionally fused with the per-token FP8 cast of its float32 result) and
backward, each optionally with per-row weights and a clamp of its inputs, compiled in only where
asked for (see :mod:`kernels.quant.reference` for the functions).

A CTA covers ``[tile_m, tile_n]`` of the output (whole scale groups when casting, as in
:mod:`kernels.quant.blockwise_cast_kernel`), loading the matching gate and up tiles with 16-byte
vectors. The float32 math is written as separate IEEE operations in the order PyTorch's CUDA
kernels evaluate the reference (``silu(g) = g / (1 + expf(-g))``, ``sigmoid(g) = 1 / (1 +
expf(-g))``, no FMA, precise ``expf``), so results match the reference run on the GPU; the CPU
reference's vectorized ``exp`` may differ from CUDA's by an ulp.

Shape suffixes: T tokens, I intermediate (the output width; the input ``x_TI2 = [gate | up]`` is
``[T, 2 * I]``), G scale groups along I.
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.quant.reference import E4M3, FLOAT_DTYPES, check_clamp, check_rows, check_weights
from kernels.tiles import (
    PASS_CONFIGS,
    abs_of,
    blockwise_tile,
    check_cuda,
    row_major,
    scale_and_inverse,
    supports_block,
    tl_dtype,
    to_e4m3,
    vector_layout,
    vector_width,
    warp_amax,
)
from kernels.validate import check_positive, check_tensor

FEW_TOKENS = 256  # up to this many tokens, the forward uses one-row tiles (see get_swiglu_forward_kernel)
FEW_TOKENS_VEC = 2  # values a thread of a one-row tile, at least (see get_swiglu_forward_kernel)
FEW_TOKENS_CAST_THREADS = 512  # a one-row tile with the cast, a group a warp: threads, at most


@T.macro
def silu(g):
    return T.ieee_fdiv(g, T.ieee_add(T.float32(1), T.exp(-g)))


def clamp_gate(gate, clamp: float | None):
    """The gate in float32, limited from above to ``clamp`` (where given)."""
    gate = T.cast(gate, "float32")
    return gate if clamp is None else T.min(gate, T.float32(clamp))


def clamp_up(up, clamp: float | None):
    """Up in float32, limited to ``[-clamp, clamp]`` (where given)."""
    up = T.cast(up, "float32")
    return up if clamp is None else T.max(T.min(up, T.float32(clamp)), T.float32(-clamp))


@T.macro
def row_weight(weights_T, row):
    """``weights_T[row]``, or 0 for a row past the end (a ragged last tile), which is never stored."""
    return T.if_then_else(row < weights_T.shape[0], weights_T[row], T.float32(0))


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_swiglu_forward_kernel(
    inter: int, dtype: str, group: int, cast: bool, round_sf: bool, pack_sf: bool, one_row: bool = False,
    limited: bool = True, tile: tuple[int, int, int] | None = None, vec: int | None = None,
    weighted: bool = False, clamp: float | None = None,
):
    """``(x_TI2, y_TI)`` kernel, or with ``cast`` ``(x_TI2, q_TI, sf_TG)``: ``silu(gate) * up`` in
    float32, then rounded to ``dtype`` or cast to e4m3 with one scale per ``group`` columns.

    ``one_row``: tiles of one token row (for few tokens: 4x the CTAs of the default tile, so a
    small batch spreads over the SMs instead of queueing on a few). Taken only where the row fills
    at least a warp with vectors (``tile_n / vec >= 32``); a narrower row (I = 64 in bfloat16: 16
    vectors) keeps the default tile, since a one-row tile there would leave threads without data,
    which TileLang's ``reduce_absmax`` rejects ("Inconsistent layouts between src and dst in
    ReduceOp" at I = 64) and which would idle half the warp anyway. Unless ``tile`` or ``vec`` is
    given, a thread of a one-row tile then takes few values, since the IEEE ``expf`` and divisions
    of each are a chain nothing hides in a small grid: ``FEW_TOKENS_VEC`` without the cast (8
    values a thread took 2.27 us of GPU time at 128 x 2048, 2 took 1.95), and with it as many as
    put a scale group on one warp, the amax then a warp's shuffles (4 for groups of 128: 2.21
    against 8's 2.43 us; 2, two warps a group, 2.24). Where a scale group is exactly a warp's
    vectors in a one-row tile, its amax is one ``redux.sync`` over the lanes' amax
    (:func:`kernels.tiles.warp_amax`) instead of five shuffles: 2.14 against 2.19-2.21 us;
    such a tile then takes up to ``FEW_TOKENS_CAST_THREADS`` threads (one CTA of 512 a 2048-wide
    row: 2.11 against 1024 columns' 2.16-2.18 us, paired rounds).

    ``limited``: CTAs past ``rows_1[0]`` return at once (see :func:`swiglu`); otherwise ``rows_1``
    is never read, so a call without a row limit passes an uninitialized tensor instead of making
    one with ``torch.full`` (a fill launch per call: ~2 us of the ~64 at 16384 x 2048 on an H100).

    ``tile`` and ``vec`` override the tile and the elements a thread loads as one vector (for
    tuning sweeps).

    ``weighted``: the float32 result is multiplied by ``weights_T[t]``, else ``weights_T`` is never
    read. ``clamp``: the limit the gate (from above) and up (both sides) are clamped to first
    (:func:`kernels.quant.reference.swiglu`); a compile-time constant, a model's."""
    num_tokens = T.dynamic("num_tokens")
    few_values = one_row and tile is None and vec is None
    vec = vec or vector_width(inter, T.dtype(dtype).bytes)
    tile_m, tile_n, threads = tile or blockwise_tile(inter, (1, group), vec)
    if one_row and tile_n // vec >= 32:
        tile_m, threads = 1, min(threads, tile_n // vec)
        few = max(FEW_TOKENS_VEC, group // 32) if cast else FEW_TOKENS_VEC
        if few_values and vec > few:
            vec = few
            if cast and few * 32 == group:  # a group a warp: wider rows a CTA (see the doc)
                row_groups = 1 << math.ceil(math.log2(-(-inter // group)))  # the row's groups, to a power of two
                tile_n = max(tile_n, min(FEW_TOKENS_CAST_THREADS * few, group * row_groups))
            threads = tile_n // few
    tile_g = tile_n // group
    warp_groups = cast and tile_m == 1 and vec * 32 == group  # lane l of a warp holds vector l of a group
    layout = vector_layout(tile_m, tile_n, threads, vec)
    sf_dtype = "uint8" if pack_sf else "float32"
    out_dtype = "float8_e4m3fn" if cast else dtype

    @T.macro
    def load_swiglu(x_TI2, weights_T, pm, pn, y_frag, gate_frag, up_frag):
        T.copy(x_TI2[pm * tile_m, pn * tile_n], gate_frag, disable_tma=True)
        T.copy(x_TI2[pm * tile_m, inter + pn * tile_n], up_frag, disable_tma=True)
        for i, j in T.Parallel(tile_m, tile_n):
            # one expression (no local bound in between), as the kernel without options had it
            if weighted:
                y_frag[i, j] = T.ieee_mul(
                    T.ieee_mul(silu(clamp_gate(gate_frag[i, j], clamp)), clamp_up(up_frag[i, j], clamp)),
                    row_weight(weights_T, pm * tile_m + i),
                )
            else:
                y_frag[i, j] = T.ieee_mul(silu(clamp_gate(gate_frag[i, j], clamp)), clamp_up(up_frag[i, j], clamp))

    @T.prim_func
    def swiglu_forward(
        x_TI2: T.Tensor[(num_tokens, 2 * inter), dtype],
        out_TI: T.Tensor[(num_tokens, inter), out_dtype],
        sf_TG: T.Tensor[(num_tokens, T.ceildiv(inter, group)), sf_dtype],
        rows_1: T.Tensor[(1,), T.int32],
        weights_T: T.Tensor[(num_tokens,), T.float32],
    ):
        tiles_n = T.ceildiv(inter, tile_n)
        with T.Kernel(T.ceildiv(num_tokens, tile_m) * tiles_n, threads=threads) as pid:
            pm, pn = row_major(pid, tiles_n)
            y_frag = T.alloc_fragment((tile_m, tile_n), "float32")
            gate_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            up_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            amax = T.alloc_fragment((tile_m, tile_g), "float32")
            inv_frag = T.alloc_fragment((tile_m, tile_g), "float32")
            # |y| by fabs (a modifier of the max that reduces it), not reduce_absmax's max(y, 0 - y)
            abs_frag = T.alloc_fragment((tile_m, tile_n), "float32")
            T.annotate_layout({gate_frag: layout, up_frag: layout, y_frag: layout, abs_frag: layout})
            if not limited or pm * tile_m < rows_1[0]:  # rows past rows_1[0] (a layout's capacity) are not wanted
                load_swiglu(x_TI2, weights_T, pm, pn, y_frag, gate_frag, up_frag)
                if warp_groups:  # each lane's amax, then the warp's (its group's) by one redux.sync
                    lane_amax = T.alloc_fragment((tile_m, tile_n // vec), "float32")
                    inv_v = T.alloc_fragment((tile_m, tile_n // vec), "float32")
                    abs_of(y_frag, abs_frag)
                    T.reduce_max(T.reshape(abs_frag, [tile_m, tile_n // vec, vec]), lane_amax, dim=2)
                    for i, v in T.Parallel(tile_m, tile_n // vec):
                        sf, inv = scale_and_inverse(warp_amax(lane_amax[i, v]), round_sf, pack_sf)
                        if v % 32 == 0:
                            sf_TG[pm * tile_m + i, pn * tile_g + v // 32] = sf
                        inv_v[i, v] = inv
                    for i, j in T.Parallel(tile_m, tile_n):
                        out_TI[pm * tile_m + i, pn * tile_n + j] = to_e4m3(y_frag[i, j] * inv_v[i, j // vec])
                elif cast:
                    abs_of(y_frag, abs_frag)
                    T.reduce_max(T.reshape(abs_frag, [tile_m, tile_g, group]), amax, dim=2)
                    for i, g in T.Parallel(tile_m, tile_g):
                        sf, inv = scale_and_inverse(amax[i, g], round_sf, pack_sf)
                        sf_TG[pm * tile_m + i, pn * tile_g + g] = sf
                        inv_frag[i, g] = inv
                    for i, j in T.Parallel(tile_m, tile_n):
                        out_TI[pm * tile_m + i, pn * tile_n + j] = to_e4m3(y_frag[i, j] * inv_frag[i, j // group])
                else:
                    for i, j in T.Parallel(tile_m, tile_n):
                        out_TI[pm * tile_m + i, pn * tile_n + j] = T.cast(y_frag[i, j], out_dtype)

    return swiglu_forward


def backward_tile(inter: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """``(vec, tile_m, tile_n, threads)`` of the backward kernel for ``I = inter``."""
    vec = vector_width(inter, elem_bytes)
    return (vec, *blockwise_tile(inter, (1, 128), vec))


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_swiglu_backward_kernel(inter: int, dtype: str, grad_dtype: str, limited: bool = True,
                               weighted: bool = False, clamp: float | None = None):
    """``(x_T2I, grad_TI, grad_T2I, rows_1, weights_T, grad_w_TN)`` kernel: ``[d gate | d up]`` of
    ``silu(gate) * up``.

    ``x_T2I`` and ``grad_T2I`` are ``[T, 2 * I]`` rows viewed as ``[T, 2, I]``, so a tile's column
    bound is ``I`` in both halves: a tile reaching past ``I`` is cut there by the copies' bounds
    guards, instead of spilling into the ``up`` half (at I = 300 or 7232, say). The results go
    to fragments in the loads' layout and leave as 16-byte vector stores. ``limited`` as in
    :func:`get_swiglu_forward_kernel`.

    ``weighted``: the gradient is scaled by ``weights_T[t]``, and each CTA writes its columns' share
    of the weight's gradient, ``sum(grad * silu(gate) * up)``, to ``grad_w_TN[t, pn]`` (N: the column
    tiles), which the wrapper sums (no atomics: the sum's order is fixed). ``clamp`` as in
    :func:`get_swiglu_forward_kernel`; a clamped input's gradient is zero."""
    num_tokens = T.dynamic("num_tokens")
    vec, tile_m, tile_n, threads = backward_tile(inter, T.dtype(dtype).bytes)
    layout = vector_layout(tile_m, tile_n, threads, vec)

    @T.prim_func
    def swiglu_backward(
        x_T2I: T.Tensor[(num_tokens, 2, inter), dtype],
        grad_TI: T.Tensor[(num_tokens, inter), grad_dtype],
        grad_T2I: T.Tensor[(num_tokens, 2, inter), dtype],
        rows_1: T.Tensor[(1,), T.int32],
        weights_T: T.Tensor[(num_tokens,), T.float32],
        grad_w_TN: T.Tensor[(num_tokens, T.ceildiv(inter, tile_n)), T.float32],
    ):
        tiles_n = T.ceildiv(inter, tile_n)
        with T.Kernel(T.ceildiv(num_tokens, tile_m) * tiles_n, threads=threads) as pid:
            pm, pn = row_major(pid, tiles_n)
            gate_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            up_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            grad_frag = T.alloc_fragment((tile_m, tile_n), grad_dtype)
            d_gate_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            d_up_frag = T.alloc_fragment((tile_m, tile_n), dtype)
            act_frag = T.alloc_fragment((tile_m, tile_n), "float32")
            act_sum = T.alloc_fragment((tile_m,), "float32")
            T.annotate_layout({gate_frag: layout, up_frag: layout, grad_frag: layout, d_gate_frag: layout,
                               d_up_frag: layout, act_frag: layout})
            if not limited or pm * tile_m < rows_1[0]:  # rows past rows_1[0] (a layout's capacity) are not wanted
                T.copy(x_T2I[pm * tile_m : (pm + 1) * tile_m, 0, pn * tile_n : (pn + 1) * tile_n], gate_frag, disable_tma=True)
                T.copy(x_T2I[pm * tile_m : (pm + 1) * tile_m, 1, pn * tile_n : (pn + 1) * tile_n], up_frag, disable_tma=True)
                T.copy(grad_TI[pm * tile_m, pn * tile_n], grad_frag, disable_tma=True)
                for i, j in T.Parallel(tile_m, tile_n):
                    gate_in = T.cast(gate_frag[i, j], "float32")
                    up_in = T.cast(up_frag[i, j], "float32")
                    gate, up = clamp_gate(gate_in, clamp), clamp_up(up_in, clamp)
                    grad = T.cast(grad_frag[i, j], "float32")
                    scaled = T.ieee_mul(grad, row_weight(weights_T, pm * tile_m + i)) if weighted else grad
                    sig = T.ieee_fdiv(T.float32(1), T.ieee_add(T.float32(1), T.exp(-gate)))
                    # (scaled * up) * (sig * (1 + gate * (1 - sig))), each operation rounded
                    d_silu = T.ieee_mul(sig, T.ieee_add(T.float32(1), T.ieee_mul(gate, T.ieee_sub(T.float32(1), sig))))
                    d_gate = T.ieee_mul(T.ieee_mul(scaled, up), d_silu)
                    d_up = T.ieee_mul(scaled, T.ieee_mul(gate, sig))
                    if clamp is not None:  # no gradient flows through a clamped input
                        d_gate = T.if_then_else(gate_in > T.float32(clamp), T.float32(0), d_gate)
                        d_up = T.if_then_else(T.abs(up_in) > T.float32(clamp), T.float32(0), d_up)
                    d_gate_frag[i, j] = T.cast(d_gate, dtype)
                    d_up_frag[i, j] = T.cast(d_up, dtype)
                    if weighted:  # columns past I (a ragged tile) hold no data
                        act_frag[i, j] = T.if_then_else(
                            pn * tile_n + j < inter, T.ieee_mul(grad, T.ieee_mul(silu(gate), up)), T.float32(0)
                        )
                T.copy(d_gate_frag, grad_T2I[pm * tile_m : (pm + 1) * tile_m, 0, pn * tile_n : (pn + 1) * tile_n], disable_tma=True)
                T.copy(d_up_frag, grad_T2I[pm * tile_m : (pm + 1) * tile_m, 1, pn * tile_n : (pn + 1) * tile_n], disable_tma=True)
                if weighted:
                    T.reduce_sum(act_frag, act_sum, dim=1)
                    for i in T.Parallel(tile_m):
                        grad_w_TN[pm * tile_m + i, pn] = act_sum[i]

    return swiglu_backward


def _check_x(x_TI2: torch.Tensor) -> int:
    """Validates ``x_TI2`` and returns I."""
    check_tensor("x_TI2", x_TI2, dtype=FLOAT_DTYPES, ndim=2)
    check_cuda("x_TI2", x_TI2)
    if x_TI2.shape[1] % 2:
        raise ValueError(f"x_TI2: expected an even last dim ([gate | up]), got shape {tuple(x_TI2.shape)}")
    return x_TI2.shape[1] // 2


def _rows_arg(rows: torch.Tensor | None, x_TI2: torch.Tensor) -> torch.Tensor:
    """``rows``, checked, or (no limit: the kernel never reads it) an uninitialized stand-in."""
    check_rows(rows, x_TI2)
    return rows if rows is not None else torch.empty((1,), dtype=torch.int32, device=x_TI2.device)


def _weights_arg(weights_T: torch.Tensor | None, x_TI2: torch.Tensor) -> torch.Tensor:
    """``weights_T``, checked, or (unweighted: the kernel never reads it) an uninitialized stand-in."""
    if weights_T is not None:
        return check_weights(weights_T, x_TI2).contiguous()
    return torch.empty((x_TI2.shape[0],), dtype=torch.float32, device=x_TI2.device)


def swiglu(
    x_TI2: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """TileLang :func:`kernels.quant.reference.swiglu`: ``y_TI`` ``[T, I]`` in ``x_TI2.dtype``
    (``x_TI2`` on a CUDA device; copied first if not contiguous); CTAs past ``rows[0]`` return
    at once."""
    inter = _check_x(x_TI2)
    limited, rows = rows is not None, _rows_arg(rows, x_TI2)
    weighted, weights_T = weights_T is not None, _weights_arg(weights_T, x_TI2)
    clamp = check_clamp(clamp)
    t = x_TI2.shape[0]
    y_TI = torch.empty((t, inter), dtype=x_TI2.dtype, device=x_TI2.device)
    if t == 0 or inter == 0:
        return y_TI
    kernel = get_swiglu_forward_kernel(inter, tl_dtype(x_TI2.dtype), 128, False, False, False, t <= FEW_TOKENS, limited,
                                       weighted=weighted, clamp=clamp)
    scales_unused = torch.empty((t, -(-inter // 128)), device=x_TI2.device)
    kernel(x_TI2.contiguous(), y_TI, scales_unused, rows, weights_T)
    return y_TI


def swiglu_per_token_cast(
    x_TI2: torch.Tensor,
    *,
    group: int = 128,
    round_sf: bool = False,
    pack_sf: bool = False,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TileLang :func:`kernels.quant.reference.swiglu_per_token_cast`: ``q_TI`` ``[T, I]``
    float8_e4m3fn and ``sf_TG`` ``[T, ceil(I / group)]`` float32 (uint8 when ``pack_sf``); ``group``
    a power of two up to 1024."""
    check_positive("group", group)
    inter = _check_x(x_TI2)
    if not supports_block((1, group)):
        raise ValueError(f"group: expected a power of two from 2 to 1024, got {group}")
    if pack_sf and not round_sf:
        raise ValueError("pack_sf: expected round_sf=True (only power-of-two scales pack), got round_sf=False")
    weighted, weights_T = weights_T is not None, _weights_arg(weights_T, x_TI2)
    clamp = check_clamp(clamp)
    t = x_TI2.shape[0]
    q_TI = torch.empty((t, inter), dtype=E4M3, device=x_TI2.device)
    sf_TG = torch.empty((t, -(-inter // group)), dtype=torch.uint8 if pack_sf else torch.float32, device=x_TI2.device)
    if t == 0 or inter == 0:
        return q_TI, sf_TG
    kernel = get_swiglu_forward_kernel(inter, tl_dtype(x_TI2.dtype), group, True, round_sf, pack_sf, t <= FEW_TOKENS,
                                       False, weighted=weighted, clamp=clamp)
    kernel(x_TI2.contiguous(), q_TI, sf_TG, _rows_arg(None, x_TI2), weights_T)
    return q_TI, sf_TG


def swiglu_backward(
    x_TI2: torch.Tensor,
    grad_TI: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """TileLang :func:`kernels.quant.reference.swiglu_backward`: ``grad_TI2`` ``[T, 2 * I]`` in
    ``x_TI2.dtype`` (with ``weights_T``, also float32 ``grad_weights_T`` ``[T]``); CTAs past
    ``rows[0]`` return at once."""
    inter = _check_x(x_TI2)
    limited, rows = rows is not None, _rows_arg(rows, x_TI2)
    weighted, weights = weights_T is not None, _weights_arg(weights_T, x_TI2)
    clamp = check_clamp(clamp)
    t = x_TI2.shape[0]
    check_tensor("grad_TI", grad_TI, dtype=FLOAT_DTYPES, shape=(t, inter), device=x_TI2.device)
    grad_TI2 = torch.empty_like(x_TI2, memory_format=torch.contiguous_format)
    _, _, tile_n, _ = backward_tile(inter, x_TI2.element_size())
    grad_w_TN = torch.empty((t, -(-inter // tile_n)), dtype=torch.float32, device=x_TI2.device)  # unweighted: unused
    if t and inter:
        kernel = get_swiglu_backward_kernel(inter, tl_dtype(x_TI2.dtype), tl_dtype(grad_TI.dtype), limited,
                                            weighted, clamp)
        kernel(x_TI2.contiguous().view(t, 2, inter), grad_TI.contiguous(), grad_TI2.view(t, 2, inter), rows, weights,
               grad_w_TN)
    if not weighted:
        return grad_TI2
    return grad_TI2, grad_w_TN.sum(dim=1)
