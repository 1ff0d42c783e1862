"""TileLang kernel of :func:`kernels.mhc.reference.pre_apply`: ``y_TD = sum_i pre_TN[:, i] * x_TND[:, i, :]``.

Memory-bound: every byte of ``x`` is read once and ``y`` written once. A CTA of ``THREADS`` threads
covers ``tile_m`` tokens x ``tile_v`` vectors of ``vec`` elements (16 bytes of ``x``'s dtype, fewer
when ``D`` is not a multiple of that); each thread loads its vector of all ``N`` streams, accumulates
in float32 and stores one vector of ``y``. Two choices, measured on an H100 against tile-kernels
(paired rounds by GPU time, ``docs/design/mhc.md``), at T = 8192, N = 4 bfloat16:

- the loads and the output pass through shared memory, each thread's own slots (no thread reads
  another's), and the output is stored streaming (``st.global.cs``, evict-first): 185.65 against
  tile-kernels' 185.76 us at D = 7168, where the same kernel in registers took 186.0 and either
  change alone 185.8-185.9 (tile-kernels' own kernel stages through shared memory too);
- where a stream's row is a power of two of bytes (D = 4096 bf16: the N loads of a thread and the
  rows of neighbouring tokens fall in the same L1 sets), ``x`` is loaded past L1
  (``ld.global.nc.L1::no_allocate``): 103.1 against 105.1 us at D = 4096; at 5120-7168 the same
  loads were 0.1-1.2% slower, so they keep L1.

The float32 math is separate IEEE multiplies and adds (``T.ieee_mul``/``T.ieee_add``, so nvcc cannot
contract them into FMAs), summed over the streams in order ``i = 0 .. N-1``, as the reference's
``(pre[:, :, None] * x).sum(1)`` evaluates it.

Shape suffixes (as in :mod:`kernels.mhc.reference`): T tokens, N streams, D hidden size of a stream.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.cache_hints import hinted_load, hinted_store
from kernels.mhc.reference import _check_param, _check_stream
from kernels.tiles import (
    PASS_CONFIGS,
    aligned,
    check_cuda,
    row_major,
    tl_dtype,
    vector_width,
)
from kernels.rows import WARP, row_geometry, row_reduction
from kernels.validate import check_tensor

THREADS = 128  # one vector of the output per thread
LOAD_PAST_L1 = ".nc.L1::no_allocate"  # x's loads where a stream's row is a power of two of bytes
STREAMING_STORE = ".cs"
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # streams; float64 stays with the reference


def row_tile(nv: int, threads: int = THREADS) -> tuple[int, int]:
    """``(tile_m, tile_v)``: a CTA tile of ``tile_m`` tokens x ``tile_v`` vectors for rows of ``nv``
    vectors; ``tile_v`` a power of two up to ``threads`` (a static divisor; few values, few compiles)
    and ``tile_m * tile_v = threads``, so short rows (D = 64) still fill the CTA."""
    tile_v = min(threads, 1 << max(0, nv - 1).bit_length())
    return threads // tile_v, tile_v


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_pre_apply_kernel(n: int, d: int, dtype: str, threads: int = THREADS, hints: tuple[str, str] | None = None):
    """``(x_TND, pre_TN, y_TD)`` kernel for ``N = n`` streams of ``D = d`` elements of ``dtype``
    (``pre_TN`` float32; the token count is dynamic), ``threads`` per CTA; ``hints``: PTX qualifiers
    of the 16-byte loads of ``x`` and stores of ``y`` (for sweeps; default: ``LOAD_PAST_L1`` where a
    stream's row is a power of two of bytes, none otherwise, and ``STREAMING_STORE``, see the module
    doc); plain moves where ``D`` gives vectors narrower than 16 bytes."""
    num_tokens = T.dynamic("num_tokens")
    vec = vector_width(d, T.dtype(dtype).bytes)
    nv = d // vec
    row_bytes = d * T.dtype(dtype).bytes
    whole_vectors = vec * T.dtype(dtype).bytes == 16
    if hints is None and whole_vectors:
        hints = (LOAD_PAST_L1 if row_bytes & (row_bytes - 1) == 0 else "", STREAMING_STORE)
    if hints is not None and not whole_vectors:
        raise ValueError(f"hints: the qualified moves are 16-byte vectors; D = {d} of {dtype} gives {vec} elements")
    load_hint, store_hint = hints or ("", "")
    load_hinted, store_hinted = load_hint != "", store_hint != ""
    load_name, load_source = hinted_load(16, load_hint)
    store_name, store_source = hinted_store(16, store_hint)
    moves_source = (load_source if load_hinted else "") + (store_source if store_hinted else "")
    tile_m, tile_v = row_tile(nv, threads)
    tiles_v = T.ceildiv(nv, tile_v)

    @T.prim_func
    def pre_apply_kernel(
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        pre_TN: T.Tensor[(num_tokens, n), T.float32],
        y_TD: T.Tensor[(num_tokens, d), dtype],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tile_m) * tiles_v, threads=threads) as pid:
            if load_hinted or store_hinted:
                T.import_source(moves_source)
            bm, bn = row_major(pid, tiles_v)
            tid = T.get_thread_binding()
            x_shared = T.alloc_shared((n, threads * vec), dtype)  # a thread's own slots only
            y_shared = T.alloc_shared((threads * vec,), dtype)
            x_local = T.alloc_local((n * vec,), dtype)
            acc = T.alloc_local((vec,), T.float32)
            y_local = T.alloc_local((vec,), dtype)
            token = bm * tile_m + tid // tile_v
            c = bn * tile_v + tid % tile_v
            row = T.Cast(T.int64, token)
            if token < num_tokens and c < nv:
                for i in T.unroll(n):
                    if load_hinted:
                        T.call_extern("handle", load_name, T.address_of(x_shared[i, tid * vec]),
                                      T.address_of(x_TND[row, i, c * vec]))
                    else:
                        for j in T.vectorized(vec):
                            x_shared[i, tid * vec + j] = x_TND[row, i, c * vec + j]
                for i in T.unroll(n):
                    for j in T.vectorized(vec):
                        x_local[i * vec + j] = x_shared[i, tid * vec + j]
                for j in T.serial(vec):
                    acc[j] = T.ieee_mul(pre_TN[row, 0], T.cast(x_local[j], T.float32))
                for i in T.unroll(1, n):
                    for j in T.serial(vec):
                        acc[j] = T.ieee_add(acc[j], T.ieee_mul(pre_TN[row, i], T.cast(x_local[i * vec + j], T.float32)))
                for j in T.vectorized(vec):
                    y_local[j] = T.cast(acc[j], dtype)
                for j in T.vectorized(vec):
                    y_shared[tid * vec + j] = y_local[j]
            T.sync_threads()
            if token < num_tokens and c < nv:
                for j in T.vectorized(vec):
                    y_local[j] = y_shared[tid * vec + j]
                if store_hinted:
                    T.call_extern("handle", store_name, T.address_of(y_TD[row, c * vec]), T.address_of(y_local[0]))
                else:
                    for j in T.vectorized(vec):
                        y_TD[row, c * vec + j] = y_local[j]

    return pre_apply_kernel


def supports(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> bool:
    """True when the kernels take these inputs (up to ``WARP`` streams, bfloat16/float16/float32;
    ``pre`` float32); float64 stays with the reference."""
    return x_TND.dim() == 3 and x_TND.dtype in KERNEL_DTYPES and pre_TN.dtype == torch.float32 and x_TND.shape[1] <= WARP


def pre_apply(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
    """TileLang :func:`kernels.mhc.reference.pre_apply`, the forward (no autograd here: ``kernels.mhc.pre_apply``
    pairs it with :func:`pre_apply_backward`).

    Args:
        x_TND: ``[T, N, D]`` bfloat16/float16/float32 streams on a CUDA device (copied first if not
            contiguous or not 16-byte aligned).
        pre_TN: ``[T, N]`` float32 weights.

    Returns:
        ``y_TD`` ``[T, D]`` in ``x_TND``'s dtype, accumulated in float32.
    """
    _check_stream("x_TND", x_TND, values=False)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    _check_param("pre_TN", pre_TN, (t, n), x_TND.device, values=False)
    if not supports(x_TND, pre_TN):
        raise TypeError(
            f"x_TND/pre_TN: the kernel takes bfloat16/float16/float32 streams and float32 weights, got "
            f"{x_TND.dtype} and {pre_TN.dtype} (use kernels.mhc.reference.pre_apply)"
        )
    y_TD = torch.empty((t, d), dtype=x_TND.dtype, device=x_TND.device)
    if t == 0 or d == 0:
        return y_TD
    kernel = get_pre_apply_kernel(n, d, tl_dtype(x_TND.dtype))
    kernel(aligned(x_TND), pre_TN.contiguous(), y_TD)
    return y_TD


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_pre_apply_backward_kernel(n: int, d: int, dtype: str, g_dtype: str):
    """``(x_TND, pre_TN, g_TD, grad_x_TND, grad_pre_TN)`` kernel: the gradients of ``y = sum_i pre_i
    x_i`` given ``g = dL/dy``: ``grad_x_i = pre_i * g`` (one float32 multiply, rounded to ``x``'s
    dtype: the reference's bits) and ``grad_pre_i = sum_d g * x_i`` (float32, summed in this
    kernel's order: each thread over its vectors, warp shuffles, then the warps in order).

    One CTA per token (as the Engram gate kernel): each thread loads its vectors of ``g`` and of
    every stream, stores ``grad_x`` and keeps N partial dot products; the CTA reduces them."""
    num_tokens = T.dynamic("num_tokens")
    vec, nv, threads, per_thread, warps = row_geometry(d, dtype)
    reduce = row_reduction(n, warps)

    @T.prim_func
    def pre_apply_backward_kernel(
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        pre_TN: T.Tensor[(num_tokens, n), T.float32],
        g_TD: T.Tensor[(num_tokens, d), g_dtype],
        grad_x_TND: T.Tensor[(num_tokens, n, d), dtype],
        grad_pre_TN: T.Tensor[(num_tokens, n), T.float32],
    ):
        with T.Kernel(num_tokens, threads=threads) as bt:
            tid = T.get_thread_binding()
            g_local = T.alloc_local((vec,), g_dtype)
            x_local = T.alloc_local((vec,), dtype)
            out_local = T.alloc_local((vec,), dtype)
            dots = T.alloc_local((n,), T.float32)
            partial_NW = T.alloc_shared((n, warps), T.float32)
            totals = T.alloc_local((n,), T.float32)
            row = T.Cast(T.int64, bt)
            for i in T.serial(n):
                dots[i] = T.float32(0)
            for p in T.unroll(per_thread):
                c = p * threads + tid
                if c < nv:
                    for j in T.vectorized(vec):
                        g_local[j] = g_TD[row, c * vec + j]
                    for i in T.unroll(n):
                        for j in T.vectorized(vec):
                            x_local[j] = x_TND[row, i, c * vec + j]
                        for j in T.serial(vec):
                            gf = T.cast(g_local[j], T.float32)
                            out_local[j] = T.cast(T.ieee_mul(pre_TN[row, i], gf), dtype)
                            dots[i] = T.ieee_add(dots[i], T.ieee_mul(T.cast(x_local[j], T.float32), gf))
                        for j in T.vectorized(vec):
                            grad_x_TND[row, i, c * vec + j] = out_local[j]
            reduce(dots, partial_NW, totals, tid)
            if tid == 0:
                for i in T.unroll(n):
                    grad_pre_TN[row, i] = totals[i]

    return pre_apply_backward_kernel


def pre_apply_backward(x_TND: torch.Tensor, pre_TN: torch.Tensor, g_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TileLang backward of :func:`kernels.mhc.reference.pre_apply`: ``(grad_x_TND, grad_pre_TN)``
    for ``g_TD = dL/dy`` (``[T, D]``, bfloat16/float16/float32), in ``x_TND``'s and float32. Same
    inputs as :func:`pre_apply`."""
    _check_stream("x_TND", x_TND, values=False)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    _check_param("pre_TN", pre_TN, (t, n), x_TND.device, values=False)
    check_tensor("g_TD", g_TD, dtype=KERNEL_DTYPES, shape=(t, d), device=x_TND.device)
    if not supports(x_TND, pre_TN):
        raise TypeError(f"x_TND/pre_TN: the kernel takes up to {WARP} bfloat16/float16/float32 streams and float32 "
                        f"weights, got {n} of {x_TND.dtype} and {pre_TN.dtype} (use kernels.mhc.reference.pre_apply)")
    grad_x_TND = torch.empty((t, n, d), dtype=x_TND.dtype, device=x_TND.device)
    grad_pre_TN = torch.empty((t, n), dtype=torch.float32, device=x_TND.device)  # the kernel writes every row
    if t == 0 or d == 0:
        return grad_x_TND, grad_pre_TN.zero_()
    kernel = get_pre_apply_backward_kernel(n, d, tl_dtype(x_TND.dtype), tl_dtype(g_TD.dtype))
    kernel(aligned(x_TND), pre_TN.contiguous(), aligned(g_TD), grad_x_TND, grad_pre_TN)
    return grad_x_TND, grad_pre_TN
