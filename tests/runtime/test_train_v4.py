"""The DeepSeek-V4-style preset (mHC with 4 streams, Engram tables sharded over the EP group, MoE)
trains on 2 gloo processes through the training worker: the loss falls."""

import dataclasses

import torch
from gpus import needs_gpus

from ep_runtime.config import JobConfig, MHCConfig, TrainConfig
from ep_runtime.config_files import preset
from ep_runtime.train import worker
from launch.local import launch_local


@needs_gpus(2)
def test_v4_preset_loss_falls(tmp_path):
    model = preset("v4").model
    assert model.mhc is not None and model.mhc.n == 4 and model.engram is not None
    # recompute on: the checkpointed mHC regions run inside the distributed step too
    model = dataclasses.replace(model, mhc=MHCConfig(n=4, recompute=True))
    cfg = JobConfig(model=model, train=TrainConfig(steps=30, out_dir=str(tmp_path), name="v4", log_every=10))
    results = launch_local(worker, cfg, nproc=2)
    losses = results[0]["losses"]
    assert len(losses) == 30 and results[1]["losses"] == losses  # every rank logs the global mean
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
