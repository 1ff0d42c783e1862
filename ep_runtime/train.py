"""The training worker that every launcher runs (local processes, torchrun, Ray).

``python -m ep_runtime.train [options]`` under torchrun runs it in each process; ``ep-runtime
train`` starts local processes (or Ray actors) that run the same function. The process group comes
from the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, GROUP_RANK for the node).

Failures: an error on a rank ends the job with a ``RankFailed`` naming the rank and its error; a
rank whose collective breaks or times out (``--timeout``) names the rank that failed first or the
ranks that never answered (see ``failures.report_failure``). A restarted job
(``TORCHELASTIC_RESTART_COUNT`` > 0, set by torchrun and the Ray launcher) continues from the
newest checkpoint, if there is one; ``--resume`` asks for that explicitly.

Fault injection, for tests: ``EP_RUNTIME_FAIL_AT_STEP=RANK:STEP[:HOW]`` makes rank RANK, at the
start of step STEP of the job's first attempt (restart count 0), ``raise`` a RuntimeError (the
default), ``kill`` itself (SIGKILL, no report), or ``hang`` (stop taking part in collectives: the
others time out, and the failure watch or the launcher ends it), once the checkpoint being saved, if any,
is complete. It is read in ``InjectedFault.from_env`` and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from . import checkpoint
from .config import JobConfig
from .data import MarkovText
from .dispatch import make_dispatcher
from .rebalance import Rebalancer, rank_load_imbalance
from .replicas import sync_replica_gradients
from .metrics import MetricsLog, StepTimes, peak_tflops, plot_loss, read_metrics, train_flops_per_token
from .experts import GroupedExperts
from .gradients import GradientBuckets, average_gradients
from .model import Attention, TinyDeepSeek
from .options import job_config_from_args, train_parser
from .optim import clip_grad_norm, grad_norm, learning_rate, make_optimizer
from .failures import FailureWatch, report_failure, restart_count
from .parallel import ParallelContext, init_parallel
from .pipeline import PipelineSchedule, PipelineStage
from .run_log import setup_worker_logging

log = logging.getLogger("ep_runtime.train")


def global_expert_load(model: TinyDeepSeek, ctx: ParallelContext) -> torch.Tensor:
    """``[layers, E]`` routes per expert this step, summed over all ranks (of this pipeline stage,
    for its layers)."""
    load_LE = torch.stack([moe.load_E for moe in model.moe_layers]).to(ctx.device, torch.int64)
    if ctx.distributed:
        with ctx.activity("the expert-load all-reduce"):
            dist.all_reduce(load_LE, group=ctx.stage_group)
    return load_LE


# How long a rank whose collective failed waits for the others' reports before it names the
# culprit, and how long a rank may go on after another reported a failure: the job ends within
# the timeout plus this.
REPORT_GRACE_S = 5.0
FAULT_ENV = "EP_RUNTIME_FAIL_AT_STEP"
FAULT_KINDS = ("raise", "kill", "hang")


@dataclass(frozen=True)
class InjectedFault:
    """A test's fault: rank ``rank`` fails at the start of step ``step`` in the way ``how``."""

    rank: int
    step: int
    how: str

    @staticmethod
    def from_env() -> InjectedFault | None:
        """Parses ``EP_RUNTIME_FAIL_AT_STEP=RANK:STEP[:HOW]``; None if unset or the job restarted."""
        spec = os.environ.get(FAULT_ENV)
        if not spec or restart_count() > 0:
            return None
        rank, _, rest = spec.partition(":")
        step, _, how = rest.partition(":")
        how = how or "raise"
        if not (rank.isdigit() and step.isdigit()) or how not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}: expected RANK:STEP[:HOW] with HOW one of {FAULT_KINDS}, got {spec!r}")
        return InjectedFault(int(rank), int(step), how)

    def maybe_fire(self, rank: int, step: int) -> None:
        if (rank, step) != (self.rank, self.step):
            return
        log.warning("%s=%d:%d:%s: injecting the fault now", FAULT_ENV, rank, step, self.how)
        if self.how == "raise":
            raise RuntimeError(f"injected fault ({FAULT_ENV}) at step {step}")
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # "hang": withheld from every collective until the launcher ends this process
            time.sleep(1)


def worker(cfg: JobConfig) -> dict:
    """Trains ``cfg.model`` up to step ``cfg.train.steps``; returns this rank's summary:
    ``{"rank", "node", "host", "restart", "first_step", "losses"}`` (the losses of the steps this
    process ran, from ``first_step``; every rank logs the global mean)."""
    terminal = setup_worker_logging(cfg.train)
    if restart_count():
        log.warning("restart %d: every worker started again after a failure", restart_count())
    ctx = init_parallel(cfg.parallel)
    at = _Position()
    grace_s = min(cfg.parallel.timeout_s, REPORT_GRACE_S)
    try:
        with FailureWatch(ctx, grace_s=grace_s, timeout_s=cfg.parallel.timeout_s, step=lambda: at.step):
            summary = _train(cfg, ctx, at, terminal=terminal)
        if ctx.distributed:
            dist.destroy_process_group()
        return summary
    except Exception as exc:
        failure = report_failure(ctx, exc, step=at.step, grace_s=grace_s)
        log.error("%s", failure)
        log.debug("the traceback of that failure", exc_info=exc)  # the rank's log file only
        raise failure from exc


@dataclass
class _Position:
    step: int = 0  # the step in progress (0: setting up), for failure reports


def _train(cfg: JobConfig, ctx: ParallelContext, at: _Position, *, terminal: TextIO = sys.stderr) -> dict:
    if ctx.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    t = cfg.train
    fault = InjectedFault.from_env()
    torch.manual_seed(t.seed)
    lanes = 2 if cfg.parallel.schedule == "overlap" else 1
    model = TinyDeepSeek(cfg.model, make_dispatcher(cfg.model.moe, ctx, lanes=lanes), ep_rank=ctx.ep_rank, seed=t.seed)
    model.to(ctx.device)
    pipe = None
    if ctx.pp_size > 1 or lanes > 1:  # this rank keeps its stage's blocks only (ep_runtime/pipeline.md)
        stage = PipelineStage(model, stage=ctx.pp_rank, num_stages=ctx.pp_size, chunks=cfg.parallel.virtual_stages)
        pipe = PipelineSchedule(stage, ctx, num_microbatches=cfg.parallel.microbatches,
                                schedule=cfg.parallel.schedule)
    data_ranks = ctx.world_size // ctx.pp_size  # ranks reading their own batch (each stage has them all)
    optimizer = make_optimizer(model, t, ctx.device)
    # One backward a step without a pipeline: each bucket's all-reduce starts once its gradients are in.
    dense = (GradientBuckets(model.dense_parameters(), ctx.stage_group, data_ranks, overlap=pipe is None)
             if ctx.distributed else None)
    data = MarkovText(cfg.model.vocab_size, seed=t.seed)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda"
                else contextlib.nullcontext())

    run_dir = Path(t.out_dir) / t.name
    ckpt_dir = run_dir / "ckpt"
    first_step = 1
    resuming = t.resume or restart_count() > 0
    saver = checkpoint.Checkpointer(ckpt_dir, ctx) if t.checkpoint_every or resuming else None
    if resuming:
        found = saver.latest()
        if found is None and t.resume:
            raise FileNotFoundError(f"train.resume: no valid checkpoint under {ckpt_dir}")
        if found is not None:
            saved, marker = found
            if t.resume and restart_count() == 0 and saved >= t.steps:
                raise ValueError(f"train.steps: expected more than the checkpoint's step {saved} to resume, "
                                 f"got {t.steps}")
            saver.load(saved, marker, model=model, optimizer=optimizer)
            was = marker["saved_with"]
            log.info("resumed from %s (saved at world size %d, EP %d, PP %d; this job %d, EP %d, PP %d; restart %d)",
                     checkpoint.step_dir(ckpt_dir, saved), was["world_size"], was["ep_size"], was["pp_size"],
                     ctx.world_size, ctx.ep_size, ctx.pp_size, restart_count())
            first_step = saved + 1
    else:  # a fresh run: earlier checkpoints are refused, or deleted with --overwrite
        if ctx.rank == 0:
            checkpoint.existing_checkpoints(ckpt_dir, overwrite=t.overwrite)
        if ctx.distributed:
            dist.barrier()

    metrics = None
    if ctx.rank == 0:
        old = run_dir / "metrics.jsonl"
        earlier = read_metrics(old) if first_step > 1 and old.is_file() else []
        metrics = MetricsLog(run_dir)
        for record_ in earlier:
            if record_["step"] < first_step:
                metrics.write(record_)
    log.info("training %s: %d ranks, EP %d, %d experts, steps %d..%d -> %s", t.name, ctx.world_size, ctx.ep_size,
             cfg.model.moe.num_experts, first_step, t.steps, run_dir)
    progress = _progress(t.steps, initial=first_step - 1, terminal=terminal if ctx.rank == 0 else None)
    tokens_per_step = t.batch_size * t.seq_len * data_ranks
    flops_per_step = train_flops_per_token(cfg.model, t.seq_len) * tokens_per_step
    peak = peak_tflops(ctx.device)
    times = StepTimes(model, ctx.device, attention=Attention, experts=GroupedExperts)
    profiler = _profiler(run_dir, ctx) if t.profile else None
    if profiler:
        profiler.start()
    rebalancer = (Rebalancer(model, optimizer, ctx, every=t.replan_every, max_moved=t.replan_max_moved,
                             expert_groups=cfg.model.moe.router.num_groups) if t.replan_every else None)
    def batch_of(step: int) -> torch.Tensor:  # this rank's slice of the step's global batch
        return data.batch(t.batch_size, t.seq_len + 1, seed=t.seed * 1_000_003 + step,
                          first=ctx.rank % data_ranks * t.batch_size)

    losses, upcoming_BS = [], batch_of(first_step)
    for step in range(first_step, t.steps + 1):
        at.step = step
        if fault:
            if saver:  # a test's fault comes after the previous save is complete
                saver.wait()
            fault.maybe_fire(ctx.rank, step)
        start = time.perf_counter()
        tokens_BS = upcoming_BS
        if dense:
            dense.attach()
        if pipe is None:
            with times.span("forward"), autocast:
                loss = model.loss(tokens_BS.to(ctx.device))
            with times.span("backward"):
                loss.backward()
        else:  # the loss is the last stage's; the others add zeros to the mean below
            with times.span("pipeline step"), autocast:
                loss = pipe.step(tokens_BS.to(ctx.device))
            loss = torch.zeros((), device=ctx.device) if loss is None else loss
        with times.span("gradient reduction"):
            average_gradients(model, ctx, dense)
            sync_replica_gradients(model, ctx)
            norm = clip_grad_norm(model, ctx, t.max_grad_norm) if t.max_grad_norm else grad_norm(model, ctx)
        lr = learning_rate(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with times.span("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step < t.steps:  # on the host while the GPU runs the optimizer (it idled 10 ms a step)
            upcoming_BS = batch_of(step + 1)
        load_LE = global_expert_load(model, ctx)
        for moe, load_E in zip(model.moe_layers, load_LE):
            moe.router.update_bias(load_E)
        mean_loss = loss.detach().float()
        if ctx.distributed:
            with ctx.activity("the loss all-reduce"):
                dist.all_reduce(mean_loss)
            mean_loss /= data_ranks
        losses.append(float(mean_loss))
        rank_imbalance = rank_load_imbalance(model.moe_layers, load_LE, ctx.ep_size)  # before a move
        moved = rebalancer.after_step(step, load_LE) if rebalancer else None
        elapsed = time.perf_counter() - start
        if t.checkpoint_every and step % t.checkpoint_every == 0:
            saver.save(step, model=model, optimizer=optimizer)
        imbalance_L = load_LE.max(-1).values / load_LE.float().mean(-1)  # max/mean per MoE layer
        tflops = flops_per_step / ctx.world_size / elapsed / 1e12  # model FLOPs per GPU (metrics.py)
        parts = times.collect() | ({"pipeline_wait": pipe.wait_s} if pipe is not None else {})
        record_ = {"step": step, "loss": losses[-1], "lr": lr, "grad_norm": float(norm),
                   "tokens_per_s": tokens_per_step / elapsed, "tflops_per_gpu": tflops,
                   "mfu_percent": None if peak is None else 100 * tflops / peak,
                   "step_time_s": elapsed, "time_s": parts, "expert_load": load_LE.tolist(),
                   "load_imbalance": float(imbalance_L.max()), "rank_load_imbalance": rank_imbalance,
                   "experts_moved": moved}
        if metrics:
            metrics.write(record_)
        if profiler:
            profiler.step()
        progress.update(1)
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % t.log_every == 0 or step == t.steps:
            mfu = "" if peak is None else f" MFU {record_['mfu_percent']:.1f}%"
            log.info("step %d loss %.4f lr %.2e grad norm %.3f tokens/s %.0f TFLOP/s per GPU %.3g%s%s expert load "
                     "max/mean %.2f (MoE layer %d of %d)", step, losses[-1], record_["lr"], record_["grad_norm"],
                     record_["tokens_per_s"], tflops, mfu, "".join(f" {k} {v * 1e3:.1f} ms" for k, v in parts.items()),
                     record_["load_imbalance"], int(imbalance_L.argmax()) + 1, len(imbalance_L))
    progress.close()
    if rebalancer:
        rebalancer.close()
    if profiler:
        profiler.stop()
    if saver:
        saver.wait()
    summary = {"rank": ctx.rank, "node": ctx.node_rank, "host": socket.gethostname(), "restart": restart_count(),
               "first_step": first_step, "losses": losses}
    if metrics:
        metrics.close()
        floor = data.loss_floor(t.seq_len + 1)  # the batches hold seq_len + 1 tokens
        png = plot_loss(metrics.path, run_dir / "loss.png", floor=floor)
        if losses:
            log.info("loss %.3f -> %.3f (the data's floor %.3f, uniform %.3f); wrote %s and %s", losses[0],
                     losses[-1], floor, data.uniform_loss, metrics.path, png)
    return summary


def _profiler(run_dir: Path, ctx: ParallelContext):
    """``--profile``: a torch profiler over the run's second to fourth steps (the first warms up), its trace in
    ``<run>/profile/rank_<r>.json`` (chrome://tracing, Perfetto)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    path = run_dir / "profile" / f"rank_{ctx.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(prof) -> None:
        prof.export_chrome_trace(str(path))
        log.info("wrote the profiler trace %s", path)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    return profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
                   on_trace_ready=write, record_shapes=True)


def _progress(total: int, *, initial: int, terminal: TextIO | None):
    from tqdm import tqdm

    # A bar on a terminal only: in log files and Ray's log stream the step lines show progress.
    return tqdm(total=total, initial=initial, desc="train", disable=not (terminal and terminal.isatty()),
                file=terminal, dynamic_ncols=True)


@record
def main(argv: list[str] | None = None) -> None:
    """Entry point under torchrun: ``torchrun ... -m ep_runtime.train [train options]``."""
    worker(job_config_from_args(train_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
