"""The DeepSeek-V4-style preset (mHC with 4 streams, Engram tables sharded over the EP group, MoE)
trains on 2 gloo processes through the training worker: the loss falls."""

import dataclasses

import pytest
import torch
from gpu_matrix_workers import train_each
from gpus import WAIT_S, needs_gpus

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


@needs_gpus(2)
def test_v4_over_two_nodes_gives_all_to_alls_losses(tmp_path):
    """Two declared nodes of one rank: ``nvlink`` runs two-stage (``hierarchical``), and the Engram
    tables shard over the whole EP group, not over a stage's."""
    def argv(dispatcher: str, *layout: str) -> list[str]:
        return ["--model", "v4", "--layers", "4", "--dispatcher", dispatcher, "--ep", "2", *layout, "--steps", "3",
                "--out", str(tmp_path), "--name", dispatcher, "--timeout", str(WAIT_S)]

    one_stage, two_stage = argv("all_to_all"), argv("nvlink", "--ranks-per-node", "1")
    results = launch_local(train_each, [one_stage, two_stage], nproc=2)
    want, got = (results[0][" ".join(a)] for a in (one_stage, two_stage))
    assert isinstance(got, list), got  # else the error the run raised
    assert got == pytest.approx(want, rel=1e-5) and got[-1] < got[0]
