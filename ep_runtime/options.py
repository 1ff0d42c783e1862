"""The training job's options: the presets, the ``ep-runtime train`` flags (also taken by
``python -m ep_runtime.train`` under torchrun) and the ``JobConfig`` they make, checked before
any process starts."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .checkpoint_verify import fresh_run_refusal
from .config import (PIPELINE_SCHEDULES, JobConfig, ModelConfig, MoEConfig, ParallelConfig, RouterConfig, TrainConfig,
                     v4_model_config)

PRESETS = {
    # ~0.3M parameters: trains on 2 CPU processes in about 10 s.
    "tiny": lambda: ModelConfig(hidden=64, num_layers=2, num_heads=4,
                                moe=MoEConfig(num_experts=8, expert_hidden=64, router=RouterConfig(topk=2))),
    "small": lambda: ModelConfig(hidden=256, num_layers=4, num_heads=8,
                                 moe=MoEConfig(num_experts=16, expert_hidden=256, router=RouterConfig(topk=4))),
    # DeepSeek-V4 style: mHC streams around every sublayer, Engram memory, a dense first block.
    "v4": v4_model_config,
    # DeepSeek-V3's layer widths (hidden 7168, experts of 2048, top-8 in 8 groups keeping 4, one
    # shared expert) with 32 of its 256 experts, so that a pipeline stage of two blocks fits one GPU
    # (ep-runtime bench pipeline on two H200s).
    "v3-layer": lambda: ModelConfig(
        hidden=7168, num_layers=4, num_heads=56, max_seq_len=4096,
        moe=MoEConfig(num_experts=32, expert_hidden=2048, num_shared_experts=1,
                      router=RouterConfig(topk=8, num_groups=8, topk_groups=4, routed_scaling_factor=2.5))),
}


def train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="ep-runtime train", description="Train the tiny MoE model.")
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="size preset (default tiny)")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--experts", type=int, help="override the preset's routed experts")
    p.add_argument("--topk", type=int, help="override the preset's routes per token")
    p.add_argument("--ep", type=int, help="EP group size (default: all ranks of a pipeline stage)")
    p.add_argument("--pp", type=int, default=ParallelConfig.pp, help="pipeline stages (default 1: none)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step with --pp > 1 (default: 2 * pp)")
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default=ParallelConfig.schedule,
                   help="pipeline schedule (default 1f1b; overlap: two lanes of micro-batches at once)")
    p.add_argument("--virtual-stages", type=int, help="model chunks per stage with --schedule interleaved (default 2)")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--lr", type=float, default=TrainConfig.lr,
                   help=f"peak learning rate, after warmup (default {TrainConfig.lr})")
    p.add_argument("--warmup-fraction", type=float, default=TrainConfig.warmup_fraction,
                   help=f"fraction of the steps warming the learning rate up (default {TrainConfig.warmup_fraction}); "
                        f"then cosine decay to {TrainConfig.min_lr_ratio} x --lr")
    p.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay,
                   help=f"AdamW's, on matrices only (default {TrainConfig.weight_decay})")
    p.add_argument("--max-grad-norm", type=float, default=TrainConfig.max_grad_norm,
                   help=f"clip the whole model's gradient norm to this, 0: off (default {TrainConfig.max_grad_norm})")
    p.add_argument("--fp8-dispatch", action="store_true", help="tokens travel as FP8 e4m3 (per-token scales)")
    p.add_argument("--dispatcher", choices=("all_to_all", "nvlink", "deepep"), default=MoEConfig.dispatcher,
                   help="dispatch/combine backend: all_to_all (default), nvlink (symmetric memory, no host sync; "
                        "all_to_all between nodes when the EP group spans them) or deepep (needs deep_ep)")
    p.add_argument("--max-tokens-per-rank", type=int, help="nvlink: most tokens a rank dispatches per layer call "
                   "(default: batch size x sequence length)")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node (default: LOCAL_WORLD_SIZE); fewer declares "
                   "more nodes, e.g. 1 for two-stage nvlink dispatch on one host")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--out", default=TrainConfig.out_dir, help="output directory (default runs/)")
    p.add_argument("--name", help="run name (default: the preset)")
    p.add_argument("--timeout", type=float, default=ParallelConfig.timeout_s,
                   help="collective timeout, s: a rank that does not take part for this long ends the job")
    p.add_argument("--checkpoint-every", type=int, default=TrainConfig.checkpoint_every, metavar="N",
                   help="save a checkpoint every N steps under OUT/NAME/ckpt/ (default 0: never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint (at any world size, EP size or PP size)")
    p.add_argument("--overwrite", action="store_true",
                   help="a fresh run deletes the checkpoints under OUT/NAME/ckpt/ (without it, it refuses to start)")
    p.add_argument("--profile", action="store_true",
                   help="write a torch profiler trace of a few steps into OUT/NAME/profile/")
    return p


def job_config_from_args(a: argparse.Namespace) -> JobConfig:
    model = PRESETS[a.model]()
    router = dataclasses.replace(model.moe.router, **_given(topk=a.topk))
    moe = dataclasses.replace(model.moe, router=router, fp8_dispatch=a.fp8_dispatch, dispatcher=a.dispatcher,
                              max_tokens_per_rank=a.max_tokens_per_rank or a.batch_size * a.seq_len,
                              **_given(num_experts=a.experts))
    model = dataclasses.replace(model, moe=moe, max_seq_len=max(model.max_seq_len, a.seq_len),
                                **_given(num_layers=a.layers, hidden=a.hidden))
    train = TrainConfig(steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, seed=a.seed,
                        warmup_fraction=a.warmup_fraction, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm,
                        out_dir=a.out, name=a.name or a.model, checkpoint_every=a.checkpoint_every,
                        resume=a.resume, overwrite=a.overwrite, profile=a.profile)
    default_microbatches = 2 * a.pp if a.pp > 1 else 1
    parallel = ParallelConfig(ep=a.ep, pp=a.pp, schedule=a.schedule, ranks_per_node=a.ranks_per_node, timeout_s=a.timeout,
                              microbatches=default_microbatches if a.microbatches is None else a.microbatches,
                              virtual_stages=(2 if a.schedule == "interleaved" else 1) if a.virtual_stages is None
                              else a.virtual_stages)
    return JobConfig(model=model, parallel=parallel, train=train)


def _given(**options) -> dict:
    """The command-line overrides the user gave (None: keep the preset's value)."""
    return {k: v for k, v in options.items() if v is not None}


def check_launch(cfg: JobConfig, nproc: int) -> None:
    """What the workers would refuse as they start, said before any starts, naming the flags."""
    pp, microbatches, batch_size = cfg.parallel.pp, cfg.parallel.microbatches, cfg.train.batch_size
    if nproc < 1:
        raise ValueError(f"--num-workers: expected at least 1, got {nproc}")
    if nproc % pp:
        raise ValueError(f"--pp {pp}: expected a divisor of the {nproc} worker processes (--num-workers)")
    per_stage = nproc // pp
    ep = cfg.parallel.ep or per_stage
    if per_stage % ep:
        raise ValueError(f"--ep {ep}: expected a divisor of the {per_stage} ranks of a pipeline stage "
                         f"({nproc} processes, --pp {pp})")
    if cfg.model.moe.num_experts % ep:
        raise ValueError(f"--ep {ep}: expected a divisor of the model's {cfg.model.moe.num_experts} experts "
                         "(--experts)")
    if pp > 1 and batch_size % microbatches:
        raise ValueError(f"--microbatches {microbatches}: expected a divisor of --batch-size {batch_size} "
                         "(the default is 2 x --pp)")
    if cfg.parallel.schedule == "interleaved" and microbatches % pp:
        raise ValueError(f"--microbatches {microbatches}: expected a multiple of --pp {pp} with the interleaved "
                         "schedule")
    if not (cfg.train.resume or cfg.train.overwrite):
        refusal = fresh_run_refusal(Path(cfg.train.out_dir) / cfg.train.name / "ckpt")
        if refusal:
            raise ValueError(refusal)
