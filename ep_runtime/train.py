"""The training worker that every launcher runs (local processes, torchrun, Ray).

``python -m ep_runtime.train [options]`` under torchrun runs it in each process; ``ep-runtime
train`` starts local processes that run the same function. The process group comes from the
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .config import JobConfig
from .data import MarkovText
from .dispatch import make_dispatcher
from .metrics import MetricsLog, plot_loss
from .model import TinyDeepSeek
from .parallel import ParallelContext, init_parallel

log = logging.getLogger("ep_runtime.train")


def average_gradients(model: TinyDeepSeek, ctx: ParallelContext) -> None:
    """Makes every rank's gradient that of the mean loss over all ranks.

    Dense parameters are replicated on every rank: average over the world. Each expert's gradient
    already sums the contributions of every rank of its EP group (through combine's backward), so
    it is summed over the ``dp`` replicas and divided by the world size. A parameter that got no
    gradient on this rank (an expert no token reached) takes part with zeros, so every rank
    reduces tensors of the same size.
    """
    if not ctx.distributed:
        return
    for params, group in ((model.dense_parameters(), None), (model.expert_parameters(), ctx.dp_group)):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= ctx.world_size
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))


def global_expert_load(model: TinyDeepSeek, ctx: ParallelContext) -> torch.Tensor:
    """``[layers, E]`` routes per expert this step, summed over all ranks."""
    load_LE = torch.stack([moe.load_E for moe in model.moe_layers]).to(ctx.device, torch.int64)
    if ctx.distributed:
        dist.all_reduce(load_LE)
    return load_LE


def _setup_logging(ctx: ParallelContext) -> None:
    fmt = f"%(asctime)s [node {ctx.node_rank} rank {ctx.rank}/{ctx.world_size} local {ctx.local_rank}] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", force=True)
    logging.getLogger("ep_runtime").setLevel(logging.INFO if ctx.rank == 0 else logging.WARNING)


def worker(cfg: JobConfig) -> dict:
    """Trains ``cfg.model`` for ``cfg.train.steps`` steps; returns this rank's summary."""
    ctx = init_parallel(cfg.parallel)
    _setup_logging(ctx)
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    t = cfg.train
    torch.manual_seed(t.seed)
    model = TinyDeepSeek(cfg.model, make_dispatcher(cfg.model.moe, ctx), ep_rank=ctx.ep_rank, seed=t.seed)
    model.to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    data = MarkovText(cfg.model.vocab_size, seed=t.seed)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda"
                else contextlib.nullcontext())

    run_dir = Path(t.out_dir) / t.name
    metrics = MetricsLog(run_dir) if ctx.rank == 0 else None
    log.info("training %s: %d ranks, EP %d, %d experts, %d steps -> %s", t.name, ctx.world_size, ctx.ep_size,
             cfg.model.moe.num_experts, t.steps, run_dir)
    progress = _progress(t.steps, enabled=ctx.rank == 0)
    losses = []
    tokens_per_step = t.batch_size * t.seq_len * ctx.world_size
    for step in range(1, t.steps + 1):
        start = time.perf_counter()
        tokens_BS = data.batch(t.batch_size, t.seq_len + 1, seed=(t.seed * 1_000_003 + step) * 4099 + ctx.rank)
        with autocast:
            loss = model.loss(tokens_BS.to(ctx.device))
        loss.backward()
        average_gradients(model, ctx)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        load_LE = global_expert_load(model, ctx)
        for moe, load_E in zip(model.moe_layers, load_LE):
            moe.router.update_bias(load_E)
        mean_loss = loss.detach().float()
        if ctx.distributed:
            dist.all_reduce(mean_loss)
            mean_loss /= ctx.world_size
        losses.append(float(mean_loss))
        elapsed = time.perf_counter() - start
        record = {"step": step, "loss": losses[-1], "tokens_per_s": tokens_per_step / elapsed,
                  "step_time_s": elapsed, "expert_load": load_LE.tolist(),
                  "load_imbalance": float((load_LE.max(-1).values / load_LE.float().mean(-1)).max())}
        if metrics:
            metrics.write(record)
        progress.update(1)
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % t.log_every == 0 or step == t.steps:
            log.info("step %d loss %.4f tokens/s %.0f max/mean expert load %.2f load %s", step, losses[-1],
                     record["tokens_per_s"], record["load_imbalance"], load_LE.tolist())
    progress.close()
    summary = {"rank": ctx.rank, "losses": losses}
    if metrics:
        metrics.close()
        png = plot_loss(metrics.path, run_dir / "loss.png", floor=data.mean_successor_entropy())
        log.info("loss %.3f -> %.3f (data entropy %.3f, uniform %.3f); wrote %s and %s", losses[0], losses[-1],
                 data.mean_successor_entropy(), data.uniform_loss, metrics.path, png)
    if ctx.distributed:
        dist.destroy_process_group()
    return summary


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point under torchrun: ``torchrun ... -m ep_runtime.train [train options]``."""
    from .cli import job_config_from_args, train_parser

    worker(job_config_from_args(train_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
