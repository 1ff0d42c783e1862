"""TileLang kernels of :func:`kernels.mhc.reference.split_sinkhorn`, forward and backward: one
thread per token, the token's ``M = N (N + 2)`` mixes and its ``N x N`` Sinkhorn matrix in
registers (N = 4: 24 mixes, 16 entries, 20 iterations of a few dozen flops each: the work is
small, the point is one launch instead of the reference's ~80 small ones per sublayer).

Forward: ``a = mixes * scale_M + base``; ``pre = sigmoid(a[:N]) + pre_eps``; ``post = post_mult *
sigmoid(a[N:2N])``; ``comb = sinkhorn(a[2N:].view(N, N))`` (softmax over each row, + eps, then
column, and ``iters - 1`` times row and column normalizations, each ``/ (sum + eps)``).

Backward (``da``, the gradient of ``a``, per token; ``kernels.mhc.split_sinkhorn`` finishes with
``grad_mixes = da * scale_M`` and the sums over tokens for ``base`` and ``scale``): the sigmoid
derivatives for ``pre``/``post``, and for ``comb`` the Sinkhorn recomputed from the logits with
each normalization's output and divisor kept (``2 iters - 1`` steps of ``N^2 + N`` floats: local
memory), then walked back: a normalization ``X = A / (sum(A) + eps)`` has ``dA = (dX - sum(dX *
X)) / (sum(A) + eps)`` along its axis, the softmax ``P (dP - sum_row(dP P))``.

float32 throughout; ``expf`` where the reference's ``torch.exp``/``sigmoid`` run, so results match
within the tolerances the GPU tests state, not bit for bit.

Shape suffixes (as in :mod:`kernels.mhc.reference`): T tokens, N streams, M = N (N + 2) mixes.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.quant.tiles import PASS_CONFIGS, check_cuda

THREADS = 128  # tokens per CTA


def sigmoid(a):
    return T.ieee_fdiv(T.float32(1), T.ieee_add(T.float32(1), T.exp(-a)))


def sinkhorn_macros(n: int, eps: float):
    """Macros shared by the forward and backward kernels: ``load_a(mixes, scale, base, row, a)``
    (``a = mixes * scale_M + base`` of one token), ``softmax_rows(a, p)`` (each row of the
    logits ``a[2N:]``, max subtracted) and ``normalize(out, div, axis)`` (``axis`` 0: columns, 1:
    rows; writes the divisors ``sum + eps`` to ``div`` and divides ``out`` in place)."""
    first = 2 * n  # the logits' offset in the mixes

    @T.macro
    def softmax_rows(a, p):
        for i in T.unroll(n):
            top = T.alloc_var(T.float32)
            total = T.alloc_var(T.float32)
            top = a[first + i * n]
            for j in T.unroll(1, n):
                top = T.max(top, a[first + i * n + j])
            total = T.float32(0)
            for j in T.unroll(n):
                p[i * n + j] = T.exp(T.ieee_sub(a[first + i * n + j], top))
                total = T.ieee_add(total, p[i * n + j])
            for j in T.unroll(n):
                p[i * n + j] = T.ieee_fdiv(p[i * n + j], total)

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
    def load_a(mixes_TM, scale_3, base_M, row, a):
        for k in T.unroll(first + n * n):  # a = mixes * [scale0]*N ++ [scale1]*N ++ [scale2]*N*N + base
            part = T.if_then_else(k < n, 0, T.if_then_else(k < first, 1, 2))
            a[k] = T.ieee_add(T.ieee_mul(mixes_TM[row, k], scale_3[part]), base_M[k])

    return load_a, softmax_rows, normalize


def split_macro(n: int, iters: int, pre_eps: float, post_mult: float, eps: float):
    """A macro ``(a, pre, post, out, div)``: one token's split and Sinkhorn from ``a = mixes *
    scale_M + base`` into local ``pre[N]``, ``post[N]`` and ``out[N*N]`` (``div[N]`` scratch)."""
    _, softmax_rows, normalize = sinkhorn_macros(n, eps)

    @T.macro
    def split(a, pre, post, out, div):
        for i in T.unroll(n):
            pre[i] = T.ieee_add(sigmoid(a[i]), T.float32(pre_eps))
            post[i] = T.ieee_mul(T.float32(post_mult), sigmoid(a[n + i]))
        softmax_rows(a, out)
        for k in T.unroll(n * n):
            out[k] = T.ieee_add(out[k], T.float32(eps))
        normalize(out, div, 0)
        for _ in T.serial(iters - 1):
            normalize(out, div, 1)
            normalize(out, div, 0)

    return split


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_split_sinkhorn_kernel(n: int, iters: int, pre_eps: float, post_mult: float, eps: float):
    """``(mixes_TM, scale_3, base_M, pre_TN, post_TN, comb_TNN)`` kernel (all float32)."""
    num_tokens = T.dynamic("num_tokens")
    m = n * (n + 2)
    load_a, _, _ = sinkhorn_macros(n, eps)
    split = split_macro(n, iters, pre_eps, post_mult, eps)

    @T.prim_func
    def split_sinkhorn_kernel(
        mixes_TM: T.Tensor[(num_tokens, m), T.float32],
        scale_3: T.Tensor[(3,), T.float32],
        base_M: T.Tensor[(m,), T.float32],
        pre_TN: T.Tensor[(num_tokens, n), T.float32],
        post_TN: T.Tensor[(num_tokens, n), T.float32],
        comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, THREADS), threads=THREADS) as bx:
            tid = T.get_thread_binding()
            a = T.alloc_local((m,), T.float32)
            pre = T.alloc_local((n,), T.float32)
            post = T.alloc_local((n,), T.float32)
            out = T.alloc_local((n * n,), T.float32)
            div = T.alloc_local((n,), T.float32)
            t = bx * THREADS + tid
            if t < num_tokens:
                row = T.Cast(T.int64, t)
                load_a(mixes_TM, scale_3, base_M, row, a)
                split(a, pre, post, out, div)
                for i in T.unroll(n):
                    pre_TN[row, i] = pre[i]
                    post_TN[row, i] = post[i]
                for i in T.unroll(n):
                    for j in T.unroll(n):
                        comb_TNN[row, i, j] = out[i * n + j]

    return split_sinkhorn_kernel


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_split_sinkhorn_backward_kernel(n: int, iters: int, post_mult: float, eps: float):
    """``(mixes_TM, scale_3, base_M, g_pre_TN, g_post_TN, g_comb_TNN, da_TM)`` kernel: ``da``, the
    gradient of ``a = mixes * scale_M + base`` (all float32)."""
    num_tokens = T.dynamic("num_tokens")
    m = n * (n + 2)
    steps = 2 * iters - 1  # normalizations: a column one, then (row, column) iters - 1 times
    load_a, softmax_rows, normalize = sinkhorn_macros(n, eps)

    @T.prim_func
    def split_sinkhorn_backward_kernel(
        mixes_TM: T.Tensor[(num_tokens, m), T.float32],
        scale_3: T.Tensor[(3,), T.float32],
        base_M: T.Tensor[(m,), T.float32],
        g_pre_TN: T.Tensor[(num_tokens, n), T.float32],
        g_post_TN: T.Tensor[(num_tokens, n), T.float32],
        g_comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
        da_TM: T.Tensor[(num_tokens, m), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, THREADS), threads=THREADS) as bx:
            tid = T.get_thread_binding()
            a = T.alloc_local((m,), T.float32)
            p = T.alloc_local((n * n,), T.float32)
            out = T.alloc_local((n * n,), T.float32)
            div = T.alloc_local((n,), T.float32)
            outs = T.alloc_local((steps * n * n,), T.float32)  # each step's output
            divs = T.alloc_local((steps * n,), T.float32)  # and divisors
            g = T.alloc_local((n * n,), T.float32)
            dot = T.alloc_local((n,), T.float32)
            t = bx * THREADS + tid
            if t < num_tokens:
                row = T.Cast(T.int64, t)
                load_a(mixes_TM, scale_3, base_M, row, a)
                for i in T.unroll(n):
                    s_pre = sigmoid(a[i])
                    s_post = sigmoid(a[n + i])
                    da_TM[row, i] = T.ieee_mul(T.ieee_mul(g_pre_TN[row, i], s_pre), T.ieee_sub(T.float32(1), s_pre))
                    da_TM[row, n + i] = T.ieee_mul(
                        T.ieee_mul(T.ieee_mul(g_post_TN[row, i], T.float32(post_mult)), s_post),
                        T.ieee_sub(T.float32(1), s_post),
                    )
                # The forward again, keeping every normalization's output and divisors.
                softmax_rows(a, p)
                for k in T.unroll(n * n):
                    out[k] = T.ieee_add(p[k], T.float32(eps))
                for s in T.serial(steps):
                    normalize(out, div, T.if_then_else(s % 2 == 0, 0, 1))
                    for k in T.unroll(n * n):
                        outs[s * n * n + k] = out[k]
                    for k in T.unroll(n):
                        divs[s * n + k] = div[k]
                # ... and back: dA = (dX - sum_axis(dX * X)) / div along each step's axis.
                for k in T.unroll(n * n):
                    g[k] = g_comb_TNN[row, k // n, k % n]
                for r in T.serial(steps):
                    s = steps - 1 - r
                    for c in T.unroll(n):
                        dot[c] = T.float32(0)
                        for b in T.unroll(n):
                            k = T.if_then_else(s % 2 == 0, b * n + c, c * n + b)
                            dot[c] = T.ieee_add(dot[c], T.ieee_mul(g[k], outs[s * n * n + k]))
                    for i in T.unroll(n):
                        for j in T.unroll(n):
                            c = T.if_then_else(s % 2 == 0, j, i)
                            g[i * n + j] = T.ieee_fdiv(T.ieee_sub(g[i * n + j], dot[c]), divs[s * n + c])
                for i in T.unroll(n):  # softmax: P (dP - sum_row(dP P))
                    dot[i] = T.float32(0)
                    for j in T.unroll(n):
                        dot[i] = T.ieee_add(dot[i], T.ieee_mul(g[i * n + j], p[i * n + j]))
                    for j in T.unroll(n):
                        da_TM[row, 2 * n + i * n + j] = T.ieee_mul(p[i * n + j], T.ieee_sub(g[i * n + j], dot[i]))

    return split_sinkhorn_backward_kernel


def supports(mixes_TM: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor) -> bool:
    """True when the kernels take these (float32 everywhere; float64 stays with the reference)."""
    return all(x.dtype == torch.float32 for x in (mixes_TM, scale_3, base_M))


def split_sinkhorn(mixes_TM, scale_3, base_M, *, pre_eps: float, post_mult: float, sinkhorn_eps: float,
                   iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of :func:`kernels.mhc.reference.split_sinkhorn` (arguments checked there):
    ``(pre_TN, post_TN, comb_TNN)``, float32, inputs float32 on a CUDA device."""
    check_cuda("mixes_TM", mixes_TM)
    t, m = mixes_TM.shape
    n = streams_of(m)
    pre_TN = torch.empty((t, n), dtype=torch.float32, device=mixes_TM.device)
    post_TN = torch.empty_like(pre_TN)
    comb_TNN = torch.empty((t, n, n), dtype=torch.float32, device=mixes_TM.device)
    if t:
        kernel = get_split_sinkhorn_kernel(n, iters, float(pre_eps), float(post_mult), float(sinkhorn_eps))
        kernel(mixes_TM.contiguous(), scale_3.contiguous(), base_M.contiguous(), pre_TN, post_TN, comb_TNN)
    return pre_TN, post_TN, comb_TNN


def split_sinkhorn_backward(mixes_TM, scale_3, base_M, g_pre_TN, g_post_TN, g_comb_TNN, *, post_mult: float,
                            sinkhorn_eps: float, iters: int) -> torch.Tensor:
    """``da_TM``, the gradient of ``a = mixes * scale_M + base`` given the outputs' gradients
    (float32; ``kernels.mhc.split_sinkhorn`` turns it into those of mixes, scale and base)."""
    check_cuda("mixes_TM", mixes_TM)
    t, m = mixes_TM.shape
    n = streams_of(m)
    da_TM = torch.empty((t, m), dtype=torch.float32, device=mixes_TM.device)
    if t:
        kernel = get_split_sinkhorn_backward_kernel(n, iters, float(post_mult), float(sinkhorn_eps))
        kernel(mixes_TM.contiguous(), scale_3.contiguous(), base_M.contiguous(), g_pre_TN.float().contiguous(),
               g_post_TN.float().contiguous(), g_comb_TNN.float().contiguous(), da_TM)
    return da_TM


def streams_of(m: int) -> int:
    """``N`` from ``M = N (N + 2)`` mixes."""
    n = int((m + 1) ** 0.5) - 1
    if n * (n + 2) != m:
        raise ValueError(f"mixes_TM: expected N * (N + 2) columns, got {m}")
    return n
