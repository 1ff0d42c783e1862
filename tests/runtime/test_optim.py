"""The optimizer recipe: the learning rate's warmup and cosine decay, AdamW's groups, and clipping
in one process (the norm over pipeline stages and EP shards: ``test_pipeline``'s PP x EP run)."""

import math

import pytest
import torch

from ep_runtime.config import ModelConfig, MoEConfig, RouterConfig, TrainConfig
from ep_runtime.dispatch import make_dispatcher
from ep_runtime.model import TinyDeepSeek
from ep_runtime.optim import clip_grad_norm, grad_norm, learning_rate, param_groups
from ep_runtime.parallel import single_process


def test_learning_rate_warms_up_linearly_then_decays_by_a_cosine():
    t = TrainConfig(steps=100, lr=1e-3, warmup_fraction=0.1, min_lr_ratio=0.1)
    assert t.warmup_steps == 10
    assert [learning_rate(s, t) for s in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert learning_rate(55, t) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(100, t) == pytest.approx(1e-4)
    assert learning_rate(1, TrainConfig(steps=3, lr=2e-3)) == pytest.approx(2e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3))))


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match=r"^train\.warmup_fraction: expected in \[0, 1\)"):
        TrainConfig(warmup_fraction=1.5)
    with pytest.raises(ValueError, match=r"^train\.max_grad_norm: expected >= 0"):
        TrainConfig(max_grad_norm=-1)


def _model_with_grads() -> TinyDeepSeek:
    cfg = ModelConfig(hidden=32, num_layers=2, num_heads=4, vocab_size=64, max_seq_len=16,
                      moe=MoEConfig(num_experts=4, expert_hidden=32, router=RouterConfig(topk=2)))
    model = TinyDeepSeek(cfg, make_dispatcher(cfg.moe, single_process(torch.device("cpu"))), seed=0)
    model.loss(torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))).backward()
    return model


def test_weight_decay_on_matrices_only():
    model = _model_with_grads()
    decay, keep = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in keep["params"])
    assert len(decay["params"]) + len(keep["params"]) == len(list(model.parameters()))


def test_clipping_scales_the_whole_gradient_to_the_norm():
    model = _model_with_grads()
    ctx = single_process(torch.device("cpu"))
    want = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = clip_grad_norm(model, ctx, float(want) / 4)
    torch.testing.assert_close(norm, want)
    torch.testing.assert_close(grad_norm(model, ctx), want / 4, rtol=1e-5, atol=0)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b / 4, rtol=1e-5, atol=1e-9)
    norm = clip_grad_norm(model, ctx, 1e9)  # under the bar: untouched
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b / 4, rtol=1e-5, atol=1e-9)
