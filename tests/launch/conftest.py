"""Fixtures of the launch tests: the reference run every launcher must reproduce, and a two-node
Ray cluster on loopback shared by a test module (``ray start`` is slow)."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # cluster.py, the helpers

from cluster import RAY_ENV, REPO, RayCluster, job_env

STEPS = 8  # every launch test trains the tiny model this long, seed 0, on 2 ranks


def read_losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", "train", "--steps", str(STEPS), *args],
                          env=env or job_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory) -> list[float]:
    """The losses of ``ep-runtime train`` on 2 local processes: what every launch path must give."""
    out = tmp_path_factory.mktemp("reference")
    done = train_cli("--out", str(out), "--name", "ref")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = read_losses(out / "ref")
    assert len(losses) == STEPS
    return losses


@pytest.fixture(scope="module")
def ray_cluster():
    with pytest.MonkeyPatch.context() as env:
        for name, value in RAY_ENV.items():  # for drivers in this process too
            env.setenv(name, value)
        cluster = RayCluster()
        try:
            yield cluster.start()
        finally:
            cluster.stop()
