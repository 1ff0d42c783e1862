"""TileLang kernel of :func:`kernels.engram.reference.gate` (forward): per token ``t`` and mHC stream
``h``, ``dot = sum_d x * wh * we * k * rstd(x) * rstd(k) / sqrt(D)``,
``gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))``, ``out = x + gate * v`` (or ``gate * v``).

Memory-bound: one CTA per (token, stream) row. Each thread loads its vectors of ``x`` (kept in
registers), ``k``, ``wh`` and ``we`` (``vec`` elements, 16 bytes of ``x``'s dtype or fewer when
``D`` is not a multiple of that), accumulates ``sum x^2``, ``sum k^2`` and ``sum x*w*k`` in float32,
the CTA reduces them (warp shuffles, then one value per warp through shared memory, summed in warp
order by every thread), and the threads write ``x + gate * v`` from their registers and a load of
``v``. ``v`` is read once per stream (N times per token; the stream CTAs of a token run together,
so the repeats are meant to hit L2).

The float32 math mirrors the reference's operations (``(x * (wh * we)) * k``; ``sqrt`` and the
divisions IEEE, no FMA contraction) but sums over ``D`` in another order than PyTorch's reduction,
so results match within the tolerance the GPU tests state, not bit for bit.

Shape suffixes (as in :mod:`kernels.engram.reference`): T tokens, N mHC streams, D hidden size.
"""

import math

import tilelang
import torch
from tilelang import language as T

from kernels.engram.reference import check_gate_args
from kernels.quant.tiles import (
    PASS_CONFIGS,
    VECTOR_BYTES,
    check_cuda,
    tl_dtype,
    vector_width,
)

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float64 stays with the reference
WARP = 32


def gate_threads(nv: int) -> int:
    """Threads of a row's CTA: one per vector, a power of two from one warp to 128."""
    return min(128, max(WARP, 1 << max(0, nv - 1).bit_length()))


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_gate_kernel(
    n: int, d: int, dtype: str, k_dtype: str, v_dtype: str, w_dtype: str, clamp: float, eps: float, add_residual: bool
):
    """``(x_TND, k_TND, v_TD, wh_ND, we_ND, out_TND)`` kernel for ``N = n`` streams of ``D = d``
    elements (``x``/``out`` of ``dtype``, ``k``, ``v`` and both weights of their own dtypes; the
    token count is dynamic)."""
    num_tokens = T.dynamic("num_tokens")
    vec = vector_width(d, T.dtype(dtype).bytes)
    nv = d // vec
    threads = gate_threads(nv)
    per_thread = -(-nv // threads)
    warps = threads // WARP
    sqrt_d = math.sqrt(d)

    @T.prim_func
    def gate_kernel(
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
        v_TD: T.Tensor[(num_tokens, d), v_dtype],
        wh_ND: T.Tensor[(n, d), w_dtype],
        we_ND: T.Tensor[(n, d), w_dtype],
        out_TND: T.Tensor[(num_tokens, n, d), dtype],
    ):
        with T.Kernel(num_tokens, n, threads=threads) as (bt, h):
            tid = T.get_thread_binding()
            x_local = T.alloc_local((per_thread * vec,), dtype)
            k_local = T.alloc_local((vec,), k_dtype)
            wh_local = T.alloc_local((vec,), w_dtype)
            we_local = T.alloc_local((vec,), w_dtype)
            v_local = T.alloc_local((vec,), v_dtype)
            out_local = T.alloc_local((vec,), dtype)
            sums = T.alloc_local((3,), T.float32)  # sum x^2, sum k^2, sum x*w*k
            partial_3W = T.alloc_shared((3, warps), T.float32)
            stats = T.alloc_local((3,), T.float32)
            gate = T.alloc_local((1,), T.float32)
            row = T.Cast(T.int64, bt)
            for s in T.serial(3):
                sums[s] = T.float32(0)
            for p in T.unroll(per_thread):
                c = p * threads + tid
                if c < nv:
                    for j in T.vectorized(vec):
                        x_local[p * vec + j] = x_TND[row, h, c * vec + j]
                    for j in T.vectorized(vec):
                        k_local[j] = k_TND[row, h, c * vec + j]
                    for j in T.vectorized(vec):
                        wh_local[j] = wh_ND[h, c * vec + j]
                    for j in T.vectorized(vec):
                        we_local[j] = we_ND[h, c * vec + j]
                    for j in T.serial(vec):
                        xf = T.cast(x_local[p * vec + j], T.float32)
                        kf = T.cast(k_local[j], T.float32)
                        w = T.ieee_mul(T.cast(wh_local[j], T.float32), T.cast(we_local[j], T.float32))
                        sums[0] = T.ieee_add(sums[0], T.ieee_mul(xf, xf))
                        sums[1] = T.ieee_add(sums[1], T.ieee_mul(kf, kf))
                        sums[2] = T.ieee_add(sums[2], T.ieee_mul(T.ieee_mul(xf, w), kf))
            for s in T.unroll(3):
                sums[s] = T.warp_reduce_sum(sums[s])
            if tid % WARP == 0:
                for s in T.unroll(3):
                    partial_3W[s, tid // WARP] = sums[s]
            T.sync_threads()
            for s in T.unroll(3):
                stats[s] = partial_3W[s, 0]
                for w in T.unroll(1, warps):
                    stats[s] = T.ieee_add(stats[s], partial_3W[s, w])
            rstd_x = T.ieee_fdiv(T.float32(1), T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(stats[0], T.float32(d)), T.float32(eps))))
            rstd_k = T.ieee_fdiv(T.float32(1), T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(stats[1], T.float32(d)), T.float32(eps))))
            dot = T.ieee_fdiv(T.ieee_mul(T.ieee_mul(stats[2], rstd_x), rstd_k), T.float32(sqrt_d))
            root = T.ieee_fsqrt(T.max(T.abs(dot), T.float32(clamp)))
            z = T.if_then_else(dot > 0, root, T.if_then_else(dot < 0, -root, T.float32(0)))
            gate[0] = T.ieee_fdiv(T.float32(1), T.ieee_add(T.float32(1), T.exp(-z)))
            for p in T.unroll(per_thread):
                c = p * threads + tid
                if c < nv:
                    for j in T.vectorized(vec):
                        v_local[j] = v_TD[row, c * vec + j]
                    for j in T.serial(vec):
                        gv = T.ieee_mul(gate[0], T.cast(v_local[j], T.float32))
                        if add_residual:
                            out_local[j] = T.cast(T.ieee_add(T.cast(x_local[p * vec + j], T.float32), gv), dtype)
                        else:
                            out_local[j] = T.cast(gv, dtype)
                    for j in T.vectorized(vec):
                        out_TND[row, h, c * vec + j] = out_local[j]

    return gate_kernel


def supports(x_TND, k_TND, v_TD, wh_ND, we_ND) -> bool:
    """True when the kernel takes these dtypes: bfloat16/float16/float32 everywhere, ``wh`` and
    ``we`` of one dtype (float64 anywhere stays with the reference)."""
    tensors = (x_TND, k_TND, v_TD, wh_ND, we_ND)
    return all(t.dtype in KERNEL_DTYPES for t in tensors) and wh_ND.dtype == we_ND.dtype


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous and 16-byte aligned (vector accesses need both), else a copy."""
    if t.is_contiguous() and t.data_ptr() % VECTOR_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def gate(
    x_TND: torch.Tensor,
    k_TND: torch.Tensor,
    v_TD: torch.Tensor,
    wh_ND: torch.Tensor,
    we_ND: torch.Tensor,
    *,
    clamp: float = 1e-6,
    eps: float = 1e-6,
    add_residual: bool = True,
) -> torch.Tensor:
    """TileLang :func:`kernels.engram.reference.gate` (forward only; no autograd).

    Args:
        x_TND: ``[T, N, D]`` bfloat16/float16/float32 on a CUDA device.
        k_TND: ``[T, N, D]``; v_TD: ``[T, D]``; wh_ND, we_ND: ``[N, D]`` of one dtype; all
            bfloat16/float16/float32 (copied first if not contiguous or not 16-byte aligned).
        clamp, eps, add_residual: as the reference.

    Returns:
        ``out_TND`` ``[T, N, D]`` in ``x_TND``'s dtype.
    """
    check_gate_args(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps)
    check_cuda("x_TND", x_TND)
    if not supports(x_TND, k_TND, v_TD, wh_ND, we_ND):
        raise TypeError(
            "x_TND/k_TND/v_TD/wh_ND/we_ND: the kernel takes bfloat16/float16/float32 tensors with wh and we "
            f"of one dtype, got {x_TND.dtype}, {k_TND.dtype}, {v_TD.dtype}, {wh_ND.dtype}, {we_ND.dtype} "
            "(use kernels.engram.reference.gate)"
        )
    t, n, d = x_TND.shape
    out_TND = torch.empty((t, n, d), dtype=x_TND.dtype, device=x_TND.device)
    if t * n * d == 0:
        return out_TND
    kernel = get_gate_kernel(
        n, d, *(tl_dtype(a.dtype) for a in (x_TND, k_TND, v_TD, wh_ND)), float(clamp), float(eps), bool(add_residual)
    )
    kernel(_aligned(x_TND), _aligned(k_TND), _aligned(v_TD), _aligned(wh_ND), _aligned(we_ND), out_TND)
    return out_TND
