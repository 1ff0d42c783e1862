"""``ep-runtime bench pipeline``: step time, bubble fraction and peak memory per stage of each
pipeline schedule, over micro-batch counts.

    ep-runtime bench pipeline                          # PP=2 x EP=1 on 2 CPU workers, preset small
    torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.pipeline --pp 2   # GPUs

For each schedule (``--schedules``) and micro-batch count M (``--microbatches``): ``--steps``
training steps (SGD) after ``--warmup``, each started from a barrier. Per stage: the step time
(the slowest rank's, median over steps), the measured bubble (the part of the step the stage did
not compute: waiting on a neighbour, ``PipelineSchedule.wait_s``, or done before the slowest
stage) against the schedule's formula ``(P - 1) / (M + P - 1)``
(1F1B and GPipe alike, forward and backward taken as one slot each; ``(P - 1) / (V M + P - 1)``
interleaved over V virtual stages; 1F1B's for ``overlap``, whose second lane starts one forward
after the first, so the two fill the stages as 1F1B's M micro-batches do, with a stage idle only
while both lanes wait) and against the same formula for the stages' measured costs (``model``,
:func:`bubble_model`: the formula assumes equal stages), and the peak memory: CUDA's
peak allocation on GPUs, the process's peak resident set on CPU (which only grows: configurations
run in the order given). Writes ``pipeline.json`` and ``pipeline.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

from . import StartWorkers, need_start
from .progress import Progress
from .record import device_name, head_commit
from ..config_files import preset_names


def bubble_formula(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of 1F1B and GPipe with equal forward and backward slots; interleaving V
    chunks per stage divides the warmup and cooldown by V: ``(P - 1) / (V M + P - 1)``."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def bubble_model(compute_s: list[float], microbatches: int, virtual_stages: int = 1) -> list[float]:
    """Per stage, the idle fraction of a pipeline whose stage ``s`` computes ``compute_s[s]`` per
    micro-batch (forward and backward, measured): the step lasts the slowest stage's ``M`` slots
    plus the other stages' one slot each of warm-up and cool-down (divided by ``V`` when
    interleaved), ``M max c + (sum c - max c) / V``, of which stage ``s`` computes ``M c_s``. Equal
    stages give :func:`bubble_formula`."""
    slowest = max(compute_s)
    step = microbatches * slowest + (sum(compute_s) - slowest) / virtual_stages
    return [1 - microbatches * c / step for c in compute_s]


def bench_worker(a: argparse.Namespace) -> dict | None:
    import resource

    import torch
    import torch.distributed as dist

    from ..config_files import preset
    from ..config import ParallelConfig
    from ..dispatch import make_dispatcher
    from ..model import TinyDeepSeek
    from ..parallel import init_parallel
    from ..pipeline import PipelineSchedule, PipelineStage

    ctx = init_parallel(ParallelConfig(pp=a.pp, ep=a.ep))
    if ctx.device.type == "cpu":  # the workers share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    cfg = dataclasses.replace(preset(a.model).model, max_seq_len=a.seq_len)
    on_gpu = ctx.device.type == "cuda"
    # The ranks of one pp group read the same batch (every stage needs it).
    g = torch.Generator().manual_seed(ctx.rank % (ctx.world_size // ctx.pp_size))
    rows = []
    progress = Progress("pipeline", len(a.schedules) * len(a.microbatches), enabled=ctx.rank == 0)
    for schedule in a.schedules:
        for m in a.microbatches:
            torch.manual_seed(0)
            lanes = 2 if schedule == "overlap" else 1
            model = TinyDeepSeek(cfg, make_dispatcher(cfg.moe, ctx, lanes=lanes), ep_rank=ctx.ep_rank,
                                 seed=1).to(ctx.device)
            stage = PipelineStage(model, stage=ctx.pp_rank, num_stages=ctx.pp_size,
                                  chunks=a.virtual_stages if schedule == "interleaved" else 1)
            pipe = PipelineSchedule(stage, ctx, num_microbatches=m, schedule=schedule, timed=True)
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            step_s, wait_s = [], []
            for i in range(a.warmup + a.steps):
                tokens = torch.randint(0, cfg.vocab_size, (a.batch_size, a.seq_len + 1), generator=g).to(ctx.device)
                dist.barrier()
                if on_gpu:
                    torch.cuda.synchronize(ctx.device)
                begin = time.perf_counter()
                pipe.step(tokens)
                if on_gpu:
                    torch.cuda.synchronize(ctx.device)
                elapsed = time.perf_counter() - begin
                with torch.no_grad():
                    for p in stage.parameters():
                        if p.grad is not None:
                            p -= 1e-3 * p.grad
                            p.grad = None
                if i >= a.warmup:
                    step_s.append(elapsed)
                    wait_s.append(pipe.wait_s)
            peak = (torch.cuda.max_memory_allocated(ctx.device) if on_gpu
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            rows.append({"schedule": schedule, "microbatches": m, "virtual_stages": stage.chunks, "rank": ctx.rank,
                         "stage": ctx.pp_rank, "step_s": step_s, "wait_s": wait_s, "peak_memory_bytes": peak})
            del pipe, stage, model
            progress.advance(f"{schedule} M={m}")
    progress.close()
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    result = {"device": device_name(ctx.device), "world_size": ctx.world_size, "pp": ctx.pp_size,
              "ep": ctx.ep_size, "rows": [r for per_rank in gathered for r in per_rank]}
    dist.destroy_process_group()
    return result if ctx.rank == 0 else None


def summarize(result: dict) -> list[dict]:
    """One row per (schedule, M, stage). A step lasts until its slowest rank is done; a stage's
    bubble in it is the part of that time its ranks were not computing (waiting on a neighbour,
    or done early): ``1 - (own step - own wait) / step``, the median over steps and the stage's
    ranks; ``bubble_model`` from the stages' compute per micro-batch (``(own step - own wait) / M``,
    medians; none for ``overlap``, whose lanes share the stages)."""
    out = []
    for schedule, m in sorted({(r["schedule"], r["microbatches"]) for r in result["rows"]}):
        rs = [r for r in result["rows"] if (r["schedule"], r["microbatches"]) == (schedule, m)]
        step_s = [max(per_step) for per_step in zip(*(r["step_s"] for r in rs))]
        stages = sorted({r["stage"] for r in rs})
        compute_s = [statistics.median((own - wait) / m for r in rs if r["stage"] == stage
                                       for own, wait in zip(r["step_s"], r["wait_s"])) for stage in stages]
        model = (bubble_model(compute_s, m, rs[0]["virtual_stages"]) if schedule != "overlap"
                 else [None] * len(stages))
        for stage, compute, modelled in zip(stages, compute_s, model):
            mine = [r for r in rs if r["stage"] == stage]
            bubbles = [1 - (own - wait) / step for r in mine for own, wait, step in zip(r["step_s"], r["wait_s"], step_s)]
            out.append({"schedule": schedule, "microbatches": m, "stage": stage, "step_s": statistics.median(step_s),
                        "compute_per_microbatch_s": compute, "bubble": statistics.median(bubbles),
                        "bubble_formula": bubble_formula(result["pp"], m, rs[0]["virtual_stages"]),
                        "bubble_model": modelled,
                        "peak_memory_mb": max(r["peak_memory_bytes"] for r in mine) / 2**20})
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ep-runtime bench pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--model", default="small", choices=preset_names(), help="model preset of ep-runtime train (default small: 4 blocks, "
                   "enough for 2 stages x 2 virtual stages)")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=["1f1b", "gpipe", "interleaved", "overlap"])
    p.add_argument("--virtual-stages", type=int, default=2, help="model chunks per stage, interleaved (default 2)")
    p.add_argument("--microbatches", type=lambda s: [int(m) for m in s.split(",")], default=[2, 4, 8])
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data rank per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD)")
    return p


def main(argv: list[str] | None = None, *, start: StartWorkers | None = None) -> dict | None:
    a = parser().parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        result = bench_worker(a)
        if result is None:
            return None
    else:
        result = need_start(start, "pipeline")(bench_worker, a, num_workers=a.pp * a.ep)[0]
    rows = summarize(result)
    report = {"benchmark": "pipeline", "device": result["device"], "pp": result["pp"], "ep": result["ep"],
              "commit": a.commit or head_commit(), "time": datetime.datetime.now().isoformat(timespec="seconds"),
              "spec": {k: v for k, v in vars(a).items() if k != "out"},
              "bubble": "measured: time a stage's ranks waited on a neighbour / step time (median over steps and "
                        "ranks); formula: (P - 1) / (M + P - 1); model: the same for the stages' measured "
                        "compute per micro-batch c, M max c + (sum c - max c) / V",
              "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"pipeline on {report['device']}: PP={report['pp']} x EP={report['ep']}, model {a.model}, "
          f"{a.batch_size} x {a.seq_len} tokens per data rank")
    print(f"{'schedule':>8} {'M':>3} {'stage':>5} {'step ms':>9} {'bubble':>7} {'formula':>7} {'model':>7} "
          f"{'peak MB':>9}")
    for r in rows:
        model = "-" if r["bubble_model"] is None else f"{r['bubble_model']:.3f}"
        print(f"{r['schedule']:>8} {r['microbatches']:>3} {r['stage']:>5} {r['step_s'] * 1e3:9.1f} "
              f"{r['bubble']:7.3f} {r['bubble_formula']:7.3f} {model:>7} {r['peak_memory_mb']:9.1f}")
    png = plot(rows, out / "pipeline.png")
    print(f"wrote {out / 'pipeline.json'}" + (f" and {png}" if png else ""))
    return report


def plot(rows: list[dict], path: Path) -> Path | None:
    """Measured bubble per stage against the formula, over M, one line per schedule."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, schedule in enumerate(sorted({r["schedule"] for r in rows})):
        for stage in sorted({r["stage"] for r in rows}):
            rs = sorted((r for r in rows if r["schedule"] == schedule and r["stage"] == stage),
                        key=lambda r: r["microbatches"])
            ax.plot([r["microbatches"] for r in rs], [r["bubble"] for r in rs], "-o" if stage == 0 else "--s",
                    color=f"C{i}", label=f"{schedule}, stage {stage}")
    rs = sorted({r["microbatches"]: r["bubble_formula"] for r in rows}.items())
    ax.plot([m for m, _ in rs], [b for _, b in rs], ":k", label="(P-1)/(M+P-1)")
    ax.set(xlabel="micro-batches M", ylabel="bubble fraction", xscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


if __name__ == "__main__":
    main()
