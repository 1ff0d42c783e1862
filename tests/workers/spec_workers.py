"""The models the specification tests build (``tests/spec/test_model_spec.py``), and the worker
that checks a model over an EP group against the specification (``model_spec``) on every rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from gpus import parallel_config
from model_spec import leaves_of, model_loss
from moe_spec import scaled_error

from ep_runtime.config import MHCConfig, ModelConfig, MoEConfig, RouterConfig
from ep_runtime.config_files import preset
from ep_runtime.dispatch import AllToAllDispatcher, make_dispatcher
from ep_runtime.model import TinyDeepSeek
from ep_runtime.parallel import init_parallel


def tiny_config() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden=32, num_layers=2, num_heads=4, max_seq_len=16, dense_layers=0,
                       moe=MoEConfig(num_experts=8, expert_hidden=16, alignment=4,
                                     router=RouterConfig(scoring="sigmoid", topk=2, num_groups=2, topk_groups=1)))


def v4_config() -> ModelConfig:
    v4 = preset("v4").model
    return dataclasses.replace(v4, hidden=32, max_seq_len=16,
                               moe=dataclasses.replace(v4.moe, expert_hidden=16, alignment=4),
                               engram=dataclasses.replace(v4.engram, table_size=101, head_dim=8))


def config(preset: str) -> ModelConfig:
    """``tiny``, ``v4``, or ``v4-options``: v4 with mHC's options away from their defaults (2
    streams, 3 Sinkhorn iterations, eps 0.05 everywhere, recompute in backward)."""
    if preset == "v4-options":
        return dataclasses.replace(v4_config(), mhc=MHCConfig(n=2, sinkhorn_iters=3, eps=0.05, recompute=True))
    return tiny_config() if preset == "tiny" else v4_config()


def build(cfg: ModelConfig, dispatcher=None, ep_rank: int = 0) -> TinyDeepSeek:
    """The model with fresh values where the initial ones are structured: mHC's per-token mixing,
    the norms' weights, the Engram conv taps, the routers' biases (the same on every rank)."""
    torch.manual_seed(3)
    if dispatcher is None:
        dispatcher = AllToAllDispatcher(num_experts=cfg.moe.num_experts, alignment=cfg.moe.alignment)
    model = TinyDeepSeek(cfg, dispatcher, ep_rank=ep_rank, seed=11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_hc." in name or "mhc_head." in name:  # the per-token mixing, not the static biases alone
                p.add_(torch.randn_like(p) * (0.3 if "scale" in name else 0.1))
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if "conv_NDW" in name:
                p.mul_(5.0)
        for moe in model.moe_layers:
            moe.router.bias_E.copy_(torch.randn(cfg.moe.num_experts) * 0.05)
    return model


def hash_configs(model: TinyDeepSeek) -> dict:
    return {i: b.engram.hash for i, b in enumerate(model.blocks) if b.engram is not None}


def _gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def model_over_ep_against_spec(preset: str) -> dict[str, float]:
    """The model over the EP group of every rank (experts and Engram table rows split over it):
    this rank's next-token loss on its own tokens and every parameter's gradient, against the
    specification with every rank's experts and table rows gathered. Experts' and table shards'
    gradients are the spec's summed over the group (every rank's tokens reach them); the other
    parameters' are this rank's. Returns ``{"loss": relative error, name: scaled error}``."""
    ctx = init_parallel(parallel_config())
    cfg = config(preset)
    model = build(cfg, make_dispatcher(cfg.moe, ctx), ep_rank=ctx.ep_rank)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9 + ctx.rank))
    loss = model.loss(tokens)
    loss.backward()

    split = {id(p) for p in (*model.expert_parameters(), *model.sharded_parameters())}
    full = {}
    for name, p in model.named_parameters():
        full[name] = _gather_rows(p.detach(), ctx.ep_group) if id(p) in split else p.detach()
    for layer, block in enumerate(model.blocks):  # the table's padding rows past its end
        if block.engram is not None:
            name = f"blocks.{layer}.engram.table.weight_LE"
            full[name] = full[name][: block.engram.table.num_rows]
    P = leaves_of(model)
    P |= {name: t.double().clone().requires_grad_() for name, t in full.items()}
    want = model_loss(tokens, P, cfg, hash_configs(model))
    want.backward()
    errors = {"loss": abs(float(loss.detach()) - float(want.detach())) / float(want.detach())}
    for name, p in model.named_parameters():
        spec = P[name].grad if P[name].grad is not None else torch.zeros_like(P[name])
        if id(p) in split:
            rows = p.shape[0]
            if spec.shape[0] < rows * ctx.ep_size:  # the table's padding rows: no gradient
                spec = torch.cat([spec, spec.new_zeros(rows * ctx.ep_size - spec.shape[0], *spec.shape[1:])])
            dist.all_reduce(spec, group=ctx.ep_group)
            spec = spec[ctx.ep_rank * rows:(ctx.ep_rank + 1) * rows]
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        errors[name] = scaled_error(got, spec)
    dist.destroy_process_group()
    return errors
