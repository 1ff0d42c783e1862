"""``ep-runtime bench mhc-overhead``: what an mHC sublayer costs next to the MoE layer it wraps, on
one device.

Per hidden size D, forward+backward, each the median over ``--iters`` steps (after ``--warmup``):

- ``moe``: the MoE layer alone on ``[T, D]`` (the ``ep-scaling`` shape: DeepSeek-V3's 256 experts,
  top-8, one shared expert, FP8 dispatch on GPU; at EP 1, so no transport);
- ``mhc``: the mHC work alone, a :class:`~ep_runtime.mhc.HyperConnection` around an identity
  sublayer on ``[T, N, D]`` streams (norm + projection, split + Sinkhorn, pre-apply, post, and their
  backward);
- ``mhc_around_moe``: the HyperConnection around the MoE layer, as a model runs it.

Streams are bfloat16 on GPU by default (what travels between pipeline stages); ``--stream-dtype
float32`` measures them as ``ep-runtime train`` runs them on GPU: float32 streams and mHC
parameters, the MoE layer in bfloat16 under autocast (twice the mHC bytes). The ``moe`` step's input
is random, not a mixed stream (same shape and dtype, so the same time).

It reports ``mhc / moe`` (the overhead as a fraction of the MoE layer's time) and
``mhc_around_moe / moe - 1`` (what wrapping adds, measured as a whole):

    ep-runtime bench mhc-overhead                       # CPU: the small shape
    ep-runtime bench mhc-overhead --hidden 4096,7168    # GPU default: T = 8192, N = 4

Writes ``mhc_overhead.json`` under ``--out``.

Shape letters: T tokens, N streams, D hidden.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from dataclasses import replace
from pathlib import Path

from .ep_scaling import SHAPES, BenchSpec, _build_layer
from .record import device_name, head_commit
from .timer import EventTimer


def measure(spec: BenchSpec, *, tokens: int, streams: int, stream_dtype, device, warmup: int, iters: int) -> dict:
    """The three medians (ms) and the two fractions for one hidden size (``spec.hidden``)."""
    import contextlib

    import torch

    from ..config import MHCConfig
    from ..dispatch import AllToAllDispatcher
    from ..mhc import HyperConnection

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = stream_dtype != dtype  # float32 streams around a bfloat16 layer: as training runs it
    dispatcher = AllToAllDispatcher(num_experts=spec.num_experts, alignment=spec.alignment,
                                    dispatch_format="e4m3" if spec.fp8_dispatch else "bf16")
    moe = _build_layer(spec, dispatcher, ep_rank=0, device=device, dtype=dtype)
    hc = HyperConnection(MHCConfig(n=streams), spec.hidden).to(device)
    g = torch.Generator(device).manual_seed(spec.seed)
    x_BSD = torch.randn(1, tokens, spec.hidden, generator=g, device=device, dtype=stream_dtype)
    x_BSND = torch.randn(1, tokens, streams, spec.hidden, generator=g, device=device, dtype=stream_dtype)
    grad_BSD, grad_BSND = torch.randn_like(x_BSD), torch.randn_like(x_BSND)

    def step(forward, x, grad):
        def run():
            with torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext():
                out = forward(x.detach().requires_grad_())
            out.backward(grad)
            for p in (*moe.parameters(), *hc.parameters()):
                p.grad = None
        return run

    steps = {
        "moe": step(moe, x_BSD, grad_BSD),
        "mhc": step(lambda x: hc(x, lambda y: y), x_BSND, grad_BSND),
        "mhc_around_moe": step(lambda x: hc(x, moe), x_BSND, grad_BSND),
    }
    timer = EventTimer(device)
    row = {"hidden": spec.hidden, "tokens": tokens, "streams": streams, "stream_dtype": str(stream_dtype)[6:]}
    for name, run in steps.items():
        for _ in range(warmup):
            run()
        row[f"{name}_ms"] = statistics.median(timer.time(run) for _ in range(iters))
    row["mhc_fraction_of_moe"] = row["mhc_ms"] / row["moe_ms"]
    row["added_fraction_of_moe"] = row["mhc_around_moe_ms"] / row["moe_ms"] - 1
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ep-runtime bench mhc-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), help="MoE layer shape: small (default on CPU), "
                   "deepseek-v3 (default on GPU)")
    p.add_argument("--hidden", type=lambda s: [int(d) for d in s.split(",")],
                   help="hidden sizes, comma-separated (default: 4096,7168 on GPU, the shape's on CPU)")
    p.add_argument("--tokens", type=int, help="tokens per step (default 8192 on GPU, 256 on CPU)")
    p.add_argument("--streams", type=int, default=4, help="mHC streams N (default 4)")
    p.add_argument("--stream-dtype", choices=["bfloat16", "float32"],
                   help="dtype of the streams (default bfloat16 on GPU, float32 on CPU; float32 on GPU runs the "
                   "MoE layer under bfloat16 autocast, as ep-runtime train does)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD)")
    return p


def main(argv: list[str] | None = None) -> dict:
    import torch

    a = parser().parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    shape = a.shape or ("deepseek-v3" if on_gpu else "small")
    base = BenchSpec(shape=shape, **SHAPES[shape])
    hiddens = a.hidden or ([4096, 7168] if on_gpu else [base.hidden])
    tokens = a.tokens or (8192 if on_gpu else 256)
    stream_dtype = getattr(torch, a.stream_dtype or ("bfloat16" if on_gpu else "float32"))
    if stream_dtype != torch.float32 and not on_gpu:
        raise SystemExit("ep-runtime bench mhc-overhead: --stream-dtype: expected float32 on CPU (the layer runs in "
                         f"float32 there), got {a.stream_dtype}")
    for name, value in (("tokens", tokens), ("streams", a.streams), ("iters", a.iters), *(("hidden", d) for d in hiddens)):
        if value < 1:
            raise SystemExit(f"ep-runtime bench mhc-overhead: --{name}: expected >= 1, got {value}")
    rows = []
    for d in hiddens:
        row = measure(replace(base, hidden=d), tokens=tokens, streams=a.streams, stream_dtype=stream_dtype,
                      device=device, warmup=a.warmup, iters=a.iters)
        rows.append(row)
        print(f"D {d:5d}  T {tokens}  N {a.streams} {row['stream_dtype']} | MoE layer {row['moe_ms']:9.3f} ms | "
              f"mHC {row['mhc_ms']:8.3f} ms "
              f"({row['mhc_fraction_of_moe']:.1%} of the MoE layer) | mHC around MoE {row['mhc_around_moe_ms']:9.3f} ms "
              f"(+{row['added_fraction_of_moe']:.1%})", flush=True)
    report = {"benchmark": "mhc-overhead", "device": device_name(device), "commit": a.commit or head_commit(),
              "time": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "shape": shape, "timing": "forward+backward, median of --iters after --warmup", "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mhc_overhead.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'mhc_overhead.json'}")
    return report


if __name__ == "__main__":
    main()
