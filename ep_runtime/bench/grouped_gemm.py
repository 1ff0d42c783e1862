"""``ep-runtime bench grouped-gemm``: the routed experts' FP8 grouped GEMMs (``kernels.gemm``)
against ``torch._grouped_mm`` in bfloat16 on the same shapes, in one run.

    ep-runtime bench grouped-gemm                      # on a GPU: DeepSeek-V3, one EP-4 rank
    ep-runtime bench grouped-gemm --device cpu --quick # the references on the CPU: a smoke test

The shapes are one EP-4 rank's of DeepSeek-V3: ``--tokens`` 4096 x top-``--topk`` 8 = 32768 rows
over ``--experts`` 64 local experts, hidden ``--hidden`` 7168, expert width ``--inter`` 2048
(W13: 7168 -> 4096, W2: 2048 -> 7168). Two splits of the rows: ``uniform`` (512 rows an expert)
and ``skewed`` (Zipf-like shares in whole 128-row tiles: 29% on one expert, six empty). Per split, six
GEMMs: the forwards ``x @ W13`` and ``h @ W2``, the data gradients ``dh @ W13^T`` and
``dy @ W2^T``, and the weight gradients ``x^T @ dh`` and ``h^T @ dy`` (float32 out, as the
optimizer keeps them; ``--wgrad-dtype bfloat16`` for bfloat16 like the bf16 peer's).

Each GEMM is timed on its quantized operands (the casts are the quant family's, timed in ``bench
kernels``) with CUDA events after ``--warmup`` calls, the median of ``--iters``; its bf16 peer
(``torch._grouped_mm``, the weights in ``GroupedExperts``' ``[E, K, N]`` layout, the weight
gradient as ``_grouped_mm(x^T, dy, offs)``) the same way in the same run. TFLOP/s counts
``2 * rows * K * N``; ``ratio`` is the bf16 time over the FP8 time. ``--stages 3,4,5`` times the
FP8 kernels at each pipeline depth (up to each kernel's ``MAX_STAGES``), the peer again beside
each. Prints a table and writes JSON to ``--out`` (a .json file, or a folder for
grouped_gemm-<device>-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
from pathlib import Path

import torch

import kernels.gemm as gemm
from kernels import quant
from kernels.gemm import grouped_mm_kernel, wgrad_kernel
from kernels.gemm.reference import SCALE_BLOCK
from kernels.testing import grouped_gemm_inputs

from .record import device_name, head_commit, slug
from .timer import EventTimer


def parse_args(argv):
    p = argparse.ArgumentParser(prog="ep-runtime bench grouped-gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64, help="local experts")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048, help="an expert's intermediate width (W13 is 2x)")
    p.add_argument("--splits", default="uniform,skewed")
    p.add_argument("--wgrad-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--stages", default="4", help="the FP8 kernels' pipeline depths to time, e.g. 3,4,5 (CUDA; "
                   "each kernel's MAX_STAGES bounds it)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a tiny shape (a smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.topk, args.experts, args.hidden, args.inter, args.iters = 64, 4, 4, 256, 128, 2
    return args


def split_counts(rows: int, experts: int, split: str) -> list[int]:
    """Rows per expert, multiples of 128 summing to ``rows`` rounded up to 128: equal shares, or
    Zipf-like shares ``(e + 1) ** -1.2`` (at 64 experts the first takes 29% and the last six
    none), in whole 128-row tiles by largest remainder."""
    tiles = -(-rows // SCALE_BLOCK)
    if split == "uniform":
        share = [1.0] * experts
    elif split == "skewed":
        share = [(e + 1) ** -1.2 for e in range(experts)]
    else:
        raise ValueError(f"--splits: expected uniform or skewed, got {split!r}")
    exact = [tiles * s / sum(share) for s in share]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(experts), key=lambda e: counts[e] - exact[e])
    for e in by_remainder[:tiles - sum(counts)]:
        counts[e] += 1
    return [c * SCALE_BLOCK for c in counts]


def median_ms(fn, device, warmup: int, iters: int) -> float:
    """The median of ``iters`` timed calls after ``warmup`` untimed ones (``EventTimer``: CUDA events
    after the GPU's head start, host timers on the CPU)."""
    timer = EventTimer(device)
    for _ in range(warmup):
        fn()
    return statistics.median(timer.time(fn, head_start=True) for _ in range(iters))


def fp8_op(device, public, kernel_op, stages: int):
    """The public op on the CPU (the reference), on CUDA its kernel with ``stages``."""
    if device.type != "cuda":
        return public
    return functools.partial(kernel_op, stages=stages)


def forward_case(counts, k, n, device, seed, stages):
    """``(fp8 call, bf16 call)`` of ``x[P, K] @ W[e]^T`` over the segments."""
    x_PK, w_ENK, offsets_E = grouped_gemm_inputs(counts, k, n, device=device, seed=seed)
    a_PK, sa_PG = quant.per_token_cast(x_PK)
    b_ENK, sb_EJG = gemm.cast_weights(w_ENK)
    w_EKN = w_ENK.transpose(1, 2).contiguous()
    del w_ENK
    op = fp8_op(device, gemm.grouped_fp8_mm, grouped_mm_kernel.grouped_fp8_mm, stages)
    return (lambda: op(a_PK, sa_PG, b_ENK, sb_EJG, offsets_E),
            lambda: torch._grouped_mm(x_PK, w_EKN, offs=offsets_E))


def wgrad_case(counts, m, n, device, seed, out_dtype, stages):
    """``(fp8 call, bf16 call)`` of ``x[:, seg]^T @ dy[seg]`` per expert (x ``[P, M]``, dy ``[P, N]``)."""
    x_PM, _, offsets_E = grouped_gemm_inputs(counts, m, SCALE_BLOCK, device=device, seed=seed)
    dy_PN = grouped_gemm_inputs(counts, n, SCALE_BLOCK, device=device, seed=seed + 1)[0]
    (qx, sx_CM), (qdy, sdy_CN) = quant.per_channel_cast(x_PM), quant.per_channel_cast(dy_PN)
    a_MR, b_NR = gemm.k_major(qx), gemm.k_major(qdy)
    del qx, qdy
    op = fp8_op(device, gemm.grouped_fp8_mm_wgrad, wgrad_kernel.grouped_fp8_mm_wgrad, stages)
    return (lambda: op(a_MR, sx_CM, b_NR, sdy_CN, offsets_E, out_dtype=out_dtype),
            lambda: torch._grouped_mm(x_PM.t(), dy_PN, offs=offsets_E))


def cases(args):
    """``(name, kind, K or M, N)``: the layer's six GEMMs."""
    d, w13, i = args.hidden, 2 * args.inter, args.inter
    return [("fwd x@W13", "fwd", d, w13), ("fwd h@W2", "fwd", i, d), ("dgrad dh@W13^T", "fwd", w13, d),
            ("dgrad dy@W2^T", "fwd", d, i), ("wgrad x^T@dh", "wgrad", d, w13), ("wgrad h^T@dy", "wgrad", i, d)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    wgrad_dtype = getattr(torch, args.wgrad_dtype)
    rows = args.tokens * args.topk
    results = []
    for split in args.splits.split(","):
        counts = split_counts(rows, args.experts, split)
        for name, kind, k, n in cases(args):
            for stages in [int(s) for s in args.stages.split(",")]:
                if stages > (grouped_mm_kernel if kind == "fwd" else wgrad_kernel).MAX_STAGES:
                    continue
                if kind == "fwd":
                    fp8, bf16 = forward_case(counts, k, n, device, args.seed, stages)
                else:
                    fp8, bf16 = wgrad_case(counts, k, n, device, args.seed, wgrad_dtype, stages)
                fp8_ms = median_ms(fp8, device, args.warmup, args.iters)
                bf16_ms = median_ms(bf16, device, args.warmup, args.iters)
                del fp8, bf16
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                flop = 2 * sum(counts) * k * n
                r = dict(split=split, gemm=name, k_or_m=k, n=n, rows=sum(counts), stages=stages, fp8_ms=fp8_ms,
                         bf16_ms=bf16_ms, fp8_tflops=flop / fp8_ms / 1e9, bf16_tflops=flop / bf16_ms / 1e9,
                         ratio=bf16_ms / fp8_ms)
                results.append(r)
                print(f"{split:8s} {name:16s} {k:5d}x{n:<5d} stages {stages}  fp8 {fp8_ms:8.3f} ms "
                      f"{r['fp8_tflops']:7.1f} TFLOP/s  bf16 {bf16_ms:8.3f} ms {r['bf16_tflops']:7.1f} TFLOP/s  "
                      f"ratio {r['ratio']:.2f}", flush=True)
    report = dict(benchmark="grouped_gemm", device=device_name(device), commit=head_commit(),
                  date=datetime.datetime.now().isoformat(timespec="seconds"), args=vars(args), results=results)
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"grouped_gemm-{slug(device_name(device))}-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report
