"""Configuration: nested, frozen, keyword-only dataclasses.

Each component takes only its own part (the router its ``RouterConfig``, the MoE layer its
``MoEConfig``). Validation happens at construction and errors name the config path
(``model.moe.router.topk``) so a bad command-line value points at itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
DISPATCHERS = ("all_to_all", "nvlink", "deepep")
# How tokens travel to their experts (``model.moe.dispatch_format``): as they are, as FP8 e4m3 with
# per-token 1x128 float32 scales, or as FP4 e2m1 with e4m3 scales per 16 columns under a float32
# scale per token (kernels.quant.per_token_cast_fp4_e4m3_sf; all_to_all only).
DISPATCH_FORMATS = ("bf16", "e4m3", "e2m1")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "overlap")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _require(ok: bool, path: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"{path}: expected {expected}, got {got!r}")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Top-k gating (DeepSeek-V3 style) and aux-loss-free balancing."""

    scoring: str = "sigmoid"
    topk: int = 2
    num_groups: int = 1
    topk_groups: int | None = None
    normalize: bool = True
    routed_scaling_factor: float = 1.0
    bias_update_rate: float = 1e-3  # aux-loss-free balancing step; 0 disables it
    aux_loss_coef: float = 0.0  # sequence-wise balance loss weight; 0 disables it
    # Route each token by its input minus the mean of its sequence's inputs up to it (causal, not
    # differentiated): a direction the sequence's tokens share then steers none of them.
    center_inputs: bool = False

    def __post_init__(self):
        p = "model.moe.router"
        _require(self.scoring in SCORINGS, f"{p}.scoring", f"one of {SCORINGS}", self.scoring)
        _require(_is_int(self.topk) and self.topk >= 1, f"{p}.topk", "an int >= 1", self.topk)
        _require(_is_int(self.num_groups) and self.num_groups >= 1, f"{p}.num_groups", "an int >= 1", self.num_groups)
        if self.topk_groups is not None:
            _require(_is_int(self.topk_groups) and 1 <= self.topk_groups <= self.num_groups, f"{p}.topk_groups",
                     f"an int in [1, num_groups={self.num_groups}]", self.topk_groups)
        _require(isinstance(self.normalize, bool), f"{p}.normalize", "a bool", self.normalize)
        _require(isinstance(self.center_inputs, bool), f"{p}.center_inputs", "a bool", self.center_inputs)
        _require(_is_number(self.routed_scaling_factor), f"{p}.routed_scaling_factor", "a finite number",
                 self.routed_scaling_factor)
        for name in ("bias_update_rate", "aux_loss_coef"):
            value = getattr(self, name)
            _require(_is_number(value) and value >= 0, f"{p}.{name}", "a finite number >= 0", value)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer: routed experts (SwiGLU), shared experts, and how tokens travel."""

    num_experts: int = 8
    expert_hidden: int = 64
    num_shared_experts: int = 1
    # Rows per expert segment are padded to this. 8 is what torch._grouped_mm needs in bf16 (its
    # weight gradient sums over rows, 16-byte aligned); 128 is DeepGEMM's FP8 contiguous layout, and
    # costs padding rows that every pass over the layout writes or reads (MoE layer 38.7 vs 36.3 ms at
    # the DeepSeek-V3 shape on an H100).
    alignment: int = 8
    dispatch_format: str = "bf16"  # one of DISPATCH_FORMATS; "bf16": the activations' dtype, unquantized
    fp8_combine: bool = False  # expert outputs travel home as FP8 too (all_to_all, nvlink, and both stages across nodes)
    fp8_experts: bool = False  # the routed experts' GEMMs in FP8 (kernels.gemm; needs alignment a multiple of 128)
    dispatcher: str = "all_to_all"  # "nvlink": symmetric memory, no host sync; "deepep": DeepEP's Buffer
    max_tokens_per_rank: int = 4096  # nvlink: the most tokens one rank dispatches per call (sizes its buffers)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self):
        p = "model.moe"
        _require(self.num_experts >= 1, f"{p}.num_experts", ">= 1", self.num_experts)
        _require(self.expert_hidden >= 1, f"{p}.expert_hidden", ">= 1", self.expert_hidden)
        _require(self.num_shared_experts >= 0, f"{p}.num_shared_experts", ">= 0", self.num_shared_experts)
        _require(self.alignment >= 1, f"{p}.alignment", ">= 1", self.alignment)
        _require(not self.fp8_experts or self.alignment % 128 == 0, f"{p}.alignment",
                 "a multiple of 128 with fp8_experts (an FP8 GEMM tile's rows)", self.alignment)
        _require(self.dispatcher in DISPATCHERS, f"{p}.dispatcher", f"one of {DISPATCHERS}", self.dispatcher)
        _require(self.dispatch_format in DISPATCH_FORMATS, f"{p}.dispatch_format", f"one of {DISPATCH_FORMATS}",
                 self.dispatch_format)
        _require(self.dispatch_format != "e2m1" or self.dispatcher == "all_to_all", f"{p}.dispatch_format",
                 f"bf16 or e4m3 with the {self.dispatcher} dispatcher (e2m1 travels over all_to_all only)",
                 self.dispatch_format)
        _require(not (self.fp8_combine and self.dispatcher == "deepep"), f"{p}.fp8_combine",
                 "false with the deepep dispatcher (its combine is bf16)", self.fp8_combine)
        _require(_is_int(self.max_tokens_per_rank) and self.max_tokens_per_rank >= 1, f"{p}.max_tokens_per_rank",
                 "an int >= 1", self.max_tokens_per_rank)
        _require(self.num_experts % self.router.num_groups == 0, f"{p}.router.num_groups",
                 f"a divisor of num_experts={self.num_experts}", self.router.num_groups)
        selectable = self.num_experts // self.router.num_groups * (self.router.topk_groups or self.router.num_groups)
        _require(self.router.topk <= selectable, f"{p}.router.topk",
                 f"<= {selectable} experts selectable from the kept groups", self.router.topk)


@dataclass(frozen=True, kw_only=True)
class MHCConfig:
    """mHC: the residual stream widened to ``n`` streams, mixed around every sublayer
    (``ep_runtime/mhc.py``)."""

    n: int = 4  # residual streams
    sinkhorn_iters: int = 20
    eps: float = 1e-6  # the norm's, the pre weights' and Sinkhorn's epsilon
    recompute: bool = False  # recompute the mixing coefficients in backward instead of keeping them

    def __post_init__(self):
        p = "model.mhc"
        _require(_is_int(self.n) and self.n >= 1, f"{p}.n", "an int >= 1", self.n)
        _require(_is_int(self.sinkhorn_iters) and self.sinkhorn_iters >= 1, f"{p}.sinkhorn_iters", "an int >= 1",
                 self.sinkhorn_iters)
        _require(isinstance(self.eps, (int, float)) and 0 <= self.eps < float("inf"), f"{p}.eps",
                 "a finite float >= 0", self.eps)


@dataclass(frozen=True, kw_only=True)
class EngramConfig:
    """Engram: hashed n-gram memory added to the residual before the attention of ``layers``
    (``ep_runtime/engram.py``). Its tables are sharded by rows over the EP group."""

    layers: tuple[int, ...] = (0,)  # blocks that get an Engram (distinct, in [0, model.num_layers))
    max_ngram: int = 3  # n-gram orders 2..max_ngram; also the short conv's dilation
    num_heads: int = 2  # hash heads (tables) per order
    table_size: int = 1009  # rows of a table: the smallest unused prime >= this
    head_dim: int = 16  # width of one table's rows; the memory vector is (max_ngram - 1) * num_heads of them

    def __post_init__(self):
        p = "model.engram"
        object.__setattr__(self, "layers", tuple(self.layers))  # a list from a command line or JSON
        _require(len(self.layers) >= 1 and all(_is_int(i) and i >= 0 for i in self.layers)
                 and len(set(self.layers)) == len(self.layers), f"{p}.layers", "distinct ints >= 0, at least one",
                 self.layers)
        _require(_is_int(self.max_ngram) and self.max_ngram >= 2, f"{p}.max_ngram", "an int >= 2", self.max_ngram)
        _require(_is_int(self.num_heads) and self.num_heads >= 1, f"{p}.num_heads", "an int >= 1", self.num_heads)
        _require(_is_int(self.table_size) and self.table_size >= 2, f"{p}.table_size", "an int >= 2",
                 self.table_size)
        _require(_is_int(self.head_dim) and self.head_dim >= 1, f"{p}.head_dim", "an int >= 1", self.head_dim)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A tiny DeepSeek-style decoder: attention + MoE blocks (the first ``dense_layers`` dense)."""

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_seq_len: int = 64
    dense_layers: int = 0
    dense_hidden: int = 128
    moe: MoEConfig = field(default_factory=MoEConfig)
    mhc: MHCConfig | None = None  # None: one residual stream
    engram: EngramConfig | None = None  # None: no Engram layers

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "max_seq_len", "dense_hidden"):
            _require(getattr(self, name) >= 1, f"model.{name}", ">= 1", getattr(self, name))
        _require(self.hidden % self.num_heads == 0, "model.num_heads",
                 f"a divisor of hidden={self.hidden}", self.num_heads)
        _require(0 <= self.dense_layers <= self.num_layers, "model.dense_layers",
                 f"in [0, num_layers={self.num_layers}]", self.dense_layers)
        _require(self.hidden % 2 == 0 or self.moe.dispatch_format != "e2m1", "model.hidden",
                 "an even size with e2m1 dispatch (two values a byte)", self.hidden)
        if self.engram is not None:
            _require(all(i < self.num_layers for i in self.engram.layers), "model.engram.layers",
                     f"layers in [0, num_layers={self.num_layers})", self.engram.layers)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How ranks are split: ``pp`` pipeline stages, each of ``world / pp`` ranks; within a stage
    ``ep`` ranks share one set of experts; EP borrows from DP."""

    pp: int = 1  # pipeline stages (ep_runtime/pipeline.py)
    microbatches: int = 1  # per step and rank, with pp > 1 or the overlap schedule; must divide train.batch_size
    schedule: str = "1f1b"  # pipeline schedule, one of PIPELINE_SCHEDULES (ep_runtime/pipeline.md)
    virtual_stages: int = 1  # model chunks per stage: > 1 with the interleaved schedule
    ep: int | None = None  # None: all ranks of a stage form one EP group
    ranks_per_node: int | None = None  # None: LOCAL_WORLD_SIZE; an EP group spanning nodes dispatches in two stages
    timeout_s: float = 300.0  # collectives that take longer end the job

    def __post_init__(self):
        _require(isinstance(self.pp, int) and self.pp >= 1, "parallel.pp", "an int >= 1", self.pp)
        _require(isinstance(self.microbatches, int) and self.microbatches >= 1, "parallel.microbatches",
                 "an int >= 1", self.microbatches)
        _require(self.schedule in PIPELINE_SCHEDULES, "parallel.schedule", f"one of {PIPELINE_SCHEDULES}",
                 self.schedule)
        _require(self.schedule != "overlap" or self.microbatches % 2 == 0, "parallel.microbatches",
                 "an even number with the overlap schedule (two lanes)", self.microbatches)
        _require(_is_int(self.virtual_stages) and self.virtual_stages >= 1
                 and (self.virtual_stages > 1) == (self.schedule == "interleaved"), "parallel.virtual_stages",
                 "an int > 1 with the interleaved schedule, 1 with the others", self.virtual_stages)
        _require(self.pp > 1 or self.schedule in ("1f1b", "gpipe", "overlap"), "parallel.schedule",
                 "'1f1b', 'gpipe' or 'overlap' with one pipeline stage (parallel.pp = 1)", self.schedule)
        if self.ep is not None:
            _require(self.ep >= 1, "parallel.ep", ">= 1", self.ep)
        if self.ranks_per_node is not None:
            _require(_is_int(self.ranks_per_node) and self.ranks_per_node >= 1, "parallel.ranks_per_node",
                     "an int >= 1", self.ranks_per_node)
        _require(self.timeout_s > 0, "parallel.timeout_s", "> 0", self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 8  # sequences per rank per step
    seq_len: int = 64
    lr: float = 3e-3  # the peak, after warmup; cosine decay to lr * min_lr_ratio at the last step
    warmup_fraction: float = 0.05  # of the steps, warming the learning rate up linearly
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # AdamW's, on matrices only (optim.param_groups)
    max_grad_norm: float = 1.0  # clip the whole model's gradient norm to this; 0: no clipping
    seed: int = 0
    out_dir: str = "runs"
    name: str = "tiny"
    log_every: int = 10
    log_level: str = "info"  # the terminal's (rank 0's lines); the run's log files keep every level
    checkpoint_every: int = 0  # steps between checkpoints (out_dir/name/ckpt/step_<n>/); 0: none
    resume: bool = False  # continue from the newest checkpoint (a restarted job always does, if one exists)
    overwrite: bool = False  # a fresh run deletes the checkpoints it finds (else it refuses to start)
    profile: bool = False  # write a torch profiler trace of a few steps into out_dir/name/profile/
    replan_every: int = 0  # steps between online re-plans of the expert placement (ep_runtime/rebalance.py); 0: off
    replan_max_moved: float = 0.08  # the most slots of a MoE layer (a fraction) one re-plan may move

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_fraction * self.steps)

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            _require(getattr(self, name) >= 1, f"train.{name}", ">= 1", getattr(self, name))
        _require(self.lr > 0, "train.lr", "> 0", self.lr)
        _require(0 <= self.warmup_fraction < 1, "train.warmup_fraction", "in [0, 1)", self.warmup_fraction)
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        _require(self.weight_decay >= 0, "train.weight_decay", ">= 0", self.weight_decay)
        _require(self.max_grad_norm >= 0, "train.max_grad_norm", ">= 0", self.max_grad_norm)
        _require(self.checkpoint_every >= 0, "train.checkpoint_every", ">= 0", self.checkpoint_every)
        _require(_is_int(self.replan_every) and self.replan_every >= 0, "train.replan_every", "an int >= 0",
                 self.replan_every)
        _require(0 <= self.replan_max_moved <= 1, "train.replan_max_moved", "in [0, 1]", self.replan_max_moved)
        _require(self.log_level in LOG_LEVELS, "train.log_level", f"one of {LOG_LEVELS}", self.log_level)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        _require(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
                 f"<= model.max_seq_len={self.model.max_seq_len}", self.train.seq_len)

