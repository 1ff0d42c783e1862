"""Inference-only mHC ``pre`` in one kernel (:func:`kernels.mhc.reference.pre_fused`): norm +
projection, split + Sinkhorn and pre-apply, with the mixes, the coefficients and the ``pre``
weights never leaving registers.

A CTA walks its 16 tokens' streams once for the mixes (``norm_fn_kernel``'s walk: every lane ends
with its warp's totals), lane t of a warp then runs token t's split and Sinkhorn (:func:`split_macro`,
one thread a token), stores ``post`` and ``comb`` and hands ``pre`` to the warp through shared
memory, and the warp reads each token's streams a second time (most from L2, just read) to store
``y = sum_i pre_i * x_i``.

Shape suffixes: T tokens, N streams, D hidden, K = N*D, M = N*(N+2).
"""

import tilelang
import torch
from tilelang import language as T

from kernels.mhc import reference
from kernels.mhc.norm_fn_kernel import THREADS, TOKENS_PER_WARP, chunk_walk, rstd_of
from kernels.mhc.pre_apply_kernel import KERNEL_DTYPES
from kernels.mhc.split_sinkhorn_kernel import sigmoid
from kernels.tiles import PASS_CONFIGS, aligned, check_cuda, tl_dtype, vector_width
from kernels.rows import WARP


def split_macro(n: int, iters: int, pre_eps: float, post_mult: float, eps: float):
    """A macro ``(a, pre, post, out, div)``: one token's split and Sinkhorn, all in one thread, from
    ``a = mixes * scale_M + base`` into local ``pre[N]``, ``post[N]`` and ``out[N*N]`` (``div[N]``
    scratch). (``split_sinkhorn_kernel`` spreads a token over lanes instead; here every lane holds
    its warp's mixes, and selecting a lane's share of them would cost more than the split.)"""

    @T.macro
    def normalize(out, div, axis):
        for a in T.unroll(n):
            total = T.alloc_var(T.float32)
            total = T.float32(0)
            for b in T.unroll(n):
                total = T.ieee_add(total, T.if_then_else(axis == 0, out[b * n + a], out[a * n + b]))
            div[a] = T.ieee_add(total, T.float32(eps))
        for i in T.unroll(n):
            for j in T.unroll(n):
                out[i * n + j] = T.ieee_fdiv(out[i * n + j], T.if_then_else(axis == 0, div[j], div[i]))

    @T.macro
    def split(a, pre, post, out, div):
        for i in T.unroll(n):
            pre[i] = T.ieee_add(sigmoid(a[i]), T.float32(pre_eps))
            post[i] = T.ieee_mul(T.float32(post_mult), sigmoid(a[n + i]))
        for i in T.unroll(n):  # softmax of each row of the logits a[2N:], + eps
            top = T.alloc_var(T.float32)
            total = T.alloc_var(T.float32)
            top = a[2 * n + i * n]
            for j in T.unroll(1, n):
                top = T.max(top, a[2 * n + i * n + j])
            total = T.float32(0)
            for j in T.unroll(n):
                out[i * n + j] = T.exp(T.ieee_sub(a[2 * n + i * n + j], top))
                total = T.ieee_add(total, out[i * n + j])
            for j in T.unroll(n):
                out[i * n + j] = T.ieee_add(T.ieee_fdiv(out[i * n + j], total), T.float32(eps))
        normalize(out, div, 0)
        for _ in T.serial(iters - 1):
            normalize(out, div, 1)
            normalize(out, div, 0)

    return split


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_pre_fused_kernel(n: int, d: int, dtype: str, norm_eps: float, pre_eps: float, post_mult: float,
                         sinkhorn_eps: float, iters: int):
    """``(x_TK, fn_MK, scale_3, base_M, y_TD, post_TN, comb_TNN)`` kernel for ``N = n`` streams of
    ``D = d`` elements of ``dtype`` (parameters and coefficients float32; token count dynamic)."""
    num_tokens = T.dynamic("num_tokens")
    k, m = n * d, n * (n + 2)
    walk = chunk_walk(k, m, dtype)
    tile_t = walk.tile_t
    split = split_macro(n, iters, pre_eps, post_mult, sinkhorn_eps)
    dvec = vector_width(d, T.dtype(dtype).bytes)
    dchunks = -(-d // (WARP * dvec))
    tpw = TOKENS_PER_WARP

    @T.prim_func
    def pre_fused_kernel(
        x_TK: T.Tensor[(num_tokens, k), dtype],
        fn_MK: T.Tensor[(m, k), T.float32],
        scale_3: T.Tensor[(3,), T.float32],
        base_M: T.Tensor[(m,), T.float32],
        y_TD: T.Tensor[(num_tokens, d), dtype],
        post_TN: T.Tensor[(num_tokens, n), T.float32],
        comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tile_t), threads=THREADS) as b:
            tid = T.get_thread_binding()
            warp, lane = tid // WARP, tid % WARP
            acc = T.alloc_local((tpw * m,), T.float32)
            sq = T.alloc_local((tpw,), T.float32)
            a = T.alloc_local((m,), T.float32)
            pre = T.alloc_local((n,), T.float32)
            post = T.alloc_local((n,), T.float32)
            comb = T.alloc_local((n * n,), T.float32)
            div = T.alloc_local((n,), T.float32)
            xv = T.alloc_local((dvec,), dtype)
            y_acc = T.alloc_local((dvec,), T.float32)
            y_out = T.alloc_local((dvec,), dtype)
            pre_S = T.alloc_shared((tile_t, n), T.float32)
            own_sq = T.alloc_var(T.float32)
            walk.norm_walk(x_TK, fn_MK, acc, sq, b, tid, num_tokens)
            # Lane t < TOKENS_PER_WARP takes its warp's token t (selected without dynamic indexing,
            # so the totals stay in registers): the warp's splits run side by side.
            own_sq = sq[0]
            for t in T.unroll(1, tpw):
                own_sq = T.if_then_else(lane == t, sq[t], own_sq)
            rstd = rstd_of(own_sq, k, norm_eps)
            for r in T.unroll(m):  # a = mixes * [scale0]*N ++ [scale1]*N ++ [scale2]*N*N + base
                a[r] = acc[r]
                for t in T.unroll(1, tpw):
                    a[r] = T.if_then_else(lane == t, acc[t * m + r], a[r])
                part = T.if_then_else(r < n, 0, T.if_then_else(r < 2 * n, 1, 2))
                a[r] = T.ieee_add(T.ieee_mul(a[r] * rstd, scale_3[part]), base_M[r])
            split(a, pre, post, comb, div)
            own = b * tile_t + warp * tpw + lane
            if lane < tpw:
                for i in T.unroll(n):
                    pre_S[warp * tpw + lane, i] = pre[i]
                if own < num_tokens:
                    for i in T.unroll(n):
                        post_TN[own, i] = post[i]
                        for j in T.unroll(n):
                            comb_TNN[own, i, j] = comb[i * n + j]
            T.sync_threads()
            for t in T.unroll(tpw):
                token = b * tile_t + warp * tpw + t
                for i in T.unroll(n):
                    pre[i] = pre_S[warp * tpw + t, i]
                for c in T.serial(dchunks):
                    col = (c * WARP + lane) * dvec
                    if token < num_tokens and col < d:
                        for j in T.unroll(dvec):
                            y_acc[j] = T.float32(0)
                        for i in T.unroll(n):
                            for j in T.vectorized(dvec):
                                xv[j] = x_TK[token, i * d + col + j]
                            for j in T.unroll(dvec):
                                y_acc[j] = T.ieee_add(y_acc[j], T.ieee_mul(pre[i], T.cast(xv[j], T.float32)))
                        for j in T.unroll(dvec):
                            y_out[j] = T.cast(y_acc[j], dtype)
                        for j in T.vectorized(dvec):
                            y_TD[token, col + j] = y_out[j]

    return pre_fused_kernel


ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def within_tolerance(x_TND: torch.Tensor, got: tuple, want: tuple) -> bool:
    """Whether this kernel's ``(y, post, comb)`` agree with the reference's ``want`` for input
    ``x_TND``. The mixes differ by float32 summation order (a few ulps relative, over ``N * D``
    terms); through the sigmoids and the Sinkhorn that stays within ``1e-5`` relative + ``1e-6`` in
    ``post``, ``comb`` and the ``pre`` weights (up to 5.6e-6 absolute in ``post`` measured at
    D = 7168 on an H100), so ``y = sum_i pre_i x_i`` may differ by 1e-5 of ``sum_i |x_i|`` (large
    next to ``|y|`` where the sum cancels), then round the other way: two units in the last place of
    ``y``'s dtype. (A 1e-6 allowance for ``y`` failed once in six seeds at D = 7168, by 2e-7.)"""
    close = all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got[1:], want[1:]))
    y, y_want = got[0].double(), want[0].double()
    bound = 2 * ULP[want[0].dtype] * y_want.abs() + 1e-5 * x_TND.double().abs().sum(1)
    return close and bool(torch.all((y - y_want).abs() <= bound))


def supports(x_TND: torch.Tensor, fn_MK: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor) -> bool:
    """Streams bfloat16/float16/float32, parameters float32."""
    return x_TND.dtype in KERNEL_DTYPES and all(p.dtype == torch.float32 for p in (fn_MK, scale_3, base_M))


def pre_fused(x_TND, fn_MK, scale_3, base_M, *, norm_eps: float, pre_eps: float, post_mult: float,
              sinkhorn_eps: float, iters: int, tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y_TD, post_TN, comb_TNN)`` as :func:`kernels.mhc.reference.pre_fused` (up to float32
    summation order); shapes, dtypes and devices checked, not values."""
    reference.check_pre_fused_args(x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, sinkhorn_eps, iters,
                                   values=False)
    check_cuda("x_TND", x_TND)
    t, n, d = x_TND.shape
    y_TD = torch.empty((t, d), dtype=x_TND.dtype, device=x_TND.device)
    post_TN = torch.empty((t, n), dtype=torch.float32, device=x_TND.device)
    comb_TNN = torch.empty((t, n, n), dtype=torch.float32, device=x_TND.device)
    if t == 0:
        return y_TD, post_TN, comb_TNN
    w_MK = reference.round_to_tf32(fn_MK) if tf32 else fn_MK
    kernel = get_pre_fused_kernel(n, d, tl_dtype(x_TND.dtype), float(norm_eps), float(pre_eps), float(post_mult),
                                  float(sinkhorn_eps), int(iters))
    kernel(aligned(x_TND).view(t, n * d), aligned(w_MK), scale_3.contiguous(), base_M.contiguous(), y_TD, post_TN,
           comb_TNN)
    return y_TD, post_TN, comb_TNN
