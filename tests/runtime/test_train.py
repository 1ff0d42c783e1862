"""The training job on 2 gloo processes: loss falls, runs are reproducible, outputs are written."""

import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from gpus import needs_gpus

from ep_runtime.options import job_config_from_args, train_parser
from launch.cli import main as cli_main
from ep_runtime.train import worker
from launch.local import launch_local




def config(tmp_path, name, *extra):
    return job_config_from_args(train_parser().parse_args(
        ["--steps", "40", "--out", str(tmp_path), "--name", name, *extra]))


@needs_gpus(2)
def test_loss_falls_and_same_seed_gives_same_losses(tmp_path):
    first = launch_local(worker, config(tmp_path, "a"), nproc=2)
    second = launch_local(worker, config(tmp_path, "b"), nproc=2)
    losses = first[0]["losses"]
    assert len(losses) == 40
    assert first[1]["losses"] == losses  # every rank logs the global mean
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    assert second[0]["losses"] == second[1]["losses"] == losses
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert [r["loss"] for r in records] == losses
    assert all(sum(map(sum, r["expert_load"])) == 8 * 64 * 2 * 2 * 2 for r in records)  # B*S*ranks*topk*layers
    for r in records:  # model FLOPs: 793,344 a token (tests/runtime/test_flops.py), 8 x 64 tokens a rank
        assert r["tflops_per_gpu"] == pytest.approx(793_344 * 8 * 64 / r["step_time_s"] / 1e12, rel=1e-9)
        assert (r["mfu_percent"] is None) == (not torch.cuda.is_available())  # no peak for a CPU
        if not torch.cuda.is_available():
            assert r["time_s"] == {}
            continue
        phases = ("forward", "backward", "gradient reduction", "optimizer")
        assert set(r["time_s"]) == {*phases, "attention", "experts", "dispatch", "combine"}
        # the phases follow each other on the stream, inside the step's wall time (it ends in a sync)
        assert sum(r["time_s"][p] for p in phases) <= r["step_time_s"]
    assert (tmp_path / "a" / "loss.png").stat().st_size > 1000


@needs_gpus(2)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_quantized_dispatch_trains(tmp_path, fmt):
    """Loss falls, and the first step's loss is not the one without quantized dispatch (the flag
    reaches the dispatch: the tokens' rounding to e4m3 or e2m1 changes the forward)."""
    cfg = config(tmp_path, fmt, "--dispatch-format", fmt, "--ep", "2")
    assert cfg.model.moe.dispatch_format == fmt
    results = launch_local(worker, cfg, nproc=2)
    losses = results[0]["losses"]
    assert results[1]["losses"] == losses  # every rank logs the global mean
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    plain = launch_local(worker, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=1),
                                                     model=dataclasses.replace(cfg.model, moe=dataclasses.replace(
                                                         cfg.model.moe, dispatch_format="bf16"))), nproc=2)
    assert plain[0]["losses"] == plain[1]["losses"] and plain[0]["losses"][0] != losses[0]


def test_bad_config_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="^--topk: expected <= 8 experts selectable"):
        config(tmp_path, "bad", "--topk", "9")
    cfg = config(tmp_path, "bad")
    with pytest.raises(ValueError, match="train.seq_len"):
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=1000))


def test_cli_entry_point(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--steps", "3", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    nproc = torch.cuda.device_count() or 2
    assert f"trained 3 steps on {nproc} processes" in out.stdout
    assert (tmp_path / "tiny" / "metrics.jsonl").read_text().count("\n") == 3


@pytest.mark.parametrize("args, message", [
    (["--ep", "3"], "--ep 3: expected a divisor of the model's 8 experts (model.moe.num_experts of the tiny preset)"),
    (["--nproc", "3", "--ep", "2"], "--ep 2: expected a divisor of the 3 ranks of a pipeline stage"),
    (["--nproc", "3", "--pp", "2"], "--pp 2: expected a divisor of the 3 worker processes"),
    (["--nproc", "0"], "--num-workers: expected at least 1, got 0"),
    (["--pp", "3", "--layers", "3"], "--pp 3: its default micro-batches, 2 x 3 = 6, do not divide --batch-size 8"),
    (["--schedule", "overlap", "--batch-size", "3"], "--schedule overlap: its default micro-batches, 2 (two lanes), do "
                                                     "not divide --batch-size 3"),
    (["--pp", "3", "--microbatches", "4"], "--pp 3: expected at most one stage per block; 3 stages for 2 blocks "
                                           "(model.num_layers of the tiny preset)"),
    (["--pp", "2", "--ep", "2", "--schedule", "interleaved"], "--pp 2: expected at most one stage per block; "
                                                               "2 stages x 2 virtual stages for 2 blocks"),
    (["--batch-size", "-1"], "--batch-size: expected >= 1, got -1"),
    (["--seq-len", "0"], "--seq-len: expected >= 1, got 0"),
    (["--resume"], "--resume: no checkpoint under "),
    pytest.param(["--dispatcher", "deepep"], "--dispatcher deepep: the deep_ep package is not installed",
                 marks=pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is here")),
    (["--config", "missing.toml"], "--config missing.toml: no such config file"),
    (["--model", "small", "--config", "x.toml"], "--config x.toml: expected either --model or --config"),
    (["--pp", "2", "--ep", "1", "--layers", "4", "--schedule", "interleaved", "--microbatches", "1"],
     "--microbatches 1: expected a multiple of --pp 2 with the interleaved schedule"),
    (["--address", "auto", "--gpus-per-worker", "1"], "--address, --gpus-per-worker: only with --launcher ray"),
    (["--steps", "0"], "--steps: expected >= 1, got 0"),
])
def test_cli_refuses_a_job_before_starting_it(tmp_path, args, message):
    """What the workers would refuse, or a launcher would ignore, is said at once, naming the flag."""
    if torch.cuda.is_available():
        pytest.skip("the default process count is the GPUs'")
    with pytest.raises(SystemExit) as refused:
        cli_main(["train", *args, "--out", str(tmp_path)])
    assert str(refused.value).startswith(f"ep-runtime train: {message}")
    assert not (tmp_path / "tiny").exists()


def test_v4_preset_from_the_command_line(tmp_path):
    cfg = config(tmp_path, "v4", "--model", "v4", "--dispatch-format", "e4m3", "--topk", "1")
    assert cfg.model.mhc is not None and cfg.model.engram is not None
    assert cfg.model.moe.dispatch_format == "e4m3" and cfg.model.moe.router.topk == 1
    with pytest.raises(ValueError, match="model.engram.layers"):
        config(tmp_path, "v4", "--model", "v4", "--layers", "2")  # Engram sits on layer 2


def test_init_parallel_outside_a_job_refuses_more_than_one_rank(monkeypatch):
    """Under plain ``python`` there is one process: EP 8 or PP 2 cannot be had, and saying so beats
    running at EP 1."""
    from ep_runtime.config import ParallelConfig
    from ep_runtime.parallel import init_parallel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"^parallel\.ep: expected 1 in a process outside a distributed job .* got 8"):
        init_parallel(ParallelConfig(ep=8))
    with pytest.raises(ValueError, match=r"^parallel\.pp: expected 1 .* got 2"):
        init_parallel(ParallelConfig(pp=2, microbatches=2))
    assert init_parallel(ParallelConfig()).world_size == 1


@pytest.mark.parametrize("flags,message", [
    (["--pp", "2", "--microbatches", "0"], r"^--microbatches: expected an int >= 1, got 0"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "0"], r"^--virtual-stages: expected an int > 1"),
    (["--schedule", "interleaved"], r"^--schedule: expected '1f1b', 'gpipe' or 'overlap' with one pipeline stage"),
    (["--schedule", "overlap", "--microbatches", "3"], r"^--microbatches: expected an even number with the overlap"),
])
def test_settings_that_cannot_work_are_refused_before_any_process_starts(flags, message):
    with pytest.raises(ValueError, match=message):
        job_config_from_args(train_parser().parse_args(flags))
