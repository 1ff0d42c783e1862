"""Worker functions for the pipeline tests (run in spawned gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpus import parallel_config

from ep_runtime.config import EngramConfig, MHCConfig, ModelConfig, MoEConfig, RouterConfig
from ep_runtime.dispatch import make_dispatcher
from ep_runtime.gradients import average_gradients
from ep_runtime.model import TinyDeepSeek
from ep_runtime.parallel import init_parallel, single_process
from ep_runtime.pipeline import PipelineSchedule, PipelineStage

SEQ, BATCH, LR = 6, 4, 0.1  # sequences per data rank; SEQ + 1 tokens each (inputs and targets)
FLOOR = 1e-2  # gradient errors are relative to at least this fraction of the model's largest gradient


def model_config(variant: str) -> ModelConfig:
    """``variant``: plain, mhc, mhc-recompute or mhc-engram, with ``+nvlink`` for that dispatcher
    (each stage's EP group on a heap of its own; all_to_all otherwise)."""
    variant, _, dispatcher = variant.partition("+")
    moe = MoEConfig(num_experts=4, expert_hidden=8, num_shared_experts=1, alignment=4,
                    router=RouterConfig(scoring="sigmoid", topk=2, bias_update_rate=0.0),
                    dispatcher=dispatcher or "all_to_all", max_tokens_per_rank=BATCH * SEQ)
    extra = {}
    if variant in ("mhc", "mhc-engram", "mhc-recompute"):  # recompute: each stage keeps its input stream only
        extra["mhc"] = MHCConfig(n=2, sinkhorn_iters=5, recompute=variant == "mhc-recompute")
    if variant == "mhc-engram":  # one Engram layer on each stage
        extra["engram"] = EngramConfig(layers=(0, 3), max_ngram=2, num_heads=1, table_size=17, head_dim=4)
    return ModelConfig(vocab_size=32, hidden=16, num_layers=4, num_heads=2, max_seq_len=SEQ, dense_layers=1,
                       dense_hidden=16, moe=moe, **extra)


def tokens(data_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + data_rank)
    return torch.randint(0, 32, (BATCH, SEQ + 1), generator=g)


def _build(cfg: ModelConfig, ctx, lanes: int = 1) -> TinyDeepSeek:
    torch.manual_seed(0)
    return TinyDeepSeek(cfg, make_dispatcher(cfg.moe, ctx, lanes=lanes), ep_rank=ctx.ep_rank, seed=3).to(ctx.device)


def _sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
                p.grad = None


def _rel(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """Largest error relative to the tensor's largest expected magnitude, or to ``floor`` when that
    is larger (a gradient that cancels to ~1e-6 keeps the rounding of its larger terms)."""
    return float((got - want).abs().max() / want.abs().max().clamp(min=max(floor, 1e-30)))


def _expected_slice(name: str, ref: torch.Tensor, got: torch.Tensor, ep_rank: int) -> torch.Tensor:
    """The part of the single-process tensor this EP rank holds: its experts, its table rows."""
    if name.endswith(("w13_EDI2", "w2_EID", "table.weight_LE")) and ref.shape[0] != got.shape[0]:
        rows = got.shape[0]
        part = ref[ep_rank * rows:(ep_rank + 1) * rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])  # a padded last shard
    return ref


def pipeline_matches_single_process(cases: list[tuple[str, str, int]], steps: int) -> dict:
    """For each ``(variant, schedule, num_microbatches)``: ``steps`` SGD steps of the pipeline
    (``pp=2``, EP over each stage's ranks) against one process training the same model on every
    data rank's batch. Returns per case the losses of both (on the last stage) and the largest
    relative gradient error over this rank's parameters at each step."""
    ctx = init_parallel(parallel_config(pp=2))
    per_stage = ctx.world_size // ctx.pp_size
    data_rank = ctx.rank % per_stage
    results = {}
    for variant, schedule, num_micro in cases:
        cfg = model_config(variant)
        stage = PipelineStage(_build(cfg, ctx, lanes=2 if schedule == "overlap" else 1), stage=ctx.pp_rank,
                              num_stages=ctx.pp_size,
                              chunks=2 if schedule == "interleaved" else 1)
        pipe = PipelineSchedule(stage, ctx, num_microbatches=num_micro, schedule=schedule)
        ref = _build(cfg, single_process(ctx.device))  # one process: the identity transport, any dispatcher
        all_tokens = torch.cat([tokens(d) for d in range(per_stage)]).to(ctx.device)
        ref_params = dict(ref.named_parameters())
        losses, ref_losses, grad_errors = [], [], []
        for _ in range(steps):
            loss = pipe.step(tokens(data_rank).to(ctx.device))
            average_gradients(stage.model, ctx)
            if loss is not None:
                mean = loss.clone()
                dist.all_reduce(mean, group=ctx.stage_group)
                losses.append(float(mean / per_stage))
            ref_loss = ref.loss(all_tokens)
            ref_loss.backward()
            ref_losses.append(float(ref_loss))
            floor = FLOOR * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
            worst, names = 0.0, 0
            for name, p in stage.model.named_parameters():
                want = ref_params[name].grad
                want = torch.zeros_like(ref_params[name]) if want is None else want
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                worst = max(worst, _rel(got, _expected_slice(name, want, got, ctx.ep_rank), floor))
                names += 1
            grad_errors.append((worst, names))
            _sgd(stage.model)
            _sgd(ref)
        results[f"{variant}/{schedule}/{num_micro}"] = {"stage": ctx.pp_rank, "losses": losses,
                                                         "ref_losses": ref_losses, "grad_errors": grad_errors}
    dist.destroy_process_group()
    return results


def overlap_without_lanes() -> str:
    """The overlap schedule's error for a model whose dispatcher all lanes would share (EP over
    both ranks)."""
    ctx = init_parallel(parallel_config())
    stage = PipelineStage(_build(model_config("plain"), ctx), stage=0, num_stages=1)
    try:
        PipelineSchedule(stage, ctx, num_microbatches=2, schedule="overlap")
        return "accepted"
    except ValueError as error:
        return str(error)
    finally:
        dist.destroy_process_group()
