"""Configuration: nested, frozen, keyword-only dataclasses.

Each component takes only its own part (the router its ``RouterConfig``, the MoE layer its
``MoEConfig``). Validation happens at construction and errors name the config path
(``model.moe.router.topk``) so a bad command-line value points at itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
DISPATCHERS = ("all_to_all",)


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

    def __post_init__(self):
        p = "model.moe.router"
        _require(self.scoring in SCORINGS, f"{p}.scoring", f"one of {SCORINGS}", self.scoring)
        _require(self.topk >= 1, f"{p}.topk", ">= 1", self.topk)
        _require(self.num_groups >= 1, f"{p}.num_groups", ">= 1", self.num_groups)
        if self.topk_groups is not None:
            _require(1 <= self.topk_groups <= self.num_groups, f"{p}.topk_groups",
                     f"in [1, num_groups={self.num_groups}]", self.topk_groups)
        _require(self.bias_update_rate >= 0, f"{p}.bias_update_rate", ">= 0", self.bias_update_rate)
        _require(self.aux_loss_coef >= 0, f"{p}.aux_loss_coef", ">= 0", self.aux_loss_coef)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer: routed experts (SwiGLU), shared experts, and how tokens travel."""

    num_experts: int = 8
    expert_hidden: int = 64
    num_shared_experts: int = 1
    alignment: int = 8  # rows per expert segment are padded to this (128 for grouped GEMM on GPU)
    fp8_dispatch: bool = False  # tokens travel as FP8 e4m3 with per-token 1x128 scales
    dispatcher: str = "all_to_all"
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self):
        p = "model.moe"
        _require(self.num_experts >= 1, f"{p}.num_experts", ">= 1", self.num_experts)
        _require(self.expert_hidden >= 1, f"{p}.expert_hidden", ">= 1", self.expert_hidden)
        _require(self.num_shared_experts >= 0, f"{p}.num_shared_experts", ">= 0", self.num_shared_experts)
        _require(self.alignment >= 1, f"{p}.alignment", ">= 1", self.alignment)
        _require(self.dispatcher in DISPATCHERS, f"{p}.dispatcher", f"one of {DISPATCHERS}", self.dispatcher)
        _require(self.num_experts % self.router.num_groups == 0, f"{p}.router.num_groups",
                 f"a divisor of num_experts={self.num_experts}", self.router.num_groups)
        selectable = self.num_experts // self.router.num_groups * (self.router.topk_groups or self.router.num_groups)
        _require(self.router.topk <= selectable, f"{p}.router.topk",
                 f"<= {selectable} experts selectable from the kept groups", self.router.topk)


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

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "max_seq_len", "dense_hidden"):
            _require(getattr(self, name) >= 1, f"model.{name}", ">= 1", getattr(self, name))
        _require(self.hidden % self.num_heads == 0, "model.num_heads",
                 f"a divisor of hidden={self.hidden}", self.num_heads)
        _require(0 <= self.dense_layers <= self.num_layers, "model.dense_layers",
                 f"in [0, num_layers={self.num_layers}]", self.dense_layers)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How ranks are split: ``ep`` ranks share one set of experts; EP borrows from DP."""

    ep: int | None = None  # None: all ranks form one EP group
    timeout_s: float = 300.0  # collectives that take longer end the job

    def __post_init__(self):
        if self.ep is not None:
            _require(self.ep >= 1, "parallel.ep", ">= 1", self.ep)
        _require(self.timeout_s > 0, "parallel.timeout_s", "> 0", self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 8  # sequences per rank per step
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    out_dir: str = "runs"
    name: str = "tiny"
    log_every: int = 10

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            _require(getattr(self, name) >= 1, f"train.{name}", ">= 1", getattr(self, name))
        _require(self.lr > 0, "train.lr", "> 0", self.lr)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        _require(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
                 f"<= model.max_seq_len={self.model.max_seq_len}", self.train.seq_len)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
