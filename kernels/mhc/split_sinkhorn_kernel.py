"""TileLang kernels of :func:`kernels.mhc.reference.split_sinkhorn`, forward and backward, with
several lanes a token.

A token's ``N x N`` Sinkhorn matrix spreads over ``groups * N`` lanes of one warp (:class:`Lanes`):
lane ``(r, c)`` holds column ``c`` of rows ``r, r + groups, ...`` (N = 4: 16 lanes of one entry,
two tokens a warp). A row's sum (or max) is a reduction over the ``N`` lanes of its row group, a
column's over the ``groups`` lanes of its column, by warp shuffles, so a normalization costs a
lane a shuffle sum and one division. At T = 8192, N = 4 that is 4096 warps, against 256 warps of
one thread a token, each running a chain of ~40 normalizations of 16 entries.

Forward: ``a = mixes * scale_M + base``; ``pre = sigmoid(a[:N]) + pre_eps`` and ``post =
post_mult * sigmoid(a[N:2N])`` on the token's first ``2N`` lanes; ``comb = sinkhorn(a[2N:].view(N,
N))``: softmax over each row, + eps, then a column normalization and ``iters - 1`` (row, column)
pairs, each ``/ (sum + eps)``.

Backward, the whole op in one kernel: each lane recomputes its entries' Sinkhorn keeping in
registers its entries after each of the ``2 iters - 1`` normalizations (the steps unrolled at trace
time, so every index is a constant), then walks back, taking each step's divisor again from the
step's input (the same bits as the forward's, and half the registers of keeping them): a
normalization ``X = A / (sum(A) + eps)`` has ``dA = (dX - sum(dX * X)) / (sum(A) + eps)`` along its
axis, the softmax ``P (dP - sum_row(dP P))``, the sigmoids their derivatives. That gives ``da``, the gradient
of ``a``; the kernel stores ``grad_mixes = da * scale_M`` and, for each CTA, the sums over its
tokens of ``da`` (``grad_base``) and of ``da * mixes`` over each third's mixes (``grad_scale``), in
token order; the wrapper adds the CTAs' rows with one ``sum(0)``.

Numerics: float32 with the reference's operations (``expf``, IEEE divisions, products and sums
never fused into FMAs); only the order of the sums differs (a butterfly over a power-of-two group,
lane order otherwise; every lane of a group gets the same bits).

Shape suffixes (as in :mod:`kernels.mhc.reference`): T tokens, N streams, M = N (N + 2) mixes; C
CTAs of the backward, P = M + 3 sums a CTA (``da`` per mix, then ``da * mixes`` per third).
"""

from typing import NamedTuple

import tilelang
import torch
from tilelang import language as T

from kernels.tiles import PASS_CONFIGS, check_cuda, is_pow2
from kernels.rows import WARP

THREADS = 128
MAX_STREAMS = 8  # up to here a lane holds at most two rows, so the backward's history fits registers
# N whose backward fits in 64 registers a thread without spilling (ptxas): held there for 8 CTAs an
# SM, so T = 8192 at N = 4 runs in one wave. The other N keep ptxas' counts (70-146; 64 spills).
EIGHT_CTAS_AN_SM = (2, 4)


class Lanes(NamedTuple):
    """A token's lanes: ``groups`` row groups of ``n`` lanes (one a column), lane ``(r, c)`` holding
    rows ``r + groups * k`` for ``k < rows`` (rows ``>= n`` are padding, kept at 0)."""

    n: int
    rows: int
    groups: int

    @property
    def width(self) -> int:
        """Lanes a token."""
        return self.groups * self.n

    @property
    def tokens(self) -> int:
        """Tokens a warp (lanes past them idle)."""
        return WARP // self.width

    def real(self, r, k):
        """Whether lane row group ``r``'s ``k``-th row exists: Python True where it does for every
        lane, else a device condition."""
        return True if self.groups * (k + 1) <= self.n else r + self.groups * k < self.n


def lanes_for(n: int) -> Lanes:
    """As many lanes as fit a warp, one column each: N = 1..5 one entry a lane, 6..8 two."""
    rows = -(-n // (WARP // n))
    return Lanes(n, rows, -(-n // rows))


class Place(NamedTuple):
    """Where a thread works (device expressions): its token's ``slot`` among the CTA's tokens and
    the ``token``; ``used``: the lane is one of a token's (not idle); ``active``: and the token
    exists (it stores); its lane ``local`` in the token's, as ``(r, c)``; the first lanes of its row
    group and its column."""

    slot: object
    token: object
    used: object
    active: object
    local: object
    r: object
    c: object
    row_first: object
    col_first: object


def place(lay: Lanes, cta, tid, num_tokens) -> Place:
    lane = tid % WARP
    local = lane % lay.width
    r, c = local // lay.n, local % lay.n
    slot = tid // WARP * lay.tokens + lane // lay.width
    token = cta * tokens_per_cta(lay) + slot
    used = lane // lay.width < lay.tokens
    return Place(slot, token, used, T.And(used, token < num_tokens), local, r, c, lane - c, lane - r * lay.n)


def tokens_per_cta(lay: Lanes) -> int:
    return THREADS // WARP * lay.tokens


def row_of(num_tokens, p: Place):
    """The row a thread reads: its token's, the last one for idle lanes and the tail (which compute
    along, for the shuffles, but store nothing)."""
    return T.Cast(T.int64, T.min(p.token, num_tokens - 1))


def sigmoid_mixes(lay: Lanes, p: Place) -> list:
    """``(mix, whether this lane takes it)``: a token's pre and post mixes dealt to its lanes."""
    mixes = [p.local + q * lay.width for q in range(-(-2 * lay.n // lay.width))]
    return [(mix, mix < 2 * lay.n) for mix in mixes]


def sigmoid(a):
    return T.ieee_fdiv(T.float32(1), T.ieee_add(T.float32(1), T.exp(-a)))


def group_reduce(size: int, stride: int, combine):
    """A macro ``(v, k, first)``: ``v[k]`` becomes ``combine`` of ``v[k]`` over the ``size`` lanes
    ``first, first + stride, ...`` (this lane one of them), the same bits in each: a butterfly when
    the group is a power of two at a power-of-two stride (then aligned), else in lane order."""
    if is_pow2(size) and is_pow2(stride):
        offsets = [stride << o for o in reversed(range(size.bit_length() - 1))]  # torch softmax's order

        @T.macro
        def butterfly(v, k, first):
            for offset in offsets:
                v[k] = combine(v[k], T.shfl_xor(v[k], offset))

        return butterfly

    @T.macro
    def in_order(v, k, first):
        total = T.alloc_local((1,), T.float32)
        total[0] = T.shfl_sync(v[k], first)
        for q in T.unroll(1, size):
            total[0] = combine(total[0], T.shfl_sync(v[k], first + q * stride))
        v[k] = total[0]

    return in_order


class SinkhornLanes(NamedTuple):
    """The per-lane Sinkhorn macros of :func:`sinkhorn_lanes`."""

    load_logits: object
    softmax: object
    divisors: object
    walk_back: object
    softmax_back: object
    mix: object
    padded: object


def sinkhorn_lanes(lay: Lanes, eps: float) -> SinkhornLanes:
    """Macros over a lane's ``lay.rows`` entries (local arrays indexed ``k``, or ``at + k`` in a
    history; ``tmp`` scratch; ``p`` the lane's :class:`Place`):

    - ``load_logits(mixes_TM, scale_3, base_M, row, p, a)``: the logits ``a = mixes * scale_2 + base``;
    - ``softmax(a, probs, x, tmp, p)``: ``probs`` = each row's softmax of ``a``, ``x = probs + eps``;
    - ``divisors(x, at, div, tmp, p, axis)``: ``div = sum(x) + eps`` along ``axis`` (0: columns,
      1: rows; 1 for a padding row);
    - ``walk_back(g, x, at, div, tmp, p, axis)``: ``g = (g - sum(g * x)) / div`` along ``axis``;
    - ``softmax_back(g, probs, tmp, p)``: ``g = probs (g - sum_row(g probs))``;

    and ``mix(p, k)`` (entry ``k``'s column in the mixes), ``padded(p, k, value, fill)``. Padding
    rows stay 0 in ``x`` and ``probs`` (their row divisor is 1, which keeps them so even at
    eps = 0), so whatever their ``g`` holds never reaches a real entry."""
    n, rows, groups = lay
    entries = list(range(rows))
    row_sum = group_reduce(n, 1, T.ieee_add)
    row_max = group_reduce(n, 1, T.max)
    col_sum = group_reduce(groups, n, T.ieee_add)

    def mix(p, k):
        return 2 * n + (p.r + groups * k) * n + p.c

    def padded(p, k, value, fill):
        real = lay.real(p.r, k)
        return value if real is True else T.if_then_else(real, value, fill)

    @T.macro
    def load_logits(mixes_TM, scale_3, base_M, row, p, a):
        for k in entries:
            a[k] = padded(p, k, T.ieee_add(T.ieee_mul(mixes_TM[row, mix(p, k)], scale_3[2]), base_M[mix(p, k)]),
                          T.float32(0))

    @T.macro
    def softmax(a, probs, x, tmp, p):
        for k in entries:
            tmp[k] = a[k]
            row_max(tmp, k, p.row_first)
            probs[k] = T.exp(T.ieee_sub(a[k], tmp[k]))
            tmp[k] = probs[k]
            row_sum(tmp, k, p.row_first)
            probs[k] = padded(p, k, T.ieee_fdiv(probs[k], tmp[k]), T.float32(0))
            x[k] = padded(p, k, T.ieee_add(probs[k], T.float32(eps)), T.float32(0))

    @T.macro
    def divisors(x, at, div, tmp, p, axis):
        if axis == 0:
            tmp[0] = x[at]
            for k in entries[1:]:
                tmp[0] = T.ieee_add(tmp[0], x[at + k])
            col_sum(tmp, 0, p.col_first)
            for k in entries:
                div[k] = T.ieee_add(tmp[0], T.float32(eps))
        else:
            for k in entries:
                tmp[k] = x[at + k]
                row_sum(tmp, k, p.row_first)
                div[k] = padded(p, k, T.ieee_add(tmp[k], T.float32(eps)), T.float32(1))

    @T.macro
    def walk_back(g, x, at, div, tmp, p, axis):
        if axis == 0:
            tmp[0] = T.ieee_mul(g[0], x[at])
            for k in entries[1:]:
                tmp[0] = T.ieee_add(tmp[0], T.ieee_mul(g[k], x[at + k]))
            col_sum(tmp, 0, p.col_first)
            for k in entries:
                g[k] = T.ieee_fdiv(T.ieee_sub(g[k], tmp[0]), div[k])
        else:
            for k in entries:
                tmp[k] = T.ieee_mul(g[k], x[at + k])
                row_sum(tmp, k, p.row_first)
                g[k] = T.ieee_fdiv(T.ieee_sub(g[k], tmp[k]), div[k])

    @T.macro
    def softmax_back(g, probs, tmp, p):
        for k in entries:
            tmp[k] = T.ieee_mul(g[k], probs[k])
            row_sum(tmp, k, p.row_first)
            g[k] = T.ieee_mul(probs[k], T.ieee_sub(g[k], tmp[k]))

    return SinkhornLanes(load_logits, softmax, divisors, walk_back, softmax_back, mix, padded)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_split_sinkhorn_kernel(n: int, iters: int, pre_eps: float, post_mult: float, eps: float):
    """``(mixes_TM, scale_3, base_M, pre_TN, post_TN, comb_TNN)`` kernel (all float32)."""
    num_tokens = T.dynamic("num_tokens")
    m = n * (n + 2)
    lay = lanes_for(n)
    lanes = sinkhorn_lanes(lay, eps)
    entries = list(range(lay.rows))

    @T.macro
    def normalize(x, div, tmp, p, axis):
        lanes.divisors(x, 0, div, tmp, p, axis)
        for k in entries:
            x[k] = T.ieee_fdiv(x[k], div[k])

    @T.prim_func
    def split_sinkhorn_kernel(
        mixes_TM: T.Tensor[(num_tokens, m), T.float32],
        scale_3: T.Tensor[(3,), T.float32],
        base_M: T.Tensor[(m,), T.float32],
        pre_TN: T.Tensor[(num_tokens, n), T.float32],
        post_TN: T.Tensor[(num_tokens, n), T.float32],
        comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tokens_per_cta(lay)), threads=THREADS) as cta:
            p = place(lay, cta, T.get_thread_binding(), num_tokens)
            row = row_of(num_tokens, p)
            a = T.alloc_local((lay.rows,), T.float32)
            x = T.alloc_local((lay.rows,), T.float32)
            probs = T.alloc_local((lay.rows,), T.float32)
            div = T.alloc_local((lay.rows,), T.float32)
            tmp = T.alloc_local((lay.rows,), T.float32)
            sig = T.alloc_local((1,), T.float32)
            lanes.load_logits(mixes_TM, scale_3, base_M, row, p, a)
            for mix, takes in sigmoid_mixes(lay, p):
                if T.And(p.active, takes):
                    sig[0] = sigmoid(T.ieee_add(T.ieee_mul(mixes_TM[row, mix], scale_3[mix // n]), base_M[mix]))
                    if mix < n:
                        pre_TN[row, mix] = T.ieee_add(sig[0], T.float32(pre_eps))
                    else:
                        post_TN[row, mix - n] = T.ieee_mul(T.float32(post_mult), sig[0])
            lanes.softmax(a, probs, x, tmp, p)
            normalize(x, div, tmp, p, 0)
            for _ in T.serial(iters - 1):
                normalize(x, div, tmp, p, 1)
                normalize(x, div, tmp, p, 0)
            if p.active:
                for k in entries:
                    if lay.real(p.r, k):
                        comb_TNN[row, p.r + lay.groups * k, p.c] = x[k]

    return split_sinkhorn_kernel


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_split_sinkhorn_backward_kernel(n: int, iters: int, post_mult: float, eps: float):
    """``(mixes_TM, scale_3, base_M, g_pre_TN, g_post_TN, g_comb_TNN, grad_mixes_TM, partial_CP)``
    kernel (all float32): ``partial_CP[c]`` holds CTA ``c``'s sums of ``da`` per mix, then of ``da *
    mixes`` over the pre, post and comb mixes."""
    num_tokens = T.dynamic("num_tokens")
    num_ctas = T.dynamic("num_ctas")
    m = n * (n + 2)
    lay = lanes_for(n)
    lanes = sinkhorn_lanes(lay, eps)
    entries = list(range(lay.rows))
    # (offset of the step's input in the history, axis): a column normalization first
    steps = [(s * lay.rows, s % 2) for s in range(2 * iters - 1)]
    history = (len(steps) + 1) * lay.rows  # the first step's input, then each step's output
    cta_tokens = tokens_per_cta(lay)

    @T.macro
    def finish(mixes_TM, scale_3, grad_mixes_TM, da_S, dam_S, p, row, mix, part, da):
        """A mix's ``da``: ``grad_mixes = da * scale``; ``da`` and ``da * mixes`` for the CTA's sums."""
        if p.active:
            grad_mixes_TM[row, mix] = T.ieee_mul(da, scale_3[part])
        da_S[p.slot, mix] = da
        dam_S[p.slot, mix] = T.ieee_mul(da, mixes_TM[row, mix])

    @T.prim_func
    def split_sinkhorn_backward_kernel(
        mixes_TM: T.Tensor[(num_tokens, m), T.float32],
        scale_3: T.Tensor[(3,), T.float32],
        base_M: T.Tensor[(m,), T.float32],
        g_pre_TN: T.Tensor[(num_tokens, n), T.float32],
        g_post_TN: T.Tensor[(num_tokens, n), T.float32],
        g_comb_TNN: T.Tensor[(num_tokens, n, n), T.float32],
        grad_mixes_TM: T.Tensor[(num_tokens, m), T.float32],
        partial_CP: T.Tensor[(num_ctas, m + 3), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, cta_tokens), threads=THREADS) as cta:
            if n in EIGHT_CTAS_AN_SM:
                T.annotate_min_blocks_per_sm(8)
            tid = T.get_thread_binding()
            p = place(lay, cta, tid, num_tokens)
            row = row_of(num_tokens, p)
            a = T.alloc_local((lay.rows,), T.float32)
            probs = T.alloc_local((lay.rows,), T.float32)
            g = T.alloc_local((lay.rows,), T.float32)
            tmp = T.alloc_local((lay.rows,), T.float32)
            xs = T.alloc_local((history,), T.float32)
            div = T.alloc_local((lay.rows,), T.float32)
            sig = T.alloc_local((1,), T.float32)
            da = T.alloc_local((1,), T.float32)
            sums = T.alloc_local((2,), T.float32)
            da_S = T.alloc_shared((cta_tokens, m), T.float32)
            dam_S = T.alloc_shared((cta_tokens, m), T.float32)

            lanes.load_logits(mixes_TM, scale_3, base_M, row, p, a)
            for k in entries:
                g[k] = lanes.padded(p, k, g_comb_TNN[row, p.r + lay.groups * k, p.c], T.float32(0))
            for mix, takes in sigmoid_mixes(lay, p):
                if T.And(p.used, takes):
                    sig[0] = sigmoid(T.ieee_add(T.ieee_mul(mixes_TM[row, mix], scale_3[mix // n]), base_M[mix]))
                    da[0] = T.if_then_else(mix < n, g_pre_TN[row, mix],
                                           T.ieee_mul(g_post_TN[row, mix - n], T.float32(post_mult)))
                    da[0] = T.ieee_mul(T.ieee_mul(da[0], sig[0]), T.ieee_sub(T.float32(1), sig[0]))
                    finish(mixes_TM, scale_3, grad_mixes_TM, da_S, dam_S, p, row, mix, mix // n, da[0])
            # The forward again, keeping each normalization's output.
            lanes.softmax(a, probs, xs, tmp, p)
            for at, axis in steps:
                lanes.divisors(xs, at, div, tmp, p, axis)
                for k in entries:
                    xs[at + lay.rows + k] = T.ieee_fdiv(xs[at + k], div[k])
            # ... and back, each divisor again from the step's input.
            for at, axis in reversed(steps):
                lanes.divisors(xs, at, div, tmp, p, axis)
                lanes.walk_back(g, xs, at + lay.rows, div, tmp, p, axis)
            lanes.softmax_back(g, probs, tmp, p)
            for k in entries:
                if T.And(p.used, lay.real(p.r, k)):
                    finish(mixes_TM, scale_3, grad_mixes_TM, da_S, dam_S, p, row, lanes.mix(p, k), 2, g[k])
            # The CTA's sums over its tokens, in token order.
            T.sync_threads()
            first = cta * cta_tokens
            if tid < m:
                sums[0] = T.float32(0)
                sums[1] = T.float32(0)
                for t in T.serial(cta_tokens):
                    if first + t < num_tokens:
                        sums[0] = T.ieee_add(sums[0], da_S[t, tid])
                        sums[1] = T.ieee_add(sums[1], dam_S[t, tid])
                partial_CP[cta, tid] = sums[0]
                dam_S[0, tid] = sums[1]  # (only this thread read column tid)
            T.sync_threads()
            if tid < 3:
                sums[0] = T.float32(0)
                for mix in T.serial(tid * n, T.if_then_else(tid == 2, m, tid * n + n)):
                    sums[0] = T.ieee_add(sums[0], dam_S[0, mix])
                partial_CP[cta, m + tid] = sums[0]

    return split_sinkhorn_backward_kernel


def supports(mixes_TM: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor) -> bool:
    """True when the kernels take these: float32 everywhere (float64 stays with the reference) and
    up to :data:`MAX_STREAMS` streams (``base_M`` has ``N (N + 2)`` entries; anything else goes to
    the reference, which names the error)."""
    m = base_M.numel()
    return (all(x.dtype == torch.float32 for x in (mixes_TM, scale_3, base_M))
            and any(n * (n + 2) == m for n in range(1, MAX_STREAMS + 1)))


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
                            sinkhorn_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_mixes_TM, grad_scale_3, grad_base_M)`` given the outputs' gradients, float32: one
    kernel, then one ``sum(0)`` over its CTAs' partial sums."""
    check_cuda("mixes_TM", mixes_TM)
    t, m = mixes_TM.shape
    n = streams_of(m)
    grad_mixes_TM = torch.empty((t, m), dtype=torch.float32, device=mixes_TM.device)
    partial_CP = torch.empty((-(-t // tokens_per_cta(lanes_for(n))), m + 3), dtype=torch.float32,
                             device=mixes_TM.device)
    if t:
        kernel = get_split_sinkhorn_backward_kernel(n, iters, float(post_mult), float(sinkhorn_eps))
        kernel(mixes_TM.contiguous(), scale_3.contiguous(), base_M.contiguous(), g_pre_TN.float().contiguous(),
               g_post_TN.float().contiguous(), g_comb_TNN.float().contiguous(), grad_mixes_TM, partial_CP)
    sums_P = partial_CP.sum(0)
    return grad_mixes_TM, sums_P[m:], sums_P[:m]


def streams_of(m: int) -> int:
    """``N`` from ``M = N (N + 2)`` mixes."""
    n = int((m + 1) ** 0.5) - 1
    if n * (n + 2) != m:
        raise ValueError(f"mixes_TM: expected N * (N + 2) columns, got {m}")
    return n
