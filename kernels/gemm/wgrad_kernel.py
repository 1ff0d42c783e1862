"""The k-grouped FP8 GEMM behind ``grouped_fp8_mm_wgrad`` (see :mod:`kernels.gemm.reference`).

A CTA computes one ``128 x block_n`` tile of one expert's ``out_EMN[e]``, reducing over that
expert's row segment in 128-row chunks (segments are multiples of 128 rows, and each chunk is one
per-channel scale block of both operands). The operands arrive K-major, the rows contiguous
(``a_MR`` and ``b_NR``: transposed copies of the per-channel casts' bytes), as Hopper's FP8 wgmma
takes both operands. Each chunk's wgmma sums into a fresh float32 fragment that the CUDA cores
scale by the outer product of the chunk's two scale rows (``sa_CM[c, m]`` and ``sb_CN[c, n]``,
each staged by TMA as one contiguous run) and add into the running float32 accumulator. An expert
with no rows writes zeros.

Shape suffixes: R rows of the layout (the reduction; at least ``offsets_E[-1]``), M and N the
output's rows and columns, C = ceil(R / 128) row chunks of the scales, E experts.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.gemm.grouped_mm_kernel import BLOCK_M, GEMM_PASS_CONFIGS, check_stages
from kernels.gemm.reference import E4M3, SCALE_BLOCK, WGRAD_DTYPES
from kernels.tiles import check_cuda, tl_dtype
from kernels.validate import check_dtype, check_tensor


@tilelang.jit(pass_configs=GEMM_PASS_CONFIGS)
def get_grouped_fp8_mm_wgrad_kernel(m: int, n: int, num_experts: int, out_dtype: str = "float32", block_n: int = 128,
                                    stages: int = 4, threads: int = 256):
    """``(a_MR, sa_CM, b_NR, sb_CN, offsets_E, out_EMN)`` kernel for an output of ``m x n`` per
    expert in ``out_dtype`` and ``num_experts`` segments ending at ``offsets_E`` (int32, multiples
    of 128)."""
    num_rows = T.dynamic("num_rows")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def grouped_fp8_mm_wgrad(
        a_MR: T.Tensor[(m, num_rows), T.float8_e4m3fn],
        sa_CM: T.Tensor[(num_chunks, m), T.float32],
        b_NR: T.Tensor[(n, num_rows), T.float8_e4m3fn],
        sb_CN: T.Tensor[(num_chunks, n), T.float32],
        offsets_E: T.Tensor[(num_experts,), T.int32],
        out_EMN: T.Tensor[(num_experts, m, n), out_dtype],
    ):
        with T.Kernel(T.ceildiv(n, block_n), T.ceildiv(m, BLOCK_M), num_experts, threads=threads) as (bn, bm, e):
            a_S = T.alloc_shared((BLOCK_M, SCALE_BLOCK), T.float8_e4m3fn)
            b_S = T.alloc_shared((block_n, SCALE_BLOCK), T.float8_e4m3fn)
            sa_S = T.alloc_shared((BLOCK_M,), T.float32)
            sb_S = T.alloc_shared((block_n,), T.float32)
            out_S = T.alloc_shared((BLOCK_M, block_n), out_dtype)
            chunk = T.alloc_fragment((BLOCK_M, block_n), T.float32)
            acc = T.alloc_fragment((BLOCK_M, block_n), T.float32)
            m0, n0 = bm * BLOCK_M, bn * block_n
            first = T.if_then_else(e > 0, offsets_E[e - 1], 0) // SCALE_BLOCK
            T.clear(acc)
            for c in T.Pipelined(offsets_E[e] // SCALE_BLOCK - first, num_stages=stages):
                T.copy(a_MR[m0, (first + c) * SCALE_BLOCK], a_S)
                T.copy(b_NR[n0, (first + c) * SCALE_BLOCK], b_S)
                T.copy(sa_CM[first + c, m0], sa_S)
                T.copy(sb_CN[first + c, n0], sb_S)
                T.gemm(a_S, b_S, chunk, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(BLOCK_M, block_n):
                    acc[i, j] += chunk[i, j] * (sa_S[i] * sb_S[j])
            T.copy(acc, out_S)
            T.copy(out_S, out_EMN[e, m0, n0])

    return grouped_fp8_mm_wgrad


ROW_ALIGN = 16  # TMA's global strides are multiples of 16 bytes: a K-major operand's rows per column
# 33 KiB of operands and scales a stage in 227 KiB of shared memory (the output tile reuses the
# operands' buffers once the reduction is done)
MAX_STAGES = 6


def grouped_fp8_mm_wgrad(
    a_MR: torch.Tensor, sa_CM: torch.Tensor, b_NR: torch.Tensor, sb_CN: torch.Tensor, offsets_E: torch.Tensor,
    *, out_dtype: torch.dtype = torch.float32, block_n: int = 128, stages: int = 4,
) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.gemm.reference.grouped_fp8_mm_wgrad`, for M and N
    multiples of 128 and R of 16 (:func:`supports`; :func:`kernels.gemm.k_major` pads R to 128).
    ``offsets_E`` is not read on the host: its ends must be multiples of 128, at most R."""
    m, r = check_tensor("a_MR", a_MR, dtype=E4M3, ndim=2).shape
    check_cuda("a_MR", a_MR)
    n = check_tensor("b_NR", b_NR, dtype=E4M3, shape=(None, r), device=a_MR.device).shape[0]
    if not supports(m, n, r, block_n):
        raise ValueError(f"a_MR, b_NR: expected M and N multiples of 128 (and of block_n {block_n}) and R of "
                         f"{ROW_ALIGN}, got M={m}, N={n}, R={r}")
    chunks = -(-r // SCALE_BLOCK)
    check_tensor("sa_CM", sa_CM, dtype=torch.float32, shape=(chunks, m), device=a_MR.device)
    check_tensor("sb_CN", sb_CN, dtype=torch.float32, shape=(chunks, n), device=a_MR.device)
    check_dtype("out_dtype", out_dtype, WGRAD_DTYPES)
    check_stages(stages, MAX_STAGES)
    e = check_tensor("offsets_E", offsets_E, dtype=torch.int32, ndim=1, device=a_MR.device).shape[0]
    out_EMN = torch.empty((e, m, n), dtype=out_dtype, device=a_MR.device)
    if e == 0:
        return out_EMN
    if r == 0:
        return out_EMN.zero_()
    kernel = get_grouped_fp8_mm_wgrad_kernel(m, n, e, tl_dtype(out_dtype), block_n, stages)
    kernel(a_MR.contiguous(), sa_CM.contiguous(), b_NR.contiguous(), sb_CN.contiguous(), offsets_E, out_EMN)
    return out_EMN


def supports(m: int, n: int, r: int, block_n: int = 128) -> bool:
    """True when the kernel takes an ``m x n`` output over ``r`` layout rows."""
    return (m > 0 and m % BLOCK_M == 0 and n > 0 and n % SCALE_BLOCK == 0 and SCALE_BLOCK % block_n == 0
            and r % ROW_ALIGN == 0)
