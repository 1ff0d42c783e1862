"""The Ray launcher on a two-node Ray cluster on loopback (``ray start --head`` at 127.0.0.2 and a
second ``ray start`` at 127.0.0.3 with its own resource, one CPU and one fake GPU each): the job
spans both nodes, a killed worker fails the job naming its rank or, with a restart left, the job
resumes from its last checkpoint and ends with the losses of an uninterrupted run."""

import re
import time

import pytest
from conftest import STEPS, read_losses, train_cli

from ep_runtime.options import job_config_from_args, train_parser
from ep_runtime.train import worker
from launch.ray import RayConfig, WorkerFailed, check_fits, launch_ray

pytestmark = pytest.mark.timeout(240)


def job(tmp_path, *args: str):
    return job_config_from_args(train_parser().parse_args(
        ["--steps", str(STEPS), "--out", str(tmp_path), "--name", "job", "--timeout", "10", *args]))


def test_job_spans_both_nodes(ray_cluster, tmp_path, reference_losses):
    done = train_cli("--launcher", "ray", "--address", ray_cluster.address, "--out", str(tmp_path), "--name", "job")
    assert done.returncode == 0, done.stderr[-5000:]
    assert f"trained {STEPS} steps on 2 processes" in done.stdout
    assert "2 workers on 2 node(s)" in done.stderr and "ranks by node: {'0': [0], '1': [1]}" in done.stderr
    assert "[node 0 rank 0/2 local 0]" in done.stderr  # rank 0's lines stream to the driver
    assert "[node 1 rank 1/2 local 0]" not in done.stderr + done.stdout  # the others' go to their files
    assert "[node 1 rank 1/2 local 0]" in (tmp_path / "job" / "logs" / "rank_1.log").read_text()
    assert read_losses(tmp_path / "job") == reference_losses


def test_killed_worker_fails_the_job_naming_its_rank(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("EP_RUNTIME_FAIL_AT_STEP", "1:3:kill")  # the launcher passes EP_* on to the workers
    with pytest.raises(WorkerFailed) as failed:
        launch_ray(worker, job(tmp_path), config=RayConfig(address=ray_cluster.address, num_workers=2,
                                                            gpus_per_worker=1))
    assert failed.value.ranks == (1,)
    assert "rank 1 (node 1, local 0): its worker process died" in str(failed.value)


def test_a_hung_worker_ends_the_job_within_the_timeout_naming_it(ray_cluster, tmp_path, monkeypatch):
    """Rank 1 stops taking part at step 3: rank 0's collective gives up after --timeout (10 s), and
    the job ends with the wait named, not after the hung actor."""
    monkeypatch.setenv("EP_RUNTIME_FAIL_AT_STEP", "1:3:hang")
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        launch_ray(worker, job(tmp_path), config=RayConfig(address=ray_cluster.address, num_workers=2))
    assert time.monotonic() - start < 10 + 60  # the timeout, plus the job's start and its first steps
    message = str(failed.value)
    assert "rank 0 (node 0, local 0, pp 0, ep 0) stopped at step 3: a collective failed" in message, message
    assert re.search(r"rank 1 never reported within \d+ s \(withheld, hung or dead\)$", message), message


def test_restart_resumes_from_the_last_checkpoint(ray_cluster, tmp_path, monkeypatch, reference_losses):
    monkeypatch.setenv("EP_RUNTIME_FAIL_AT_STEP", "1:7:kill")  # the first attempt only
    results = launch_ray(worker, job(tmp_path, "--checkpoint-every", "3"),
                         config=RayConfig(address=ray_cluster.address, num_workers=2, max_restarts=1))
    assert [results[r]["restart"] for r in (0, 1)] == [1, 1]
    assert results[0]["first_step"] == 7  # the checkpoint of step 6
    assert results[0]["losses"] == reference_losses[6:]
    assert read_losses(tmp_path / "job") == reference_losses  # metrics.jsonl: steps 1..6 kept, 7..8 appended


def test_ep_scaling_bench_through_ray(ray_cluster, tmp_path):
    from ep_runtime.bench.ep_scaling import main
    from launch.start import start_workers

    report = main(["--launcher", "ray", "--address", ray_cluster.address, "--modes", "weak", "--warmup", "0",
                   "--iters", "1", "--out", str(tmp_path)], start=start_workers)
    assert report["launcher"] == "ray" and [r["ep"] for r in report["rows"]] == [1, 2]
    assert (tmp_path / "ep_scaling_small.json").is_file() and (tmp_path / "ep_scaling_small.png").is_file()


def test_workers_a_local_ray_cannot_hold_fail_at_once():
    """A Ray started for the job never grows: asking it for more than it has is an error up front."""
    check_fits(RayConfig(num_workers=2, cpus_per_worker=1), {"CPU": 2.0})
    with pytest.raises(WorkerFailed, match=r"^ray: 4 workers need 4 CPUs \(it has 2\)"):
        check_fits(RayConfig(num_workers=4), {"CPU": 2.0})
    with pytest.raises(WorkerFailed, match=r"need 2 GPUs \(it has 0\)"):
        check_fits(RayConfig(num_workers=2, gpus_per_worker=1, cpus_per_worker=0), {"CPU": 2.0})
