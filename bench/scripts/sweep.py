"""Kernel variants side by side on one GPU (a tuning record, not a product benchmark): each variant
is checked against the op's reference on fresh inputs, then timed with ``ep-runtime bench
kernels``' timer next to the op as shipped, its tile-kernels peer and the copy ceiling, all in one
process. Variants are kernel factory options (tiles), so the winner becomes a default
and the rest go.

    python3 bench/scripts/sweep.py --out $OUT/sweep.json [--ops per_token_cast,cast_back,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch

from ep_runtime.bench import kernels as bench
from kernels.mhc.pre_apply_kernel import LOAD_PAST_L1

# (tile_m, tile_n, threads[, vec]), the variants measured last (kernels/quant/NOTES.md has every
# sweep): vec 16 gives each thread 32 bytes of bf16 in and one 16-byte e4m3 store out (8: 16 in, 8
# out). Session 8 tried tiles 2048-7168 columns wide: slower than the shipped ones everywhere.
TOKEN_TILES = [(1, 2048, 256), (1, 3584, 448), (1, 7168, 896), (2, 2048, 512)]
# for few rows (small; shipped since session 26: 64 x 128); session 26 (the warps' rows met by shuffles),
# paired rounds of GPU time: 64 x 128 2.50 us, 64 x 256 2.56, 128 x 256 2.66, 32 x 128 (then shipped)
# 2.69, 32 x 256 2.75, tile-kernels 2.59
CHANNEL_TILES = [(128, 64, 256), (128, 128, 256), (128, 32, 128), (128, 32, 256)]
# session 25 at 128 rows: 512 threads, and clusters of 2 CTAs sharing a block's rows, both slower
# (kernels/quant/NOTES.md)
BLOCK_TILES = [(128, 128, 512), (128, 128, 1024)]
# backward_plan options of the Engram gate backward (session 10's kernel: streams' warps, a ring of
# cp.async slots; shipped: 8 warps, tile 2, 2 stages, w resident, one g buffer where they fit);
# labelled by the plan each resolves to on the device
GATE_BACKWARD_PLANS = [dict(tile=1, stages=3), dict(g_buffers=2, tile=3), dict(g_buffers=2, stages=4), dict(tile=4)]
# session 9: per-token scales read from global memory (shipped, with the cast's tile) or staged in
# shared memory (the earlier default, with 16-row tiles from 4096 rows)
BACK_TILES = [(16, 1024, 128), (8, 1024, 128)]
# (tile_m, tile_n, threads[, vec]); session 25 at 128 tokens with the cast: (1, 1024, 256, 4), now shipped
# there, 2.21 us of GPU time against 8 values a thread's 2.43 ((1, 512, 64) 2.40, (1, 1024, 512, 2)
# 2.24), then 2.14 with the amax by one redux.sync a warp; session 26, paired: one CTA a 2048-wide row,
# (1, 2048, 512, 4), 2.11 against 2.16-2.18 (now shipped there), (1, 2048, 1024, 2) 2.25
SWIGLU_TILES = [(1, 1024, 256, 4), (1, 2048, 1024, 2)]
# pre-apply's (threads, load, store PTX qualifiers of its 16-byte moves); shipped: 128 threads, loads
# past L1 where a stream's row is a power of two of bytes, streaming stores, both staged in shared
# memory. Earlier (kernels/mhc/NOTES.md): sessions 27-28 tiles and CTAs an SM, none faster; session 29
# loads past L1 (won at power-of-two rows only); session 30 the staging with `.cs` stores (won at D =
# 7168, 185.65 against tile-kernels' 185.76 us). Here: no qualifiers, 256 threads, loads past L1 everywhere
PRE_APPLY_HINTS = [(128, "", ""), (256, "", ".cs"), (128, LOAD_PAST_L1, ".cs")]
TRANSPOSE_THREADS = [64, 256]  # the register transpose's CTA at [8, 16, 7168] bf16 (shipped: 128)
# its (bm, bn) elements a thread; session 25 with plain loads: (8, 8) 2.27, (8, 4) 2.27, (8, 2) 2.21, (4, 8)
# 2.34, (16, 2) 3.04 us of GPU time (torch.compile 2.14); session 31 with the L2 policy: (8, 8) 2.05 (now
# shipped), (8, 2) 2.11-2.13, (4, 2) 2.14, (8, 1) 2.53 (torch.compile 2.18)
TRANSPOSE_BLOCKS = [(8, 2), (8, 4), (4, 8)]
ROUTER_COUNT_CTAS_PER_SM = [4, None]  # None: one token a warp
EXPAND_CAST_TILES = [(1, 1024, 64, 16), (1, 2048, 256, 8), (1, 7168, 896, 8)]
# session 21: norm_fn on the tensor cores (bfloat16 streams); the CUDA-core kernels for comparison
NORM_FN_OPTIONS = [dict(stages=6), dict(block_k=256, stages=3)]  # shipped: 64 x 128, 4 stages
NORM_FN_PARTS_OPTIONS = [{}, dict(stages=3)]  # float32 / float16 streams (64-column chunks, 4 stages)
# shipped: 2 stages (kernels/mhc/NOTES.md has session 21's sweeps of stages, chunks, columns and stores)
NORM_FN_BACKWARD_OPTIONS = [dict(stages=1), dict(stages=3)]
# session 24: bytes of y a thread (shipped: 16); at 128 tokens the 16-byte grid fills a fifth of an H100
REDUCE_VECTOR_BYTES = [8, 4]
# session 27: CTAs an SM the registers are bounded for (16 bytes a thread: 88 / 96 registers, 3 CTAs of 224)
REDUCE_MIN_CTAS = [4]  # 5, 6: spills, slower (bench/results/h100/2026-11-26-s27/call3-*)
REDUCE_STAGED_BYTES = [16, 8]  # rows staged in shared memory by cp.async


def _cast_variant(x, block, tile):
    from kernels.quant.blockwise_cast_kernel import get_blockwise_cast_kernel

    (m, n), (bm, bn) = x.shape, block
    kernel = get_blockwise_cast_kernel(n, bm, bn, "bfloat16", False, False, tile[:3], tile[3] if len(tile) > 3 else None)

    def call():
        q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
        sf = torch.empty((-(-m // bm), -(-n // bn)), dtype=torch.float32, device=x.device)
        kernel(x, q, sf)
        return q, sf

    return call


def _cast_back_variant(q, sf, tile, staged, scales_in_l2=True):
    from kernels.quant.cast_back_kernel import get_cast_back_kernel

    kernel = get_cast_back_kernel(q.shape[1], 1, 128, False, "bfloat16", tile, staged, scales_in_l2)

    def call():
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        kernel(q, sf, out)
        return out

    return call


def _swiglu_variant(x, cast, tile):
    from kernels.quant.swiglu_kernel import get_swiglu_forward_kernel

    t, inter = x.shape[0], x.shape[1] // 2
    kernel = get_swiglu_forward_kernel(inter, "bfloat16", 128, cast, False, False, False, False, tile=tile[:3],
                                       vec=tile[3] if len(tile) > 3 else None)
    rows = torch.empty((1,), dtype=torch.int32, device=x.device)  # not read (no row limit)

    def call():
        out = torch.empty((t, inter), dtype=torch.float8_e4m3fn if cast else x.dtype, device=x.device)
        sf = torch.empty((t, -(-inter // 128)), dtype=torch.float32, device=x.device)
        kernel(x, out, sf, rows)
        return (out, sf) if cast else out

    return call


def _expand_cast_variant(x, layout, tile):
    from kernels.permute.expand_quant_kernel import get_expand_per_token_cast_kernel

    d, k = x.shape[1], layout.pos_TK.shape[1]
    kernel = get_expand_per_token_cast_kernel(d, k, "bfloat16", 128, False, False, tile=tile[:3], vec=tile[3])
    pos, src = layout.pos_TK.to(torch.int32), layout.src_P.to(torch.int32)

    def call():
        q = torch.empty((layout.num_rows, d), dtype=torch.float8_e4m3fn, device=x.device)
        sf = torch.empty((layout.num_rows, -(-d // 128)), dtype=torch.float32, device=x.device)
        kernel(x, pos, src, q, sf)
        return q, sf

    return call


def _weighted_reduce_variant(case, vector_bytes, min_ctas=None, staged=False):
    """The shipped op's call with ``vector_bytes`` of ``y`` a thread, registers bounded for ``min_ctas``
    CTAs an SM, rows ``staged`` in shared memory or not."""
    from kernels.quant.tiles import tl_dtype
    from kernels.reduce.weighted_reduce_kernel import get_weighted_reduce_kernel

    y, pos, weights, *sf = case.args
    sf = sf[0] if sf else torch.empty((y.shape[0], -(-y.shape[1] // 128)), dtype=torch.float32, device=y.device)
    kernel = get_weighted_reduce_kernel(y.shape[1], pos.shape[1], tl_dtype(y.dtype), tl_dtype(pos.dtype), "bfloat16",
                                        128, False, vector_bytes=vector_bytes, min_ctas=min_ctas,
                                        staged=staged)

    def call():
        out = torch.empty((pos.shape[0], y.shape[1]), dtype=torch.bfloat16, device=y.device)
        kernel(y, sf, pos, weights, out)
        return out

    return call


def _router_variant(inp, with_counts: bool, compact: bool = True, ctas_per_sm: int | None = None):
    """The DeepSeek-V3 router kernel, its kept groups ``compact`` or not, on a grid of at most
    ``ctas_per_sm`` CTAs an SM (None: one token a warp), called as the public op calls it."""
    from kernels.routing.topk_route_kernel import LOGIT_DTYPES, get_topk_route_kernel, grid_size

    s, logits, bias = inp.shape, inp.logits_TE, inp.bias_E
    kernel = get_topk_route_kernel(s.experts, s.topk, s.groups, s.topk_groups, "sigmoid", LOGIT_DTYPES[logits.dtype],
                                   True, with_counts, compact=compact)
    ctas = grid_size(s.tokens, ctas_per_sm is not None, logits.device, ctas_per_sm)

    def route():
        idx = torch.empty(s.tokens, s.topk, dtype=torch.int64, device=logits.device)
        weights = torch.empty(s.tokens, s.topk, dtype=torch.float32, device=logits.device)
        counts = (torch.zeros if with_counts else torch.empty)(s.experts, dtype=torch.int32, device=logits.device)
        kernel(logits, bias, idx, weights, counts, float(s.routed_scaling_factor), ctas)
        return (idx, weights, counts) if with_counts else (idx, weights)

    return route


def _norm_fn_variants(x, fn) -> dict[str, object]:
    from kernels.mhc import norm_fn_kernel as nf

    (t, n, d), m = x.shape, fn.shape[0]

    def cuda_cores(kernel, x=x):  # mixes only, as the op returns
        mixes, rstd = torch.empty((t, m), device=x.device), torch.empty((t,), device=x.device)
        kernel(x.view(t, n * d), fn, mixes, rstd)
        return mixes

    def mma(kernel, x=x):
        mixes, rstd = torch.empty((t, m), device=x.device), torch.empty((t,), device=x.device)
        parts = torch.empty((nf.fn_rows(m), n * d), dtype=torch.bfloat16, device=x.device)
        nf.get_fn_parts_kernel(n * d, m)(fn, parts)
        kernel(x.view(t, n * d), parts, mixes, rstd)
        return mixes

    found = {"cuda cores": functools.partial(cuda_cores, nf.get_norm_fn_kernel(n * d, m, "bfloat16", 1e-6))}
    for options in NORM_FN_OPTIONS:
        found[f"mma {options}"] = functools.partial(mma, nf.get_norm_fn_mma_kernel(n * d, m, 1e-6, **options))
    # session 22: float32 / float16 streams (training's), the same values as x's bfloat16 (so the same
    # reference), on the CUDA cores and in exact bfloat16 parts on the tensor cores
    for dtype in ("float32", "float16"):
        xd = x.to(getattr(torch, dtype))
        found[f"{dtype} cuda cores"] = functools.partial(cuda_cores, nf.get_norm_fn_kernel(n * d, m, dtype, 1e-6), xd)
        for options in NORM_FN_PARTS_OPTIONS:
            kernel = nf.get_norm_fn_mma_kernel(n * d, m, 1e-6, dtype=dtype, **options)
            found[f"{dtype} mma {options}"] = functools.partial(mma, kernel, xd)
    return found


def _norm_fn_backward_variants(x, fn, g) -> dict[str, object]:
    from kernels.mhc import norm_fn_kernel as nf
    from kernels.mhc.reference import norm_fn_backward_terms

    (t, n, d), m = x.shape, fn.shape[0]
    mixes, rstd = nf.norm_fn(x, fn, eps=1e-6, tf32=False)

    def run(options):  # the op's backward as shipped, with other kernel options
        gproj, coef = norm_fn_backward_terms(g, mixes, rstd, n * d)
        chunks = options.get("chunks", nf.backward_chunks(t))
        kernel = nf.get_norm_fn_backward_mma_kernel(n * d, m, **{"chunks": chunks, **options})
        grad_x = torch.empty_like(x)
        grad_fn = torch.empty((-(-t // (nf.BACKWARD_BLOCK_T * chunks)), m, n * d), device=x.device)
        kernel(x.view(t, n * d), fn, gproj, coef, grad_x.view(t, n * d), grad_fn)
        return grad_x, grad_fn.sum(0)

    def cuda_cores():  # session 5's: the CUDA-core kernel for grad_x, torch's GEMM over a float32 copy
        gproj, coef = norm_fn_backward_terms(g, mixes, rstd, n * d)
        grad_x = torch.empty_like(x)
        nf.get_norm_fn_backward_kernel(n * d, m, "bfloat16")(x.view(t, n * d), fn, gproj, coef, grad_x.view(t, n * d))
        return grad_x, gproj.T @ x.reshape(t, n * d).float()

    return {"cuda cores": cuda_cores, **{f"mma {o}": functools.partial(run, o) for o in NORM_FN_BACKWARD_OPTIONS}}


def variants(op: str, inp, case) -> dict[str, object]:
    """``{label: thunk}`` of the variants of ``op`` at ``inp``'s shape (``case``: the op as shipped)."""
    if op in ("weighted_reduce", "weighted_reduce_fp8"):
        found = {f"vector_bytes={b}": _weighted_reduce_variant(case, b) for b in REDUCE_VECTOR_BYTES}
        found |= {f"min_ctas={m}": _weighted_reduce_variant(case, 16, m) for m in REDUCE_MIN_CTAS}
        return found | {f"staged vector_bytes={b}": _weighted_reduce_variant(case, b, staged=True) for b in REDUCE_STAGED_BYTES}
    if op == "mhc_norm_fn":
        return _norm_fn_variants(inp.x_TND, inp.fn_MK)
    if op == "mhc_norm_fn_backward":
        return _norm_fn_backward_variants(inp.x_TND, inp.fn_MK, inp.g_TM)
    if op in ("swiglu", "swiglu_per_token_cast"):
        return {f"tile={t}": _swiglu_variant(inp.x_TI2, op != "swiglu", t) for t in SWIGLU_TILES}
    if op == "mhc_pre_apply":
        from kernels.mhc.pre_apply_kernel import get_pre_apply_kernel

        x, pre = inp.x_TND, inp.pre_TN
        (t, n, d) = x.shape

        def pre_apply(kernel):
            y = torch.empty((t, d), dtype=x.dtype, device=x.device)
            kernel(x, pre, y)
            return y

        return {f"threads={k} ld{ld or '.'} st{st or '.'}": functools.partial(
            pre_apply, get_pre_apply_kernel(n, d, "bfloat16", k, hints=(ld, st))) for k, ld, st in PRE_APPLY_HINTS}
    if op == "batched_transpose":
        from kernels.transpose.batched_transpose_kernel import get_batched_transpose_kernel

        s = inp.shape
        x = inp.x_TD.view(s.transpose_batch, s.tokens // s.transpose_batch, s.hidden).view(torch.uint16)

        def transpose(kernel):
            out = torch.empty((x.shape[0], x.shape[2], x.shape[1]), dtype=x.dtype, device=x.device)
            kernel(x, out)
            return out.view(torch.bfloat16)

        found = {f"threads={k}": functools.partial(transpose, get_batched_transpose_kernel(x.shape[1], x.shape[2], "uint16", k))
                 for k in TRANSPOSE_THREADS}
        found["plain loads"] = functools.partial(transpose, get_batched_transpose_kernel(
            x.shape[1], x.shape[2], "uint16", keep_in_l2=False))
        return found | {f"block={b}": functools.partial(transpose, get_batched_transpose_kernel(
            x.shape[1], x.shape[2], "uint16", register_block=b)) for b in TRANSPOSE_BLOCKS}
    if op == "expand_per_token_cast":
        return {f"tile={t}": _expand_cast_variant(inp.x_TD, inp.layout, t) for t in EXPAND_CAST_TILES}
    if op in ("per_token_cast", "per_block_cast", "per_channel_cast"):
        block, tiles = {"per_token_cast": ((1, 128), TOKEN_TILES), "per_block_cast": ((128, 128), BLOCK_TILES),
                        "per_channel_cast": ((128, 1), CHANNEL_TILES)}[op]
        return {f"tile={t}": _cast_variant(inp.x_TD, block, t) for t in tiles}
    if op == "engram_gate_backward":
        from kernels.engram.gate_kernel import backward_plan, gate, gate_backward

        args = (inp.x_TND, inp.k_TND, inp.v_TD, inp.wh_ND, inp.we_ND)
        args = (*args, inp.g_TND, gate(*args, return_stats=True)[1])
        found = {}
        for options in GATE_BACKWARD_PLANS:
            plan = backward_plan(*args[:3], w_dtype=inp.wh_ND.dtype, **options)
            label = (f"warps={plan.threads // 32} tile={plan.tile} stages={plan.stages} w_resident={plan.w_resident} "
                     f"g_buffers={plan.g_buffers}")
            found[label] = functools.partial(gate_backward, *args, **options)
        return found
    if op == "topk_route":  # session 9: the kept groups compacted (shipped) or in place
        return {"groups in place": _router_variant(inp, False, compact=False)}
    if op == "topk_route_with_counts":  # CTAs an SM (shipped: 8; one token a warp: "unbounded")
        return {f"ctas/SM={n or 'unbounded'}": _router_variant(inp, True, ctas_per_sm=n) for n in ROUTER_COUNT_CTAS_PER_SM}
    if op == "cast_back":
        found = {f"tile={t} staged": _cast_back_variant(inp.q_TD, inp.sf_TG, t, staged=True) for t in BACK_TILES}
        # session 31: the scales under an L2 policy of evict_last (now shipped) tied torch.compile's
        # 116.02 us at the large shape (116.03), plain loads 117.0
        return found | {"scales plain": _cast_back_variant(inp.q_TD, inp.sf_TG, None, None, scales_in_l2=False)}
    return {}  # the op as shipped and its peers only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="per_token_cast,per_channel_cast,per_block_cast,cast_back")
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--compile-budget", type=float, default=60, help="seconds of torch.compile for the peers")
    p.add_argument("--shape", default="large", help="shape of the non-mHC ops (bench kernels' SHAPES: large, small)")
    p.add_argument("--kernel-time", action="store_true", help="also each variant's CUPTI GPU time (bench kernels')")
    a = p.parse_args()
    device, seed, timer = bench.tuning_setup(a.iters)
    timer.kernel_calls = 50 if a.kernel_time else 0
    copy = bench.copy_bandwidth(timer, 1 << 30)
    print(f"{bench.device_name(device)}  copy {copy['gbps']:.0f} GB/s  seed {seed}", flush=True)
    rows = []
    budget = bench.CompileBudget(a.compile_budget)  # torch.compile of the reference, the peer where it is fastest
    for op in a.ops.split(","):
        shapes = ["v4-d4096", "v4-d7168"] if op in bench.MHC_OPS else [a.shape]
        for shape_name in shapes:
            shape = bench.SHAPES[shape_name]
            inp = (bench.StreamInputs if op in bench.MHC_OPS else bench.Inputs)(shape, device, seed)
            (case,) = bench.build_cases(inp, [op], with_peers=True)
            shipped = bench.run_case(case, timer, copy["gbps"], with_peers=True, compile_budget=budget, impl="tilelang")
            peer_us = {name: r.get("time_us", r.get("error")) if "kernel_us" not in r else
                       f"{r['time_us']:.2f} us, GPU {r['kernel_us']:.2f} us" for name, r in shipped.pop("peers", {}).items()}
            found = {"shipped": shipped}
            for label, thunk in variants(op, inp, case).items():
                found[label] = bench.run_case(dataclasses.replace(case, ours=thunk), timer, copy["gbps"],
                                              with_peers=False, compile_budget=None, impl="tilelang")
            for label, r in found.items():
                gpu = f"GPU {r['kernel_us']:8.2f} us " if "kernel_us" in r else ""
                fused = r.get("fusion", {}).get("kernel_time", {})
                if "speedup" in fused:
                    gpu += f"(fused {fused['speedup']:.2f}x, gain/bytes gain {fused['gain_over_bytes_gain']:.2f}) "
                line = (f"{shape_name:9s} {op:18s} {label:24s} " + (f"{r['time_us']:8.1f} us {gpu}{r['pct_of_copy']:5.1f}% "
                        f"{r['check']}" if "time_us" in r else f"ERROR {r.get('error', '')[:150]}"))
                print(line, flush=True)
                rows.append({"shape": shape_name, "op": op, "variant": label, **r})
            print(f"{shape_name:9s} {op:18s} peers {peer_us}", flush=True)
            rows.append({"shape": shape_name, "op": op, "variant": "peers", "peer_time_us": peer_us})
    with open(a.out, "w") as f:
        json.dump({"device": bench.device_name(device), "copy": copy, "seed": seed, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
