"""FP8 scales to and from the MN-major TMA-aligned layout DeepGEMM reads (see
:mod:`kernels.transpose.reference` for the layouts).

A CTA takes ``tile_m`` consecutive rows of scales: one contiguous run of the row-major side and
``tile_m`` consecutive entries of each column of the MN-major side, staged in shared memory so that
both the loads and the stores are coalesced; packing four exponents to a word (or unpacking them)
happens between the two.

Shape suffixes: M rows, G scale groups, W columns of the MN-major side (G, or ceil(G / 4) words).
"""

import tilelang
import torch
from tilelang import language as T

from kernels.tiles import PASS_CONFIGS, check_cuda, tl_dtype
from kernels.transpose.reference import TMA_ALIGN
from kernels.validate import check_positive, check_tensor

STAGE_BYTES = 32 << 10  # shared memory a CTA stages, at most
MAX_GROUPS = STAGE_BYTES // (32 * 4)  # 4-byte scales of 32 rows, the fewest a CTA takes
THREADS = 128


def rows_per_cta(groups: int) -> int:
    """The largest power of two from 32 to 128 rows whose ``groups`` 4-byte scales fit in
    ``STAGE_BYTES``."""
    rows = 128
    while rows > 32 and rows * groups * 4 > STAGE_BYTES:
        rows //= 2
    return rows


def _check_groups(groups: int) -> int:
    check_positive("groups", groups)
    if groups > MAX_GROUPS:
        raise ValueError(f"groups: expected at most {MAX_GROUPS} scale groups, got {groups}")
    return groups


@T.macro
def exponent_byte(sf, from_float: bool):
    """A scale's UE8M0 exponent byte as uint32: a float32's exponent field, or the uint8 itself."""
    if from_float:
        return (T.reinterpret(sf, T.uint32) >> T.uint32(23)) & T.uint32(0xFF)
    return T.cast(sf, T.uint32)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_sf_to_mn_major_kernel(groups: int, in_dtype: str, pack: bool):
    """``(sf_MG, sf_WM)`` kernel: row-major ``[M, G]`` scales (float32, or uint8 exponents) to
    ``[W, align(M, 4)]`` memory, float32 or (``pack``) int32 words of four exponents, zero-padded."""
    num_rows = T.dynamic("num_rows")
    words = -(-groups // 4) if pack else groups
    tile_m = rows_per_cta(groups)
    from_float = in_dtype == "float32"

    @T.macro
    def byte_of(sf_S, i, w, row, b):
        """Group ``4w + b``'s exponent in byte ``b`` of word ``w`` (zero past M or G)."""
        inside = T.And(row < num_rows, 4 * w + b < groups)
        byte = exponent_byte(sf_S[i, T.min(4 * w + b, groups - 1)], from_float)
        return T.if_then_else(inside, byte << T.uint32(8 * b), T.uint32(0))

    @T.prim_func
    def sf_to_mn_major(
        sf_MG: T.Tensor[(num_rows, groups), in_dtype],
        sf_WM: T.Tensor[(words, T.ceildiv(num_rows, TMA_ALIGN) * TMA_ALIGN), T.int32 if pack else T.float32],
    ):
        with T.Kernel(T.ceildiv(num_rows, tile_m), threads=THREADS) as pm:
            sf_S = T.alloc_shared((tile_m, groups), in_dtype)
            T.copy(sf_MG[pm * tile_m, 0], sf_S, disable_tma=True)
            for w, i in T.Parallel(words, tile_m):
                row = pm * tile_m + i
                if row < T.ceildiv(num_rows, TMA_ALIGN) * TMA_ALIGN:  # rows past M: the zero padding
                    if pack:
                        word = (byte_of(sf_S, i, w, row, 0) | byte_of(sf_S, i, w, row, 1)
                                | byte_of(sf_S, i, w, row, 2) | byte_of(sf_S, i, w, row, 3))
                        sf_WM[w, row] = T.reinterpret(word, T.int32)
                    elif from_float:
                        sf_WM[w, row] = T.if_then_else(row < num_rows, sf_S[i, w], T.float32(0))
                    else:
                        sf_WM[w, row] = T.if_then_else(
                            row < num_rows, T.reinterpret(exponent_byte(sf_S[i, w], False) << T.uint32(23), T.float32),
                            T.float32(0),
                        )

    return sf_to_mn_major


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_sf_to_row_major_kernel(groups: int, packed: bool):
    """``(sf_WM, sf_MG)`` kernel: the MN-major side's ``[W, M]`` columns (row stride free: any
    padding) back to row-major ``[M, G]``, float32 or (``packed``) uint8 exponents."""
    num_rows = T.dynamic("num_rows")
    row_stride = T.dynamic("row_stride")
    words = -(-groups // 4) if packed else groups
    tile_m = rows_per_cta(groups)
    dtype = T.int32 if packed else T.float32

    @T.prim_func
    def sf_to_row_major(
        sf_WM: T.StridedTensor[(words, num_rows), (row_stride, 1), dtype],
        sf_MG: T.Tensor[(num_rows, groups), T.uint8 if packed else T.float32],
    ):
        with T.Kernel(T.ceildiv(num_rows, tile_m), threads=THREADS) as pm:
            sf_S = T.alloc_shared((words, tile_m), dtype)
            T.copy(sf_WM[0, pm * tile_m], sf_S, disable_tma=True)
            for i, g in T.Parallel(tile_m, groups):
                if packed:
                    word = T.reinterpret(sf_S[g // 4, i], T.uint32)
                    sf_MG[pm * tile_m + i, g] = T.cast((word >> T.uint32(8 * (g % 4))) & T.uint32(0xFF), T.uint8)
                else:
                    sf_MG[pm * tile_m + i, g] = sf_S[g, i]

    return sf_to_row_major


def sf_to_mn_major(sf_MG: torch.Tensor, *, pack_ue8m0: bool = False) -> torch.Tensor:
    """TileLang :func:`kernels.transpose.reference.sf_to_mn_major` (``sf_MG`` on a CUDA device,
    copied first if not contiguous; at most 256 groups)."""
    check_tensor("sf_MG", sf_MG, dtype=(torch.float32, torch.uint8), ndim=2)
    check_cuda("sf_MG", sf_MG)
    m, groups = sf_MG.shape
    words = -(-groups // 4) if pack_ue8m0 else groups
    sf_WM = torch.empty((words, -(-m // TMA_ALIGN) * TMA_ALIGN), dtype=torch.int32 if pack_ue8m0 else torch.float32,
                        device=sf_MG.device)
    if m and groups:
        kernel = get_sf_to_mn_major_kernel(_check_groups(groups), tl_dtype(sf_MG.dtype), pack_ue8m0)
        kernel(sf_MG.contiguous(), sf_WM)
    return sf_WM.t()[:m]


def sf_to_row_major(sf_mn: torch.Tensor, *, groups: int) -> torch.Tensor:
    """TileLang :func:`kernels.transpose.reference.sf_to_row_major` (``sf_mn`` on a CUDA device;
    copied first unless MN-major, i.e. ``stride(0) == 1``; at most 256 groups)."""
    check_positive("groups", groups)
    check_tensor("sf_mn", sf_mn, dtype=(torch.float32, torch.int32), ndim=2)
    check_cuda("sf_mn", sf_mn)
    packed = sf_mn.dtype == torch.int32
    check_tensor("sf_mn", sf_mn, shape=(None, -(-groups // 4) if packed else groups))
    m = sf_mn.shape[0]
    sf_MG = torch.empty((m, groups), dtype=torch.uint8 if packed else torch.float32, device=sf_mn.device)
    if m:
        sf_WM = sf_mn.t() if sf_mn.stride(0) == 1 else sf_mn.t().contiguous()
        get_sf_to_row_major_kernel(_check_groups(groups), packed)(sf_WM, sf_MG)
    return sf_MG
