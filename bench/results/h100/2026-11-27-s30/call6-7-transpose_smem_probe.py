"""Session 30 probe: does the register transpose gain from holding shared memory it does not use (the
SM's L1/shared split then matches its neighbours', torch.compile's kernel held 2 KB)?"""
import tilelang
from tilelang import language as T
from kernels.quant.tiles import PASS_CONFIGS


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_register_smem(rows: int, cols: int, threads: int = 64, smem: int = 0, dtype: str = "uint16"):
    batch = T.dynamic("batch")
    bm, bn = 8, 2
    blocks_m, blocks = rows // bm, rows // bm * (cols // bn)

    @T.prim_func
    def batched_transpose(
        x_BMN: T.Tensor[(batch, rows, cols), dtype],
        out_BNM: T.Tensor[(batch, cols, rows), dtype],
    ):
        with T.Kernel(T.ceildiv(blocks, threads), batch, threads=threads) as (pb, b):
            block_MN = T.alloc_local((bm, bn), dtype)
            column = T.alloc_local((bm,), dtype)
            blk = pb * threads + T.get_thread_binding()
            m0, n0 = blk % blocks_m * bm, blk // blocks_m * bn
            if smem:
                pad = T.alloc_shared((smem // 2,), dtype)
                if batch == 0:  # never at run time; keeps the allocation
                    pad[T.get_thread_binding()] = T.uint16(0)
            if blk < blocks:
                for i in T.unroll(bm):
                    for k in T.vectorized(bn):
                        block_MN[i, k] = x_BMN[b, m0 + i, n0 + k]
                for j in T.unroll(bn):
                    for i in T.unroll(bm):
                        column[i] = block_MN[i, j]
                    for k in T.vectorized(bm):
                        out_BNM[b, n0 + j, m0 + k] = column[k]

    return batched_transpose


VARIANTS = {
    "register 128 threads": dict(threads=128),
    "register 128 threads smem 2 KB": dict(threads=128, smem=2048),
    "register 128 threads smem 8 KB": dict(threads=128, smem=8192),
    "register 128 threads smem 32 KB": dict(threads=128, smem=32768),
    "register 256 threads smem 2 KB": dict(threads=256, smem=2048),
    "register 64 threads smem 32 KB": dict(smem=32768),
}
