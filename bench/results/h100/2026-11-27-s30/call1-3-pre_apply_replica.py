"""Session 30 experiment: tile-kernels' pre-apply structure (smem-staged loads and stores, 64 threads,
1024 columns a CTA) with our exact arithmetic, and its features one at a time."""
import tilelang
from tilelang import language as T
from kernels.quant.tiles import PASS_CONFIGS
from kernels.mhc.pre_apply_kernel import _hinted_moves

TK_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_PTXAS_REGISTER_USAGE_LEVEL: 10,
    tilelang.PassConfigKey.TL_DISABLE_VECTORIZE_256: True,
}


def make(n, d, threads=64, h_blk=1024, stage_loads=True, stage_stores=True, fma=False, store_hint=None, dtype="bfloat16"):
    num_tokens = T.dynamic("num_tokens")
    h_ctas = d // h_blk

    @T.prim_func
    def pre_apply_replica(
        x_TND: T.Tensor[(num_tokens, n, d), dtype],
        pre_TN: T.Tensor[(num_tokens, n), T.float32],
        y_TD: T.Tensor[(num_tokens, d), dtype],
    ):
        with T.Kernel(num_tokens * h_ctas, threads=threads) as pid:
            t = pid // h_ctas
            h = pid % h_ctas
            mixl = T.alloc_fragment(n, T.float32)
            T.copy(pre_TN[t, 0], mixl)
            xl = T.alloc_fragment((n, h_blk), T.float32)
            if stage_loads:
                xs = T.alloc_shared((n, h_blk), dtype)
                T.copy(x_TND[t, 0, h * h_blk], xs, disable_tma=True)
                T.copy(xs, xl, disable_tma=True)
            else:
                T.copy(x_TND[t, 0, h * h_blk], xl, disable_tma=True)
            yl = T.alloc_fragment(h_blk, T.float32)
            if fma:
                T.clear(yl)
                for i in T.serial(n):
                    for c in T.Parallel(h_blk):
                        yl[c] += mixl[i] * xl[i, c]
            else:
                for c in T.Parallel(h_blk):
                    yl[c] = T.ieee_mul(mixl[0], xl[0, c])
                for i in T.serial(1, n):
                    for c in T.Parallel(h_blk):
                        yl[c] = T.ieee_add(yl[c], T.ieee_mul(mixl[i], xl[i, c]))
            if store_hint is not None:
                T.import_source(_hinted_moves("", store_hint))
                ys = T.alloc_shared(h_blk, dtype)
                T.copy(yl, ys, disable_tma=True)
                tid = T.get_thread_binding()
                for v in T.unroll(h_blk // (8 * threads)):
                    c = (v * threads + tid) * 8
                    T.call_extern("handle", "ep_hinted_store", T.address_of(y_TD[t, h * h_blk + c]), T.address_of(ys[c]))
            elif stage_stores:
                ys = T.alloc_shared(h_blk, dtype)
                T.copy(yl, ys, disable_tma=True)
                T.copy(ys, y_TD[t, h * h_blk], disable_tma=True)
            else:
                T.copy(yl, y_TD[t, h * h_blk], disable_tma=True)

    return pre_apply_replica


get_replica = tilelang.jit(pass_configs=PASS_CONFIGS)(make)
get_replica_tk_configs = tilelang.jit(pass_configs=TK_CONFIGS)(make)

VARIANTS = {
    "replica": dict(),
    "replica fma (= tile-kernels)": dict(fma=True),
    "replica st.cs": dict(store_hint=".cs"),
    "replica 128 threads": dict(threads=128),
    "replica 128 threads tk-ptxas": dict(threads=128, tk=True),
    "replica 128 threads st.cs": dict(threads=128, store_hint=".cs"),
    "replica 128 threads st.": dict(threads=128, store_hint=""),
    
}


def build(n, d, tk=False, **kw):
    return (get_replica_tk_configs if tk else get_replica)(n, d, **kw)
