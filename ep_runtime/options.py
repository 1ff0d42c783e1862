"""The training job's options: the ``ep-runtime train`` flags (also taken by ``python -m
ep_runtime.train`` under torchrun), the config file or preset they start from, and the
``JobConfig`` they make, checked before any process starts.

A flag overrides its key of the config (``FLAGS``); an error names what the user typed: the flag,
or the file and key.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from pathlib import Path

from .checkpoint_verify import fresh_run_refusal, steps_on_disk
from .config import (DISPATCH_FORMATS, DISPATCHERS, LOG_LEVELS, PIPELINE_SCHEDULES, JobConfig, ModelConfig, MoEConfig,
                     ParallelConfig, RouterConfig, TrainConfig)
from .config_files import build, preset_names, preset_path, read_toml

# Flag -> the config key it sets. Flags whose value is None (not given) leave the config's.
FLAGS = {
    "--layers": "model.num_layers", "--hidden": "model.hidden", "--experts": "model.moe.num_experts",
    "--topk": "model.moe.router.topk", "--dispatch-format": "model.moe.dispatch_format",
    "--dispatcher": "model.moe.dispatcher", "--max-tokens-per-rank": "model.moe.max_tokens_per_rank",
    "--bias-update-rate": "model.moe.router.bias_update_rate", "--aux-loss-coef": "model.moe.router.aux_loss_coef",
    "--ep": "parallel.ep", "--pp": "parallel.pp", "--microbatches": "parallel.microbatches",
    "--schedule": "parallel.schedule", "--virtual-stages": "parallel.virtual_stages",
    "--ranks-per-node": "parallel.ranks_per_node", "--timeout": "parallel.timeout_s",
    "--steps": "train.steps", "--batch-size": "train.batch_size", "--seq-len": "train.seq_len", "--lr": "train.lr",
    "--warmup-fraction": "train.warmup_fraction", "--weight-decay": "train.weight_decay",
    "--max-grad-norm": "train.max_grad_norm", "--seed": "train.seed", "--out": "train.out_dir",
    "--name": "train.name", "--log-every": "train.log_every", "--log-level": "train.log_level",
    "--checkpoint-every": "train.checkpoint_every", "--resume": "train.resume", "--overwrite": "train.overwrite",
    "--profile": "train.profile", "--replan-every": "train.replan_every", "--fp8-experts": "model.moe.fp8_experts",
    "--replan-max-moved": "train.replan_max_moved",
}


def train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="ep-runtime train", description="Train an MoE model.")
    t, par, moe, router = TrainConfig, ParallelConfig, MoEConfig, RouterConfig
    source = p.add_argument_group("what to train (a flag overrides its key of the config)")
    source.add_argument("--model", choices=preset_names(), help="a preset: ep_runtime/configs/MODEL.toml (default tiny)")
    source.add_argument("--config", metavar="FILE", help="a TOML config file instead of a preset "
                        "(tables [model], [model.moe], [model.moe.router], [parallel], [train]; default: the preset)")
    source.add_argument("--layers", type=int, help="blocks (default: the config's model.num_layers)")
    source.add_argument("--hidden", type=int, help="hidden size (default: the config's model.hidden)")
    source.add_argument("--experts", type=int, help="routed experts (default: the config's model.moe.num_experts)")
    source.add_argument("--topk", type=int, help="routes per token (default: the config's model.moe.router.topk)")
    source.add_argument("--bias-update-rate", type=float,
                        help=f"aux-loss-free balancing's bias step, 0: off (default {router.bias_update_rate}; "
                             "v3-layer 1e-2)")
    source.add_argument("--aux-loss-coef", type=float,
                        help=f"sequence-wise balance loss weight, DeepSeek-V3's alpha (default {router.aux_loss_coef})")
    par_ = p.add_argument_group("parallelism")
    par_.add_argument("--ep", type=int, help="EP group size (default: all ranks of a pipeline stage)")
    par_.add_argument("--pp", type=int, help=f"pipeline stages (default {par.pp}: none)")
    par_.add_argument("--microbatches", type=int, help="micro-batches per step with --pp > 1 or --schedule overlap "
                      "(default 2 x --pp; 2 with overlap at --pp 1)")
    par_.add_argument("--schedule", choices=PIPELINE_SCHEDULES, help=f"pipeline schedule (default {par.schedule}; "
                      "overlap: two lanes of micro-batches at once; at --pp 1, one micro-batch's forward beside the other's "
                      "backward over EP)")
    par_.add_argument("--virtual-stages", type=int,
                      help="model chunks per stage with --schedule interleaved (default 2)")
    par_.add_argument("--dispatcher", choices=DISPATCHERS,
                      help=f"dispatch/combine backend (default {moe.dispatcher}; nvlink: symmetric memory, no host "
                           "sync, all_to_all between nodes when the EP group spans them; deepep: needs deep_ep)")
    par_.add_argument("--dispatch-format", choices=DISPATCH_FORMATS,
                      help=f"how tokens travel to their experts (default {moe.dispatch_format}: unquantized; e4m3: "
                           "FP8 with per-token 1x128 scales; e2m1: FP4 with e4m3 scales per 16 columns, all_to_all "
                           "only)"),
    par_.add_argument("--fp8-experts", action="store_const", const=True,
                      help=f"the routed experts' GEMMs in FP8 with DeepSeek-V3's 1x128 / 128x128 scaling (default "
                           f"{moe.fp8_experts}; segments then aligned to 128 rows)")
    par_.add_argument("--max-tokens-per-rank", type=int, help="nvlink: most tokens a rank dispatches per layer "
                      "call (default: --batch-size x --seq-len)")
    par_.add_argument("--ranks-per-node", type=int, help="ranks per node (default: LOCAL_WORLD_SIZE); fewer "
                      "declares more nodes, e.g. 1 for two-stage nvlink dispatch on one host")
    par_.add_argument("--timeout", type=float, help=f"seconds a rank may wait on the others before the job ends, "
                      f"naming the wait (default {par.timeout_s:.0f})")
    run = p.add_argument_group("training")
    run.add_argument("--steps", type=int, help=f"optimizer steps (default {t.steps})")
    run.add_argument("--batch-size", type=int, help=f"sequences per data rank and step (default {t.batch_size})")
    run.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {t.seq_len})")
    run.add_argument("--lr", type=float, help=f"peak learning rate, after warmup (default {t.lr}; v3-layer 3e-4)")
    run.add_argument("--warmup-fraction", type=float, help="fraction of the steps warming the learning rate up "
                     f"(default {t.warmup_fraction}); then cosine decay to {t.min_lr_ratio} x --lr")
    run.add_argument("--weight-decay", type=float, help=f"AdamW's, on matrices only (default {t.weight_decay})")
    run.add_argument("--max-grad-norm", type=float,
                     help=f"clip the whole model's gradient norm to this, 0: off (default {t.max_grad_norm})")
    run.add_argument("--seed", type=int, help=f"model and data seed (default {t.seed})")
    run.add_argument("--out", help=f"output directory (default {t.out_dir}/)")
    run.add_argument("--name", help="run name: the run's folder under --out (default: the preset's or config's name)")
    run.add_argument("--log-every", type=int, metavar="N", help=f"a log line every N steps (default {t.log_every})")
    run.add_argument("--log-level", choices=LOG_LEVELS,
                     help=f"the terminal's log level (default {t.log_level}); the run's log files keep everything")
    run.add_argument("--checkpoint-every", type=int, metavar="N",
                     help="save a checkpoint every N steps under OUT/NAME/ckpt/ (default 0: never)")
    run.add_argument("--resume", action="store_const", const=True,
                     help="continue from the newest valid checkpoint, at any world, EP or PP size (default: start "
                          "afresh)")
    run.add_argument("--overwrite", action="store_const", const=True,
                     help="a fresh run deletes the checkpoints under OUT/NAME/ckpt/ (default: it refuses to start)")
    run.add_argument("--profile", action="store_const", const=True,
                     help="write a torch profiler trace of a few steps into OUT/NAME/profile/ (default: off)")
    run.add_argument("--replan-every", type=int, metavar="N",
                     help="every N steps re-plan the expert placement from the measured expert loads in a background "
                          "thread and move experts (with their optimizer state) between EP ranks at the next step "
                          "boundary (default 0: off)")
    run.add_argument("--replan-max-moved", type=float, metavar="F",
                     help=f"the most slots of a MoE layer (a fraction) one re-plan may move (default "
                          f"{t.replan_max_moved})")
    return p


class Origins:
    """Where each config key's value came from, to name it in errors: the flag the user typed,
    else the config file, else (a default) the flag that would set it."""

    def __init__(self, source: str, flags: dict[str, str], in_file: set[str]):
        self.source, self.flags, self.in_file = source, flags, in_file  # flags: config key -> flag

    def name(self, key: str) -> str:
        if key in self.flags:
            return self.flags[key]
        if key in self.in_file:
            return f"{key} of {self.source}"
        return next((flag for flag, k in FLAGS.items() if k == key), key)

    def given(self, key: str) -> bool:
        return key in self.flags

    def explain(self, error: ValueError) -> ValueError:
        """``error`` (``"model.moe.topk: expected ..."``) with its key named as the user set it."""
        match = re.match(r"([a-z_]+(?:\.[a-z_]+)+): (.*)", str(error), re.S)
        if not match:
            return error
        return ValueError(f"{self.name(match[1])}: {match[2]}")


def job_config_from_args(a: argparse.Namespace) -> JobConfig:
    """The job ``a`` asks for: its preset or config file, then its flags."""
    return resolve(a)[0]


def resolve(a: argparse.Namespace) -> tuple[JobConfig, Origins]:
    if a.model and a.config:
        raise ValueError(f"--config {a.config}: expected either --model or --config, got --model {a.model} too")
    path = Path(a.config) if a.config else preset_path(a.model or "tiny")
    try:
        table = read_toml(path)
    except ValueError as error:
        raise ValueError(f"--config {error}" if a.config else str(error)) from None
    in_file = set(_keys(table))
    flags = {}
    for flag, key in FLAGS.items():
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None:
            _set(table, key, value)
            flags[key] = flag
    origins = Origins(str(path) if a.config else f"the {a.model or 'tiny'} preset", flags, in_file)
    try:
        return _derive(table, default_name=a.model or path.stem), origins
    except ValueError as error:
        raise origins.explain(error) from None


def _derive(table: dict, *, default_name: str) -> JobConfig:
    """The ``JobConfig`` of ``table``, with the defaults that follow from other keys."""
    train = build(TrainConfig, {"name": default_name, **table.get("train", {})}, "train")
    parallel = table.setdefault("parallel", {})
    pp = parallel.get("pp", ParallelConfig.pp)
    lanes = 2 if parallel.get("schedule") == "overlap" else 1
    parallel.setdefault("microbatches", 2 * pp if isinstance(pp, int) and pp > 1 else lanes)
    interleaved = parallel.get("schedule") == "interleaved"
    parallel.setdefault("virtual_stages", 2 if interleaved else 1)
    model = table.setdefault("model", {})
    moe = model.setdefault("moe", {})
    moe.setdefault("max_tokens_per_rank", train.batch_size * train.seq_len)
    if moe.get("fp8_experts") is True:
        moe.setdefault("alignment", 128)  # an FP8 GEMM tile's rows
    model["max_seq_len"] = max(model.get("max_seq_len", ModelConfig.max_seq_len), train.seq_len)
    return build(JobConfig, {**table, "train": dataclasses.asdict(train)})


def _keys(table: dict, prefix: str = ""):
    for name, value in table.items():
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def _set(table: dict, key: str, value) -> None:
    *tables, last = key.split(".")
    for name in tables:
        table = table.setdefault(name, {})
    table[last] = value


def check_launch(cfg: JobConfig, nproc: int, o: Origins) -> None:
    """What the workers would refuse as they start, said before any starts, naming what the user
    typed (``o``: where each value came from)."""
    pp = cfg.parallel.pp
    if nproc < 1:
        raise ValueError(f"--num-workers: expected at least 1, got {nproc}")
    if nproc % pp:
        raise ValueError(f"{o.name('parallel.pp')} {pp}: expected a divisor of the {nproc} worker processes "
                         "(--num-workers)")
    per_stage = nproc // pp
    ep = cfg.parallel.ep or per_stage
    if per_stage % ep:
        raise ValueError(f"{o.name('parallel.ep')} {ep}: expected a divisor of the {per_stage} ranks of a pipeline "
                         f"stage ({nproc} processes, --pp {pp})")
    if cfg.model.moe.num_experts % ep:
        raise ValueError(f"{o.name('parallel.ep')} {ep}: expected a divisor of the model's "
                         f"{cfg.model.moe.num_experts} experts ({o.name('model.moe.num_experts')})")
    _check_pipeline(cfg, o)
    _check_dispatcher(cfg, ep, o)
    ckpt = Path(cfg.train.out_dir) / cfg.train.name / "ckpt"
    if cfg.train.resume and not steps_on_disk(ckpt):
        raise ValueError(f"--resume: no checkpoint under {ckpt} (--out and --name say where the run is)")
    if not (cfg.train.resume or cfg.train.overwrite):
        refusal = fresh_run_refusal(ckpt)
        if refusal:
            raise ValueError(refusal)


def _check_pipeline(cfg: JobConfig, o: Origins) -> None:
    pp, microbatches, batch_size = cfg.parallel.pp, cfg.parallel.microbatches, cfg.train.batch_size
    layers, chunks = cfg.model.num_layers, cfg.parallel.virtual_stages
    if pp == 1 and cfg.parallel.schedule != "overlap":  # the whole batch at once
        return
    if pp * chunks > layers:
        what = f"{pp} stages x {chunks} virtual stages" if chunks > 1 else f"{pp} stages"
        raise ValueError(f"{o.name('parallel.pp')} {pp}: expected at most one stage per block; {what} for "
                         f"{layers} blocks ({o.name('model.num_layers')})")
    if batch_size % microbatches:
        if not o.given("parallel.microbatches"):
            whose = (f"{o.name('parallel.pp')} {pp}: its default micro-batches, 2 x {pp} = {microbatches}," if pp > 1
                     else f"{o.name('parallel.schedule')} overlap: its default micro-batches, {microbatches} (two lanes),")
            raise ValueError(f"{whose} do not divide {o.name('train.batch_size')} {batch_size}; give --microbatches, a "
                             f"divisor of {batch_size}")
        raise ValueError(f"{o.name('parallel.microbatches')} {microbatches}: expected a divisor of "
                         f"{o.name('train.batch_size')} {batch_size}")
    if cfg.parallel.schedule == "interleaved" and microbatches % pp:
        raise ValueError(f"{o.name('parallel.microbatches')} {microbatches}: expected a multiple of "
                         f"{o.name('parallel.pp')} {pp} with the interleaved schedule")
    if pp > 1 and cfg.model.moe.router.aux_loss_coef > 0:
        raise ValueError(f"{o.name('model.moe.router.aux_loss_coef')}: expected 0 with pipeline stages "
                         f"({o.name('parallel.pp')} {pp}; not supported yet), got {cfg.model.moe.router.aux_loss_coef}")


def _check_dispatcher(cfg: JobConfig, ep: int, o: Origins) -> None:
    if cfg.model.moe.dispatcher == "deepep" and importlib.util.find_spec("deep_ep") is None:
        raise ValueError(f"{o.name('model.moe.dispatcher')} deepep: the deep_ep package is not installed "
                         "(github.com/deepseek-ai/DeepEP); all_to_all and nvlink need nothing more")
    per_node = cfg.parallel.ranks_per_node
    if per_node is not None and ep > per_node and ep % per_node:
        raise ValueError(f"{o.name('parallel.ranks_per_node')} {per_node}: expected a divisor of the EP size {ep}")
