"""TileLang kernels of the Engram gate's backward (:func:`kernels.engram.reference.gate`'s
gradients): one pass over the tokens for ``grad_x``, ``grad_k`` and ``grad_v`` with per-CTA
partial sums of the weights' gradients, then a reduce of those partials (``get_weight_grad_kernel``).
:mod:`kernels.engram.gate_kernel` has the forward and the row helpers both use.

Shape suffixes (as in :mod:`kernels.engram.reference`): T tokens, N mHC streams, D hidden size.
"""

import itertools
import math
from typing import NamedTuple

import tilelang
import torch
from tilelang import language as T

from kernels.engram.gate_kernel import check_supported, gate_value
from kernels.engram.reference import check_gate_args
from kernels.tiles import (
    HAND_SYNC_PASS_CONFIGS,
    PASS_CONFIGS,
    aligned,
    check_cuda,
    sm_count,
    tl_dtype,
    vector_width,
)
from kernels.rows import WARP, vector_cp_async
from kernels.validate import check_tensor


class BackwardPlan(NamedTuple):
    """How the backward spreads over a CTA: each of the ``n`` streams gets ``warps_per_stream``
    warps, whose threads own ``per_thread`` vectors of that stream (``vec`` elements, 16 bytes of
    ``x``'s dtype or fewer; thread ``l`` of a stream vectors ``l, l + lanes, ...``), ``tile`` of them
    a pipeline step, through a ring of ``stages`` slots; ``w_resident`` keeps ``w = wh * we`` in
    shared memory (float32, multiplied once a CTA) for the whole kernel instead of streaming it
    (float32, the wrapper's one product) through the ring with ``x`` and ``k``; with
    ``g_buffers = 2`` the next token's ``g`` loads while this one's is read."""

    n: int
    vec: int
    nv: int
    warps_per_stream: int
    per_thread: int
    tile: int
    stages: int
    w_resident: bool
    g_buffers: int = 2

    @property
    def lanes(self) -> int:
        return self.warps_per_stream * WARP

    @property
    def threads(self) -> int:
        return self.n * self.lanes

    @property
    def tiles(self) -> int:
        return -(-self.per_thread // self.tile)

    def shared_bytes(self, dtype: torch.dtype, k_dtype: torch.dtype, v_dtype: torch.dtype) -> int:
        """``g_buffers`` tokens' ``g`` (every stream), a token's ``v``, ``w`` if resident (float32),
        the ring (and ``w`` in it, float32, where not resident), the partials."""
        n, d = self.n, self.nv * self.vec
        per_column = dtype.itemsize + k_dtype.itemsize + 4 * (not self.w_resident)
        ring = self.stages * n * self.tile * self.lanes * self.vec * per_column
        rows = d * (self.g_buffers * n * dtype.itemsize + v_dtype.itemsize + 4 * n * self.w_resident)
        return rows + ring + 4 * n * (self.warps_per_stream + 2)


# On an H200 (T = 8192, N = 4, D = 4096 / 7168; 8 / 16 warps): one g buffer, w resident and 2 stages
# (what fits beside w at 7168) 435.7 / 707.6 us; two g buffers, 3 stages, w resident at 4096 and
# streamed at 7168 (two g buffers and w resident do not fit there) 378.1 / 659.8 us in one probe
# (91.2 / 91.5% of copy; the next token's g no longer loads behind the token's last barrier). At 4096 two g buffers
# with 2 stages took 381.5 us and 3 stages with one g buffer 433.0; streaming wh and we through the
# ring (12 bytes a column, so 2 stages) instead of their product took 724.9 us at 7168.
BACKWARD_WARPS = 8  # a CTA's warps, shared out among the streams (at least one each)
# ... doubled (once) while a thread would hold more weight gradients than this: at D = 7168 eight
# warps leave 112 a thread, 255 registers with spills, 722.6 us on an H200; sixteen leave 56, 128
# registers and no spill, 709.9 us (tile-kernels 679.1). At D = 4096 eight leave 64 (435.9 us;
# sixteen, 460.0).
SPILL_FREE_ACCUMULATORS = 64
BACKWARD_TILE = 2  # vectors a thread stages a pipeline step
BACKWARD_STAGES = 3
BACKWARD_W_RESIDENT = True
BACKWARD_G_BUFFERS = 2
# The weight gradients' registers: at most half the SM's register file, and 128 a thread.
ACCUMULATOR_REGISTERS, THREAD_ACCUMULATORS = 32768, 128


def backward_plan(
    x_TND: torch.Tensor, k_TND: torch.Tensor, v_TD: torch.Tensor, *,
    warps: int | None = None, tile: int = BACKWARD_TILE, stages: int = BACKWARD_STAGES,
    w_resident: bool = BACKWARD_W_RESIDENT, g_buffers: int = BACKWARD_G_BUFFERS, shared_memory: int | None = None,
) -> BackwardPlan | None:
    """The backward's :class:`BackwardPlan` for these inputs, or None where the kernel cannot take
    them: a vector under 4 bytes (``cp.async``'s least: 2-byte dtypes need an even D), more
    weight-gradient registers than :data:`ACCUMULATOR_REGISTERS` allows, or more shared memory than
    a CTA gets (``shared_memory`` bytes; by default what their device gives one). The options are
    preferences, given up until the CTA fits: fewer stages first, then a smaller tile, then ``w``
    resident or not, then the number of ``g`` buffers."""
    _, n, d = x_TND.shape
    vec = vector_width(d, x_TND.dtype.itemsize)
    if d == 0 or any(vec * t.dtype.itemsize < 4 for t in (x_TND, k_TND, v_TD)):
        return None
    def accumulators(warps: int) -> int:  # weight gradients a thread holds with ``warps`` a CTA
        return -(-(d // vec) // (max(1, warps // n) * WARP)) * vec

    if warps is None:  # BACKWARD_WARPS, or twice that where a thread would hold too many weight gradients
        warps = BACKWARD_WARPS * (2 if accumulators(BACKWARD_WARPS) > SPILL_FREE_ACCUMULATORS else 1)
    warps_per_stream = max(1, warps // n)
    lanes = warps_per_stream * WARP
    per_thread = accumulators(warps) // vec
    if n * lanes > 1024 or per_thread * vec > min(THREAD_ACCUMULATORS, ACCUMULATOR_REGISTERS // (n * lanes)):
        return None
    limit = shared_memory or torch.cuda.get_device_properties(x_TND.device).shared_memory_per_block_optin
    for buffers, resident in itertools.product((g_buffers, 3 - g_buffers), (w_resident, not w_resident)):
        for t in range(min(tile, per_thread), 0, -1):
            for s in range(min(stages, -(-per_thread // t) + 1), 1, -1):
                plan = BackwardPlan(n, vec, d // vec, warps_per_stream, per_thread, t, s, resident, buffers)
                if plan.shared_bytes(x_TND.dtype, k_TND.dtype, v_TD.dtype) <= limit:
                    return plan
    return None


@tilelang.jit(pass_configs=HAND_SYNC_PASS_CONFIGS)  # barriers explicit: two a token, three with one g buffer
def get_gate_backward_kernel(
    n: int, d: int, dtype: str, k_dtype: str, v_dtype: str, w_dtype: str, clamp: float, add_residual: bool,
    warps_per_stream: int = 2, tile: int = BACKWARD_TILE, stages: int = BACKWARD_STAGES,
    w_resident: bool = BACKWARD_W_RESIDENT, g_buffers: int = BACKWARD_G_BUFFERS,
):
    """``(x_TND, k_TND, v_TD, wh_ND, we_ND, g_TND, stats_TN3, grad_x_TND, grad_k_TND, grad_v_TD,
    grad_w_CND)`` kernel with ``w_resident`` (``wh``, ``we`` of ``w_dtype``, multiplied here into
    the reference's float32 ``w``), else ``(x_TND, k_TND, v_TD, w_ND, g_TND, ...)`` (``w_ND``: that
    product, float32, made once by the wrapper); ``stats_TN3`` is the forward's ``(rstd_x, rstd_k,
    raw)``. It computes the gradients of the gate
    (:func:`kernels.engram.reference._gate_bwd`'s formulas), the weights' as ``grad_w_CND[c] = sum
    over CTA c's tokens of dL/draw * x * k`` (float32; :func:`get_weight_grad_kernel` sums over
    ``C`` and multiplies by ``we`` and ``wh``). The layout is :class:`BackwardPlan`'s.

    A persistent grid of ``C`` CTAs (``C`` <= tokens), CTA ``c`` taking tokens ``c, c + C, ...``;
    each thread keeps the weight gradients of its columns in registers, so ``x`` and ``k`` are read
    once. Per token:

    1. before the first barrier, each thread derives its stream's gate and every coefficient but
       ``dL/dgate`` from the row statistics it loaded a token ahead (chains of IEEE divisions and
       roots: behind the barrier, or for every stream, they cost up to 13%);
    2. the token's ``g`` (every stream) and ``v``, staged in shared memory by ``cp.async`` during
       the token before, give each stream's ``dL/dgate = sum g*v`` (warp shuffles, then the
       stream's warps in order); a second barrier, and the next token's ``v`` starts loading
       (into the one ``v`` buffer), and with two ``g`` buffers its ``g`` into the other (the
       residual below still reads this one; ``g`` read again from L2 instead came from memory:
       1076 vs 964 us at D = 7168); with one, its ``g`` loads after a third barrier at the token's
       end;
    3. the stream's ``x`` and ``k`` (and ``w`` unless resident) stream through a ring of
       ``stages`` slots, ``tile`` vectors a thread a slot, ``stages - 1`` slots ahead and on into
       the next token; each thread stages only what it reads back, so the ring needs
       ``cp.async.wait_group`` and no barrier. ``grad_x``, ``grad_k`` are stored from registers,
       and ``grad_v = sum_h gate_h g_h`` from the staged ``g``, a share of it a step.

    The per-element arithmetic may contract into FMAs (the gradients are held to a reassociation
    bound, not bits)."""
    num_tokens = T.dynamic("num_tokens")
    num_ctas = T.dynamic("num_ctas")
    vec = vector_width(d, T.dtype(dtype).bytes)
    nv = d // vec
    lanes = warps_per_stream * WARP
    threads = n * lanes
    per_thread = -(-nv // lanes)
    tiles = -(-per_thread // tile)
    block = tile * lanes * vec  # a stream's columns a ring slot
    rounds = -(-nv // threads)  # grad_v's vectors a thread
    gate_of = gate_value(d, clamp)

    fetch_x, fetch_k, fetch_v, fetch_w = (vector_cp_async(vec, T.dtype(t).bytes)
                                          for t in (dtype, k_dtype, v_dtype, T.float32))

    @T.macro
    def stage_g(g_TND, g_tok, row, buf, tid):
        """The token's g (all streams) into g_tok[buf], spread over all threads."""
        for r in T.unroll(-(-n * nv // threads)):
            f = r * threads + tid
            if f < n * nv:
                fetch_x(g_tok[buf, f // nv, f % nv * vec], g_TND[row, f // nv, f % nv * vec])

    @T.macro
    def stage_v(v_TD, v_tok, row, tid):
        """The token's v into v_tok, spread over all threads."""
        for r in T.unroll(-(-nv // threads)):
            c = r * threads + tid
            if c < nv:
                fetch_v(v_tok[c * vec], v_TD[row, c * vec])

    @T.macro
    def stage_tile(sources, ring, row, j, slot, h, lane):
        """Step j's vectors of this thread's stream into ring slot ``slot`` (no commit):
        ``sources = (x_TND, k_TND, w_ND)`` (``w_ND`` None where resident), ``ring`` their slots."""
        x_TND, k_TND, w_ND = sources
        x_ring, k_ring, w_ring = ring
        for q in T.unroll(tile):
            c = (j * tile + q) * lanes + lane
            if j * tile + q < per_thread and c < nv:
                s = (q * lanes + lane) * vec
                fetch_x(x_ring[slot, h, s], x_TND[row, h, c * vec])
                fetch_k(k_ring[slot, h, s], k_TND[row, h, c * vec])
                if not w_resident:
                    fetch_w(w_ring[slot, h, s], w_ND[h, c * vec])

    @T.macro
    def step(sources, ring, token, outputs, grad_w, locals_, coefs, i, j, row, following, num_tokens, tid, wait):
        """Pipeline step j of the CTA's i-th token: stage the step ``stages - 1`` ahead (into
        the next token past the last); its share of ``grad_v`` (``token = (w_all, g_tok,
        gates_N)``), which needs no slot; wait for step j's slot, then its gradients into
        ``outputs = (grad_x_TND, grad_k_TND, grad_v_TD)`` and ``grad_w`` (``locals_``: scratch
        vectors; ``g`` for the residual from ``g_tok``)."""
        x_ring, k_ring, w_ring = ring
        w_all, g_tok, gates_N = token
        grad_x_TND, grad_k_TND, grad_v_TD = outputs
        xf, kf, wf, out_x, out_k, out_v = locals_
        h, lane = tid // lanes, tid % lanes
        ahead = j + stages - 1
        if ahead < tiles:
            stage_tile(sources, ring, row, ahead, (i * tiles + ahead) % stages, h, lane)
        elif following < num_tokens:
            stage_tile(sources, ring, following, ahead - tiles, (i * tiles + ahead) % stages, h, lane)
        T.ptx_commit_group()
        for r in T.unroll(rounds):  # grad_v's rounds spread over the steps
            c = r * threads + tid
            if r * tiles // rounds == j and c < nv:
                for e in T.serial(vec):
                    xf[e] = T.float32(0)
                    for hh in T.unroll(n):
                        xf[e] += gates_N[i % 2, hh] * T.cast(g_tok[i % g_buffers, hh, c * vec + e], T.float32)
                    out_v[e] = T.cast(xf[e], v_dtype)
                for e in T.vectorized(vec):
                    grad_v_TD[row, c * vec + e] = out_v[e]
        T.ptx_wait_group(wait)
        slot = (i * tiles + j) % stages
        for q in T.unroll(tile):
            p = j * tile + q
            c = p * lanes + lane
            if p < per_thread and c < nv:
                s = (q * lanes + lane) * vec
                for e in T.vectorized(vec):
                    xf[e] = T.cast(x_ring[slot, h, s + e], T.float32)
                for e in T.vectorized(vec):
                    kf[e] = T.cast(k_ring[slot, h, s + e], T.float32)
                for e in T.vectorized(vec):
                    wf[e] = w_all[h, c * vec + e] if w_resident else w_ring[slot, h, s + e]
                for e in T.serial(vec):
                    dx = coefs[1] * (wf[e] * kf[e] - xf[e] * coefs[2])
                    residual = T.cast(g_tok[i % g_buffers, h, c * vec + e], T.float32)
                    out_x[e] = T.cast(dx + residual if add_residual else dx, dtype)
                    out_k[e] = T.cast(coefs[1] * (wf[e] * xf[e] - kf[e] * coefs[3]), k_dtype)
                    grad_w[p * vec + e] += coefs[1] * xf[e] * kf[e]
                for e in T.vectorized(vec):
                    grad_x_TND[row, h, c * vec + e] = out_x[e]
                for e in T.vectorized(vec):
                    grad_k_TND[row, h, c * vec + e] = out_k[e]

    @T.macro
    def backward(x_TND, k_TND, v_TD, weights, g_TND, stats_TN3, grad_x_TND, grad_k_TND, grad_v_TD, grad_w_CND):
        """The kernel's body; ``weights``: ``(wh_ND, we_ND)`` where ``w`` is resident, else ``(w_ND,)``."""
        with T.Kernel(num_ctas, threads=threads) as cta:
            tid = T.get_thread_binding()
            h = tid // lanes  # this thread's stream
            lane = tid % lanes
            g_tok = T.alloc_shared((g_buffers, n, d), dtype)  # two: the next token lands while this one is read
            v_tok = T.alloc_shared((d,), v_dtype)
            w_all = T.alloc_shared((n, d) if w_resident else (1, 1), T.float32)
            x_ring = T.alloc_shared((stages, n, block), dtype)
            k_ring = T.alloc_shared((stages, n, block), k_dtype)
            w_ring = T.alloc_shared((1, 1, 1) if w_resident else (stages, n, block), T.float32)
            wh_local = T.alloc_local((vec,), w_dtype)
            we_local = T.alloc_local((vec,), w_dtype)
            partial_NW = T.alloc_shared((n, warps_per_stream), T.float32)
            grad_w = T.alloc_local((per_thread * vec,), T.float32)
            gates_N = T.alloc_shared((2, n), T.float32)  # the token's gates for grad_v, by token parity
            own = T.alloc_local((3,), T.float32)  # this thread's stream's (rstd_x, rstd_k, raw), a token ahead
            coefs = T.alloc_local((4,), T.float32)  # gate, dL/draw, raw rstd_x^2 / D, raw rstd_k^2 / D
            dgate = T.alloc_local((1,), T.float32)
            xf = T.alloc_local((vec,), T.float32)
            kf = T.alloc_local((vec,), T.float32)
            wf = T.alloc_local((vec,), T.float32)
            out_x = T.alloc_local((vec,), dtype)
            out_k = T.alloc_local((vec,), k_dtype)
            out_v = T.alloc_local((vec,), v_dtype)

            sources, ring = (x_TND, k_TND, None if w_resident else weights[0]), (x_ring, k_ring, w_ring)
            token, outputs = (w_all, g_tok, gates_N), (grad_x_TND, grad_k_TND, grad_v_TD)
            locals_ = (xf, kf, wf, out_x, out_k, out_v)
            # Prologue: the first token's g and v as one group, its first steps one group each,
            # then empty groups: the count a token start waits past is always ``tiles``.
            first = T.Cast(T.int64, cta)
            stage_g(g_TND, g_tok, first, 0, tid)
            stage_v(v_TD, v_tok, first, tid)
            T.ptx_commit_group()
            for j in T.unroll(stages - 1):
                stage_tile(sources, ring, first, j, j, h, lane)
                T.ptx_commit_group()
            for _ in T.unroll(tiles - (stages - 1)):
                T.ptx_commit_group()
            if w_resident:  # w = wh * we, each thread its own columns (it alone reads them), while those land
                wh_ND, we_ND = weights
                for p in T.unroll(per_thread):
                    c = p * lanes + lane
                    if c < nv:
                        for e in T.vectorized(vec):
                            wh_local[e] = wh_ND[h, c * vec + e]
                        for e in T.vectorized(vec):
                            we_local[e] = we_ND[h, c * vec + e]
                        for e in T.serial(vec):
                            w_all[h, c * vec + e] = T.ieee_mul(T.cast(wh_local[e], T.float32),
                                                               T.cast(we_local[e], T.float32))
            for e in T.unroll(per_thread * vec):
                grad_w[e] = T.float32(0)
            for q in T.unroll(3):
                own[q] = stats_TN3[first, h, q]
            for i in T.serial(T.ceildiv(num_tokens - cta, num_ctas)):
                row = T.Cast(T.int64, cta + i * num_ctas)
                following = row + num_ctas
                # The stream's coefficients but dL/dgate, from its statistics (loaded a token
                # ahead): scalar chains of IEEE divisions and roots, done once a thread and before
                # the barrier, so that after the reduction one product is left.
                rstd_x, rstd_k, raw = own[0], own[1], own[2]
                gate_of(raw, rstd_x, rstd_k, coefs, 0)
                scale = T.ieee_fdiv(T.ieee_mul(rstd_x, rstd_k), T.float32(math.sqrt(d)))  # dot = raw * scale
                live = T.abs(T.ieee_mul(raw, scale)) >= T.float32(clamp)
                root = T.ieee_fsqrt(T.ieee_fdiv(scale, T.if_then_else(live, T.abs(raw), T.float32(1))))
                slope = T.ieee_mul(T.ieee_mul(coefs[0], T.ieee_sub(T.float32(1), coefs[0])), T.float32(0.5))
                coefs[1] = T.if_then_else(live, T.ieee_mul(slope, root), T.float32(0))  # dL/draw per dL/dgate
                coefs[2] = T.ieee_fdiv(T.ieee_mul(raw, T.ieee_mul(rstd_x, rstd_x)), T.float32(d))
                coefs[3] = T.ieee_fdiv(T.ieee_mul(raw, T.ieee_mul(rstd_k, rstd_k)), T.float32(d))
                if lane == 0:
                    gates_N[i % 2, h] = coefs[0]
                T.ptx_wait_group(tiles if g_buffers == 2 else 0)  # one buffer: g/v's group is the newest
                T.sync_threads()  # every thread's part of g_tok / v_tok has landed
                dgate[0] = T.float32(0)
                for p in T.unroll(per_thread):
                    c = p * lanes + lane
                    if c < nv:
                        for e in T.serial(vec):
                            gf = T.cast(g_tok[i % g_buffers, h, c * vec + e], T.float32)
                            dgate[0] += gf * T.cast(v_tok[c * vec + e], T.float32)
                dgate[0] = T.warp_reduce_sum(dgate[0])
                if tid % WARP == 0:
                    partial_NW[h, lane // WARP] = dgate[0]
                # The partials are written; gates_N, v_tok and the other g_tok buffer (the token
                # before's) read by every thread: the next token may land (one buffer: after the
                # residual has read this token's).
                T.sync_threads()
                if following < num_tokens:
                    for q in T.unroll(3):
                        own[q] = stats_TN3[following, h, q]
                    stage_v(v_TD, v_tok, following, tid)
                    if g_buffers == 2:
                        stage_g(g_TND, g_tok, following, (i + 1) % 2, tid)
                T.ptx_commit_group()
                dgate[0] = partial_NW[h, 0]
                for w in T.unroll(1, warps_per_stream):
                    dgate[0] += partial_NW[h, w]
                coefs[1] = T.ieee_mul(dgate[0], coefs[1])  # dL/draw
                # Groups newer than step j's: stages - 1 steps, and the next token's g/v group
                # while j < stages - 1 (it was committed after those steps' groups).
                for j in T.unroll(stages - 1):
                    step(sources, ring, token, outputs, grad_w, locals_, coefs, i, j, row, following, num_tokens, tid,
                         stages)
                for j in T.unroll(stages - 1, tiles):
                    step(sources, ring, token, outputs, grad_w, locals_, coefs, i, j, row, following, num_tokens, tid,
                         stages - 1)
                if g_buffers == 1:
                    T.sync_threads()
                    if following < num_tokens:
                        stage_g(g_TND, g_tok, following, 0, tid)
                    T.ptx_commit_group()
            for p in T.unroll(per_thread):
                c = p * lanes + lane
                if c < nv:
                    for e in T.vectorized(vec):
                        grad_w_CND[cta, h, c * vec + e] = grad_w[p * vec + e]

    if w_resident:
        @T.prim_func
        def gate_backward_kernel(
            x_TND: T.Tensor[(num_tokens, n, d), dtype], k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
            v_TD: T.Tensor[(num_tokens, d), v_dtype], wh_ND: T.Tensor[(n, d), w_dtype],
            we_ND: T.Tensor[(n, d), w_dtype], g_TND: T.Tensor[(num_tokens, n, d), dtype],
            stats_TN3: T.Tensor[(num_tokens, n, 3), T.float32],
            grad_x_TND: T.Tensor[(num_tokens, n, d), dtype], grad_k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
            grad_v_TD: T.Tensor[(num_tokens, d), v_dtype], grad_w_CND: T.Tensor[(num_ctas, n, d), T.float32],
        ):
            backward(x_TND, k_TND, v_TD, (wh_ND, we_ND), g_TND, stats_TN3, grad_x_TND, grad_k_TND, grad_v_TD,
                     grad_w_CND)

        return gate_backward_kernel

    @T.prim_func
    def gate_backward_streamed_kernel(
        x_TND: T.Tensor[(num_tokens, n, d), dtype], k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
        v_TD: T.Tensor[(num_tokens, d), v_dtype], w_ND: T.Tensor[(n, d), T.float32],
        g_TND: T.Tensor[(num_tokens, n, d), dtype], stats_TN3: T.Tensor[(num_tokens, n, 3), T.float32],
        grad_x_TND: T.Tensor[(num_tokens, n, d), dtype], grad_k_TND: T.Tensor[(num_tokens, n, d), k_dtype],
        grad_v_TD: T.Tensor[(num_tokens, d), v_dtype], grad_w_CND: T.Tensor[(num_ctas, n, d), T.float32],
    ):
        backward(x_TND, k_TND, v_TD, (w_ND,), g_TND, stats_TN3, grad_x_TND, grad_k_TND, grad_v_TD, grad_w_CND)

    return gate_backward_streamed_kernel


ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # unit roundoff, times two


def backward_excess(grads: tuple, want: tuple) -> dict[str, float]:
    """How far each of :func:`gate_backward`'s ``(grad_x, grad_k, grad_v, grad_wh, grad_we)`` lies
    beyond its tolerance around the reference autograd's ``want`` (<= 0: within), by name. Per
    element the bound is ``2 u |want| + 1e-3 max |want|`` (``u`` of the gradient's dtype): the row
    statistics and the sums over D (and over tokens for ``wh``/``we``) are reassociated, which moves
    the gate by well under 1e-4 (the forward's bound), and the backward's slope ``gate (1 - gate) /
    2 sqrt(c / |raw|)`` amplifies it a little more. The GPU tests and the benchmark's check use it."""
    excess = {}
    for name, got, ref in zip(("x", "k", "v", "wh", "we"), grads, want):
        if ref.numel():
            bound = 2 * ULP[ref.dtype] * ref.double().abs() + 1e-3 * float(ref.double().abs().max()) + 1e-30
            excess[name] = float(((got.double() - ref.double()).abs() - bound).max())
    return excess


def backward_fits(x_TND: torch.Tensor, k_TND: torch.Tensor, v_TD: torch.Tensor) -> bool:
    """Whether the backward takes these inputs' shapes and dtypes on their device
    (:func:`backward_plan`): on a Hopper GPU with N = 4, D up to 8192 in bfloat16."""
    return backward_plan(x_TND, k_TND, v_TD) is not None


WEIGHT_GRAD_WARPS = 8  # a CTA's warps, which share out the partials' rows
WEIGHT_GRAD_UNROLL = 4  # rows a warp loads before adding them


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_weight_grad_kernel(m: int, w_dtype: str):
    """``(grad_w_CM, wh_M, we_M, grad_wh_M, grad_we_M)`` kernel over ``M = N * D`` flattened weights:
    ``grad_w = sum_c grad_w_CM[c]`` (float32; warp ``u`` of a CTA sums rows ``u, u + warps, ...`` in
    order, then the warps' sums are added in warp order), ``grad_wh = grad_w * we`` and ``grad_we =
    grad_w * wh``, float32 products rounded to ``w_dtype`` (the backward's epilogue in one launch,
    not a sum and two products)."""
    num_ctas = T.dynamic("num_ctas")
    vec = vector_width(m, 4)
    nv, warps, unroll = m // vec, WEIGHT_GRAD_WARPS, WEIGHT_GRAD_UNROLL

    @T.prim_func
    def weight_grad_kernel(
        grad_w_CM: T.Tensor[(num_ctas, m), T.float32],
        wh_M: T.Tensor[(m,), w_dtype],
        we_M: T.Tensor[(m,), w_dtype],
        grad_wh_M: T.Tensor[(m,), w_dtype],
        grad_we_M: T.Tensor[(m,), w_dtype],
    ):
        with T.Kernel(T.ceildiv(nv, WARP), threads=warps * WARP) as b:
            tid = T.get_thread_binding()
            warp, lane = tid // WARP, tid % WARP
            c = b * WARP + lane
            rows = T.alloc_local((unroll, vec), T.float32)
            acc = T.alloc_local((vec,), T.float32)
            sums = T.alloc_shared((warps, WARP * vec), T.float32)
            wh_local = T.alloc_local((vec,), w_dtype)
            we_local = T.alloc_local((vec,), w_dtype)
            out_h = T.alloc_local((vec,), w_dtype)
            out_e = T.alloc_local((vec,), w_dtype)
            for e in T.serial(vec):
                acc[e] = T.float32(0)
            if c < nv:
                for r in T.serial(T.ceildiv(num_ctas, warps * unroll)):
                    for u in T.unroll(unroll):  # the loads first, then the adds in row order
                        if (r * unroll + u) * warps + warp < num_ctas:
                            for e in T.vectorized(vec):
                                rows[u, e] = grad_w_CM[(r * unroll + u) * warps + warp, c * vec + e]
                    for u in T.unroll(unroll):
                        if (r * unroll + u) * warps + warp < num_ctas:
                            for e in T.serial(vec):
                                acc[e] = T.ieee_add(acc[e], rows[u, e])
            for e in T.vectorized(vec):
                sums[warp, lane * vec + e] = acc[e]
            T.sync_threads()
            if warp == 0 and c < nv:
                for u in T.unroll(1, warps):
                    for e in T.serial(vec):
                        acc[e] = T.ieee_add(acc[e], sums[u, lane * vec + e])
                for e in T.vectorized(vec):
                    wh_local[e] = wh_M[c * vec + e]
                for e in T.vectorized(vec):
                    we_local[e] = we_M[c * vec + e]
                for e in T.serial(vec):
                    out_h[e] = T.cast(T.ieee_mul(acc[e], T.cast(we_local[e], T.float32)), w_dtype)
                    out_e[e] = T.cast(T.ieee_mul(acc[e], T.cast(wh_local[e], T.float32)), w_dtype)
                for e in T.vectorized(vec):
                    grad_wh_M[c * vec + e] = out_h[e]
                for e in T.vectorized(vec):
                    grad_we_M[c * vec + e] = out_e[e]

    return weight_grad_kernel


def gate_backward(
    x_TND: torch.Tensor,
    k_TND: torch.Tensor,
    v_TD: torch.Tensor,
    wh_ND: torch.Tensor,
    we_ND: torch.Tensor,
    g_TND: torch.Tensor,
    stats_TN3: torch.Tensor,
    *,
    clamp: float = 1e-6,
    add_residual: bool = True,
    **plan_options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TileLang backward of :func:`kernels.engram.reference.gate`: ``(grad_x, grad_k, grad_v,
    grad_wh, grad_we)`` in the dtypes of their inputs, for ``g_TND = dL/dout`` (``x_TND``'s dtype)
    and the forward's row statistics ``stats_TN3`` (``gate(..., return_stats=True)``). Same inputs
    as :func:`gate`; ``plan_options`` (``warps``, ``tile``, ``stages``, ``w_resident``,
    ``g_buffers``) go to :func:`backward_plan` (tuning, bench/scripts/sweep.py; the defaults are
    measured)."""
    check_gate_args(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, 0.0, values=False)
    check_cuda("x_TND", x_TND)
    check_tensor("g_TND", g_TND, dtype=x_TND.dtype, shape=x_TND.shape, device=x_TND.device)
    check_tensor("stats_TN3", stats_TN3, dtype=torch.float32, shape=(*x_TND.shape[:2], 3), device=x_TND.device)
    check_supported(x_TND, k_TND, v_TD, wh_ND, we_ND)
    t, n, d = x_TND.shape
    if t * n * d == 0:
        contiguous = dict(memory_format=torch.contiguous_format)
        zeros = torch.zeros_like(wh_ND, **contiguous)
        return (torch.empty_like(x_TND, **contiguous), torch.empty_like(k_TND, **contiguous),
                torch.zeros_like(v_TD, **contiguous), zeros, zeros.clone())
    plan = backward_plan(x_TND, k_TND, v_TD, **plan_options)
    if plan is None:
        raise ValueError(
            f"x_TND: N = {n}, D = {d} in {x_TND.dtype} (k {k_TND.dtype}, v {v_TD.dtype}) is beyond the backward "
            "kernel: a thread's weight gradients must fit its registers, the token's rows shared memory, and "
            "every vector 4 bytes (use kernels.engram.reference.gate)"
        )
    grad_x = torch.empty_like(x_TND, memory_format=torch.contiguous_format)
    grad_k = torch.empty_like(k_TND, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v_TD, memory_format=torch.contiguous_format)
    grad_w_CND = torch.empty((min(t, sm_count(x_TND.device)), n, d), dtype=torch.float32, device=x_TND.device)
    dtypes = [tl_dtype(a.dtype) for a in (x_TND, k_TND, v_TD, wh_ND)]
    wh_ND, we_ND = aligned(wh_ND), aligned(we_ND)
    # streamed, w is the float32 product the resident layout makes in shared memory
    weights = [wh_ND, we_ND] if plan.w_resident else [wh_ND.float() * we_ND.float()]
    args = [aligned(a) for a in (x_TND, k_TND, v_TD)] + weights + [aligned(g_TND), stats_TN3.contiguous()]
    kernel = get_gate_backward_kernel(n, d, *dtypes, float(clamp), bool(add_residual), plan.warps_per_stream,
                                      plan.tile, plan.stages, plan.w_resident, plan.g_buffers)
    kernel(*args, grad_x, grad_k, grad_v, grad_w_CND)
    grad_wh, grad_we = torch.empty_like(wh_ND), torch.empty_like(we_ND)
    get_weight_grad_kernel(n * d, dtypes[3])(grad_w_CND.view(-1, n * d), wh_ND.view(-1), we_ND.view(-1),
                                             grad_wh.view(-1), grad_we.view(-1))
    return grad_x, grad_k, grad_v, grad_wh, grad_we
