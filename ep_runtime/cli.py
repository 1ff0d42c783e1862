"""The ``ep-runtime`` command.

    ep-runtime train ...              the main job (this module)
    ep-runtime plan ...               expert placement (``topology.report``)
    ep-runtime bench <name> ...       benchmarks (``ep_runtime.bench.<name>``: kernels, ep-scaling, ...)

``plan`` and ``bench`` hand their remaining arguments to the module's ``main(argv)``.
"""

from __future__ import annotations

import argparse
import sys

from .config import JobConfig, ModelConfig, MoEConfig, ParallelConfig, RouterConfig, TrainConfig

PRESETS = {
    # ~0.5M parameters: trains on 2 CPU processes in about a minute.
    "tiny": dict(hidden=64, num_layers=2, num_heads=4, num_experts=8, expert_hidden=64, topk=2),
    "small": dict(hidden=256, num_layers=4, num_heads=8, num_experts=16, expert_hidden=256, topk=4),
}


def train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="ep-runtime train", description="Train the tiny MoE model.")
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="size preset (default tiny)")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--experts", type=int, help="override the preset's routed experts")
    p.add_argument("--topk", type=int, help="override the preset's routes per token")
    p.add_argument("--ep", type=int, help="EP group size (default: all ranks)")
    p.add_argument("--nproc", type=int, help="local worker processes (default: one per GPU, else 2)")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--fp8-dispatch", action="store_true", help="tokens travel as FP8 e4m3 (per-token scales)")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--out", default=TrainConfig.out_dir, help="output directory (default runs/)")
    p.add_argument("--name", help="run name (default: the preset)")
    p.add_argument("--timeout", type=float, default=ParallelConfig.timeout_s, help="collective timeout, s")
    return p


def job_config_from_args(a: argparse.Namespace) -> JobConfig:
    preset = dict(PRESETS[a.model])
    for key, value in (("num_layers", a.layers), ("hidden", a.hidden), ("num_experts", a.experts),
                       ("topk", a.topk)):
        if value is not None:
            preset[key] = value
    router = RouterConfig(topk=preset["topk"])
    moe = MoEConfig(num_experts=preset["num_experts"], expert_hidden=preset["expert_hidden"],
                    fp8_dispatch=a.fp8_dispatch, router=router)
    model = ModelConfig(hidden=preset["hidden"], num_layers=preset["num_layers"], num_heads=preset["num_heads"],
                        max_seq_len=max(64, a.seq_len), moe=moe)
    train = TrainConfig(steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, seed=a.seed,
                        out_dir=a.out, name=a.name or a.model)
    return JobConfig(model=model, parallel=ParallelConfig(ep=a.ep, timeout_s=a.timeout), train=train)


def _train(a: argparse.Namespace) -> None:
    import torch

    from launch.local import launch_local

    from .train import worker

    cfg = job_config_from_args(a)
    nproc = a.nproc or torch.cuda.device_count() or 2
    results = launch_local(worker, cfg, nproc=nproc)
    losses = results[0]["losses"]
    print(f"trained {len(losses)} steps on {nproc} processes: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _bench(name: str, argv: list[str]) -> None:
    import importlib
    import pkgutil

    from . import bench

    names = sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__))
    if name not in names:
        raise SystemExit(f"ep-runtime bench: expected one of {names}, got {name!r}")
    importlib.import_module(f"ep_runtime.bench.{name.replace('-', '_')}").main(argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ep-runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub.add_parser("train", help="train the tiny MoE model with expert parallelism"))
    plan = sub.add_parser("plan", help="place experts on a cluster (ep-runtime plan --help)", add_help=False)
    plan.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="benchmarks: ep-runtime bench <name> --help")
    bench.add_argument("name")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "train":
        _train(args)
    elif args.command == "plan":
        from topology.report import main as plan_main

        plan_main(args.args)
    else:
        _bench(args.name, args.args)


if __name__ == "__main__":
    main(sys.argv[1:])
