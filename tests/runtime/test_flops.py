"""The model FLOP count behind TFLOP/s and MFU: a hand count for the tiny preset, and the active
weights against the parameters the models hold."""

import pytest
import torch

from ep_runtime.dispatch import make_dispatcher
from ep_runtime.metrics import PEAK_BF16_TFLOPS, active_params, peak_tflops, train_flops_per_token
from ep_runtime.model import TinyDeepSeek
from ep_runtime.config_files import preset
from ep_runtime.parallel import single_process


def test_tiny_preset_by_hand():
    # hidden 64, 2 blocks, vocabulary 256, 8 experts of 64, top-2, one shared expert; sequences of 64
    attention = 4 * 64 * 64  # qkv 3 D^2 + out D^2
    router = 8 * 64
    experts = (2 + 1) * 3 * 64 * 64  # the 2 routed and the shared one, SwiGLU: w13 2 D I + w2 I D
    head = 256 * 64
    active = 2 * (attention + router + experts) + head
    assert active == 123_904 == active_params(preset("tiny").model)
    scores = 2 * 3 * 2 * (2 * 64 * 65 // 2)  # L x (fwd + bwd) x (QK^T, PV) x 2 D per key x (S+1)/2 keys
    assert train_flops_per_token(preset("tiny").model, 64) == 6 * active + scores == 793_344


@pytest.mark.parametrize("name", ["tiny", "small", "v4"])
def test_active_weights_are_the_models_matrices_with_topk_of_the_experts(name):
    """Every matrix the model multiplies with (embeddings and Engram tables are looked up, norms'
    weights are elementwise), the routed experts counted ``topk`` of ``num_experts``."""
    cfg = preset(name).model
    ctx = single_process(torch.device("cpu"))
    model = TinyDeepSeek(cfg, make_dispatcher(cfg.moe, ctx), seed=0)
    looked_up = {id(p) for p in (model.embed.weight, model.pos_embed.weight, *model.sharded_parameters())}
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() >= 2 and id(p) not in looked_up and "norm" not in name)
    experts = sum(p.numel() for p in model.expert_parameters())
    routed = experts * cfg.moe.router.topk // cfg.moe.num_experts
    assert active_params(cfg) == matrices - experts + routed


def test_peaks_by_device_name(monkeypatch):
    assert peak_tflops(torch.device("cpu")) is None
    for name, peak in [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
                       ("NVIDIA H20", 148.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce RTX 4090", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_tflops(torch.device("cuda", 0)) == peak, name
    assert PEAK_BF16_TFLOPS["H800"] == 989.4
