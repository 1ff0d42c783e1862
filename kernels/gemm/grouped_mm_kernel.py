"""The m-grouped FP8 GEMM behind ``grouped_fp8_mm`` (see :mod:`kernels.gemm.reference` for the
function).

A CTA computes one ``128 x block_n`` tile of ``out_PN``. Its 128 rows lie in one expert's segment
(segments are multiples of 128 rows), and the CTA reads that expert from a table built by torch
ops on the device (:func:`tile_experts`, no host sync); a tile at or past the last end returns at
once, so the rows of a static capacity past ``offsets_E[-1]`` cost nothing and are not written. The reduction
walks ``K`` in 128-column chunks, the scale groups: each chunk's wgmma sums into a fresh float32
fragment (the tensor cores' FP8 accumulation keeps ~14 mantissa bits, so it never runs longer than
one chunk), which the CUDA cores multiply by the row's activation scale and the block's weight
scale and add into the running float32 accumulator (DeepGEMM's promotion). The operands, and the
activation scales of the chunk (MN-major, one contiguous run of 128), reach shared memory by TMA in
a ``stages``-deep pipeline that TileLang's warp specialization runs on a producer warpgroup.

Shape suffixes: P layout rows, K reduction columns, N output columns, E experts, G = K / 128 and
J = ceil(N / 128) scale groups, Q the activation scales' padded row count (a multiple of 4).
"""

import tilelang
import torch
from tilelang import language as T

from kernels.gemm.reference import E4M3, SCALE_BLOCK
from kernels.tiles import check_cuda
from kernels.transpose import sf_to_mn_major
from kernels.validate import check_tensor

BLOCK_M = 128  # a tile's rows: the layout's alignment, so a tile never straddles two experts
# TileLang's defaults (warp specialization on) with fast math off, as every FP8 kernel here.
GEMM_PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}
# 32.5 KiB of operands and scales a stage and a 32 KiB output tile in 227 KiB of shared memory
MAX_STAGES = 5


@tilelang.jit(pass_configs=GEMM_PASS_CONFIGS)
def get_grouped_fp8_mm_kernel(n: int, k: int, num_experts: int, block_n: int = 128, stages: int = 4,
                              threads: int = 256):
    """``(a_PK, sa_GQ, b_ENK, sb_EJG, expert_M, out_PN)`` kernel for ``N = n``, ``K = k`` (a
    multiple of 128) and ``num_experts`` experts; ``expert_M`` is each 128-row tile's expert, -1
    for a tile past the last segment (:func:`tile_experts`); ``block_n`` divides 128.
    ``threads``: the math warpgroups' threads (128 per 64 rows of the tile)."""
    num_rows = T.dynamic("num_rows")
    sf_rows = T.dynamic("sf_rows")
    groups = k // SCALE_BLOCK

    @T.prim_func
    def grouped_fp8_mm(
        a_PK: T.Tensor[(num_rows, k), T.float8_e4m3fn],
        sa_GQ: T.Tensor[(groups, sf_rows), T.float32],
        b_ENK: T.Tensor[(num_experts, n, k), T.float8_e4m3fn],
        sb_EJG: T.Tensor[(num_experts, T.ceildiv(n, SCALE_BLOCK), groups), T.float32],
        expert_M: T.Tensor[(T.ceildiv(num_rows, BLOCK_M),), T.int32],
        out_PN: T.Tensor[(num_rows, n), T.bfloat16],
    ):
        # N tiles on the fastest grid axis: the CTAs running together share an A tile, and an
        # expert's few M tiles read each weight tile from DRAM about once.
        with T.Kernel(T.ceildiv(n, block_n), T.ceildiv(num_rows, BLOCK_M), threads=threads) as (bn, bm):
            a_S = T.alloc_shared((BLOCK_M, SCALE_BLOCK), T.float8_e4m3fn)
            b_S = T.alloc_shared((block_n, SCALE_BLOCK), T.float8_e4m3fn)
            sa_S = T.alloc_shared((BLOCK_M,), T.float32)
            out_S = T.alloc_shared((BLOCK_M, block_n), T.bfloat16)
            chunk = T.alloc_fragment((BLOCK_M, block_n), T.float32)
            acc = T.alloc_fragment((BLOCK_M, block_n), T.float32)
            sb = T.alloc_local((1,), T.float32)
            m0, n0 = bm * BLOCK_M, bn * block_n
            if expert_M[bm] >= 0:
                T.clear(acc)
                for c in T.Pipelined(groups, num_stages=stages):
                    T.copy(a_PK[m0, c * SCALE_BLOCK], a_S)
                    T.copy(b_ENK[expert_M[bm], n0, c * SCALE_BLOCK], b_S)
                    T.copy(sa_GQ[c, m0], sa_S)
                    # loaded before the MMA, so that its latency hides behind it
                    sb[0] = sb_EJG[expert_M[bm], n0 // SCALE_BLOCK, c]
                    T.gemm(a_S, b_S, chunk, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for i, j in T.Parallel(BLOCK_M, block_n):
                        acc[i, j] += chunk[i, j] * (sa_S[i] * sb[0])
                T.copy(acc, out_S)
                T.copy(out_S, out_PN[m0, n0])

    return grouped_fp8_mm


def tile_experts(offsets_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each 128-row tile's expert (int32 ``[ceil(num_rows / 128)]``, -1 at or past the last
    segment end), by torch ops on the device: no host sync."""
    starts_M = torch.arange(0, num_rows, BLOCK_M, dtype=torch.int32, device=offsets_E.device)
    expert_M = torch.searchsorted(offsets_E, starts_M, right=True, out_int32=True)
    return expert_M.masked_fill_(expert_M == offsets_E.shape[0], -1)


def mn_major_rows(sf_PG: torch.Tensor) -> torch.Tensor:
    """``sf_PG``'s scales as a contiguous ``[G, Q]`` matrix, a row per scale group and ``Q`` (P
    rounded up to 4) rows of the layout: DeepGEMM's MN-major layout, which TMA reads as one run of
    128 scales per tile and group. Made by :func:`kernels.transpose.sf_to_mn_major`."""
    sf_mn = sf_to_mn_major(sf_PG)
    groups, padded = sf_PG.shape[1], sf_mn.stride(1)
    return sf_mn.as_strided((groups, padded), (padded, 1))


def grouped_fp8_mm(
    a_PK: torch.Tensor, sa_PG: torch.Tensor, b_ENK: torch.Tensor, sb_EJG: torch.Tensor, offsets_E: torch.Tensor,
    *, block_n: int = 128, stages: int = 4,
) -> torch.Tensor:
    """The TileLang twin of :func:`kernels.gemm.reference.grouped_fp8_mm`, for K and N multiples
    of 128 (:func:`supports`). ``offsets_E`` is not read on the host: its ends must be multiples of
    128, at most P (the reference checks them). Rows at or past ``offsets_E[-1]`` are not written."""
    p, k = check_tensor("a_PK", a_PK, dtype=E4M3, ndim=2).shape
    check_cuda("a_PK", a_PK)
    e, n, _ = check_tensor("b_ENK", b_ENK, dtype=E4M3, shape=(None, None, k), device=a_PK.device).shape
    if not supports(k, n, block_n):
        raise ValueError(f"b_ENK: expected K and N multiples of 128 (and of block_n {block_n}), got N={n}, K={k}")
    check_tensor("sa_PG", sa_PG, dtype=torch.float32, shape=(p, k // SCALE_BLOCK), device=a_PK.device)
    check_tensor("sb_EJG", sb_EJG, dtype=torch.float32, shape=(e, n // SCALE_BLOCK, k // SCALE_BLOCK),
                 device=a_PK.device)
    check_tensor("offsets_E", offsets_E, dtype=torch.int32, shape=(e,), device=a_PK.device)
    check_stages(stages, MAX_STAGES)
    out_PN = torch.empty((p, n), dtype=torch.bfloat16, device=a_PK.device)
    if p == 0 or e == 0:
        return out_PN
    kernel = get_grouped_fp8_mm_kernel(n, k, e, block_n, stages)
    kernel(a_PK.contiguous(), mn_major_rows(sa_PG), b_ENK.contiguous(), sb_EJG.contiguous(),
           tile_experts(offsets_E, p), out_PN)
    return out_PN


def check_stages(stages: object, most: int) -> None:
    if type(stages) is not int or not 1 <= stages <= most:
        raise ValueError(f"stages: expected an int in [1, {most}] (shared memory), got {stages!r}")


def supports(k: int, n: int, block_n: int = 128) -> bool:
    """True when the kernel takes a reduction of ``k`` and ``n`` output columns."""
    return k > 0 and k % SCALE_BLOCK == 0 and n > 0 and n % SCALE_BLOCK == 0 and SCALE_BLOCK % block_n == 0
