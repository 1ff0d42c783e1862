"""Session 30 experiment: the small-batch transpose ([B, 16, 7168] 2-byte) staged in shared memory the
way torch.compile's Triton kernel does it: [16, tile_n] tiles, one 16-byte load and one 16-byte store
a thread."""
import tilelang
from tilelang import language as T
from kernels.quant.tiles import PASS_CONFIGS


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_staged(rows: int, cols: int, tile_n: int = 64, transposed: bool = True, pad: int = 2, dtype: str = "uint16"):
    """Each thread loads ``vec`` elements of an input row and stores ``vec`` of an output row.
    ``transposed``: shared memory holds the tile as [tile_n][rows + pad] (scalar writes, vector reads);
    else as [rows][tile_n + pad] (vector writes, scalar reads)."""
    batch = T.dynamic("batch")
    vec = 16 // T.dtype(dtype).bytes
    threads = rows * tile_n // vec
    per_row = tile_n // vec  # threads loading one input row
    halves = rows // vec  # threads storing one output row

    @T.prim_func
    def staged_transpose(
        x_BMN: T.Tensor[(batch, rows, cols), dtype],
        out_BNM: T.Tensor[(batch, cols, rows), dtype],
    ):
        with T.Kernel(cols // tile_n, batch, threads=threads) as (pn, b):
            tid = T.get_thread_binding()
            vals = T.alloc_local((vec,), dtype)
            r, c0 = tid // per_row, tid % per_row * vec
            j, h = tid // halves, tid % halves * vec
            if transposed:
                tile = T.alloc_shared((tile_n, rows + pad), dtype)
                for k in T.vectorized(vec):
                    vals[k] = x_BMN[b, r, pn * tile_n + c0 + k]
                for k in T.unroll(vec):
                    tile[c0 + k, r] = vals[k]
                T.sync_threads()
                for k in T.vectorized(vec):
                    vals[k] = tile[j, h + k]
            else:
                tile = T.alloc_shared((rows, tile_n + pad), dtype)
                for k in T.vectorized(vec):
                    vals[k] = x_BMN[b, r, pn * tile_n + c0 + k]
                for k in T.vectorized(vec):
                    tile[r, c0 + k] = vals[k]
                T.sync_threads()
                for k in T.unroll(vec):
                    vals[k] = tile[h + k, j]
            for k in T.vectorized(vec):
                out_BNM[b, pn * tile_n + j, h + k] = vals[k]

    return staged_transpose


VARIANTS = {
    "staged T 16x64 pad2 (Triton's)": dict(tile_n=64, transposed=True, pad=2),
    "staged T 16x64 pad8": dict(tile_n=64, transposed=True, pad=8),
    "staged T 16x32 pad2": dict(tile_n=32, transposed=True, pad=2),
    "staged T 16x128 pad2": dict(tile_n=128, transposed=True, pad=2),
    "staged N 16x64 pad8": dict(tile_n=64, transposed=False, pad=8),
    "staged N 16x64 pad2": dict(tile_n=64, transposed=False, pad=2),
}
