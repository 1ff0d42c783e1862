"""Every model preset x dispatcher x pipeline schedule trains on two and on four GPUs, a few
steps each.

Two launches of all the GPUs' processes, each training its configurations in turn (a process's
NVLink heaps go over one set of ranks, ``dispatch.symmetric.CudaHeap``): the first holds EP over
every GPU with ``all_to_all`` and ``nvlink``, and PP 2 x EP (half) with ``all_to_all``; the second
PP 2 x EP (half) with ``nvlink`` (heaps over each stage's ranks) and EP over every GPU with
two-stage ``nvlink``, half the GPUs a "node" (heaps over each node's ranks). Every loss is finite
and the last below the first; for the ``small`` preset every configuration of a layout gives the
losses of that layout's ``all_to_all`` run without a pipeline or with 1F1B, within ``SMALL_RTOL``
(bf16 autocast: the schedules accumulate micro-batches' gradients in other orders); ``small`` with
FP8 experts (EP over every GPU, both dispatchers) within ``FP8_RTOL`` of them, and with the overlap
schedule over EP alone (two micro-batches in two lanes) within ``SMALL_RTOL``.

``pytest -s -m gpu tests/runtime/test_gpu_matrix.py`` on a machine of two or four GPUs."""

import math

import pytest
import torch
from gpu_matrix_workers import train_each

from launch.local import launch_local

# Dozens of short runs, each compiling its kernels on a cold TileLang cache (over 300 s on two H200s).
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

STEPS = 3
SMALL_RTOL = 2e-2
FP8_RTOL = 5e-2  # FP8 experts against bf16 (200 steps of small on one H200: 2.9% apart at most)
# Four blocks each, so that the interleaved schedule's 2 x 2 virtual stages hold one.
PRESETS = {"tiny": ["--layers", "4"], "small": [], "v4": ["--layers", "4"], "v3-layer": []}
SCHEDULES = ("1f1b", "interleaved", "overlap")


def _argv(preset: str, dispatcher: str, layout: list[str], out: str) -> list[str]:
    name = "-".join([preset, dispatcher, *layout]).replace("--", "")
    return ["--model", preset, *PRESETS[preset], "--dispatcher", dispatcher, *layout, "--steps", str(STEPS),
            "--out", out, "--name", name, "--timeout", "120"]


@pytest.mark.parametrize("gpus", [2, 4])
def test_every_configuration_trains(tmp_path, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    out = str(tmp_path)
    ep = ["--ep", str(gpus)]
    two_stage = ["--ep", str(gpus), "--ranks-per-node", str(gpus // 2)]
    pipelines = {s: ["--pp", "2", "--ep", str(gpus // 2), "--schedule", s] for s in SCHEDULES}
    first = [_argv(p, d, ep, out) for p in PRESETS for d in ("all_to_all", "nvlink")]
    first += [_argv("small", d, [*ep, extra], out) for d in ("all_to_all", "nvlink")
              for extra in ("--fp8-experts", "--schedule=overlap")]
    first += [_argv(p, "all_to_all", layout, out) for p in PRESETS for layout in pipelines.values()]
    second = [_argv(p, "nvlink", layout, out) for p in PRESETS for layout in pipelines.values()]
    second += [_argv(p, "nvlink", two_stage, out) for p in PRESETS]
    results = {}
    for argvs in (first, second):
        by_rank = launch_local(train_each, argvs, nproc=gpus)
        assert sorted(by_rank) == list(range(gpus))
        for argv in argvs:
            key = " ".join(argv)
            results[key] = by_rank[0][key]
            for rank, per_rank in by_rank.items():
                assert per_rank[key] == results[key], f"rank {rank}: {key}: {per_rank[key]}"  # the job's mean loss
    failures = {k: v for k, v in results.items() if isinstance(v, str) or not (all(map(math.isfinite, v))
                                                                                and v[-1] < v[0])}
    assert not failures, failures
    small = {k: v for k, v in results.items() if k.startswith("--model small ")}
    reference = {"ep": small[" ".join(_argv("small", "all_to_all", ep, out))],
                 "pp": small[" ".join(_argv("small", "all_to_all", pipelines["1f1b"], out))]}
    for key, losses in small.items():
        want = reference["pp" if "--pp" in key else "ep"]
        rtol = FP8_RTOL if "--fp8-experts" in key else SMALL_RTOL
        torch.testing.assert_close(losses, want, rtol=rtol, atol=0, msg=lambda m: f"{key}: {m}")
