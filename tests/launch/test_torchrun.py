"""torchrun across two nodes, emulated on loopback: two agents (``--nnodes 2 --nproc-per-node 1``)
meeting through c10d rendezvous, each in a session of its own that the test ends."""

import subprocess
import sys

import pytest
from cluster import end_session, free_port, job_env, start
from conftest import STEPS, read_losses, train_cli

pytestmark = pytest.mark.timeout(180)


def run_two_agents(tmp_path, *train_args: str, fault: str | None = None, timeout: float = 120):
    """Starts two torchrun agents of one 2-node job; returns their exit codes and logs."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
           "--local-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.2",
           "-m", "ep_runtime.train", "--steps", str(STEPS), "--out", str(tmp_path), "--name", "job", *train_args]
    env = job_env(**({"EP_RUNTIME_FAIL_AT_STEP": fault} if fault else {}))
    agents = [start(cmd, env, tmp_path / f"agent{i}.log") for i in range(2)]
    try:
        codes = [agent.wait(timeout=timeout) for agent in agents]
    except subprocess.TimeoutExpired:
        codes = [agent.poll() for agent in agents]
    finally:
        for agent in agents:
            end_session(agent.pid)
    return codes, [(tmp_path / f"agent{i}.log").read_text() for i in range(2)]


def test_two_nodes_train_like_one(tmp_path, reference_losses):
    codes, logs = run_two_agents(tmp_path)
    assert codes == [0, 0], logs
    assert read_losses(tmp_path / "job") == reference_losses  # same seed, same world size: same losses
    both = "\n".join(logs)
    assert "[node 0 rank 0/2 local 0]" in both and "[node 1 rank 1/2 local 0]" in both  # node and local rank


def test_failing_rank_is_named_on_both_nodes(tmp_path):
    codes, logs = run_two_agents(tmp_path, "--timeout", "5", fault="1:3:raise")
    assert all(code not in (0, None) for code in codes), logs
    both = "\n".join(logs)
    assert "RankFailed: rank 1 (node 1, local 0, pp 0, ep 1) failed at step 3: RuntimeError: injected fault" in both
    # rank 0, on the other node, says why it stopped
    assert "RankFailed: rank 0 (node 0, local 0, pp 0, ep 0) stopped at step 3" in both
    assert "because rank 1 (node 1, local 0, pp 0, ep 1) failed at step 3" in both


def test_withheld_rank_times_out_and_is_named(tmp_path):
    codes, logs = run_two_agents(tmp_path, "--timeout", "4", fault="1:3:hang")
    assert all(code not in (0, None) for code in codes), logs  # neither node hangs
    both = "\n".join(logs)
    assert "Timed out" in both
    assert "rank 1 never reported within 4 s (withheld, hung or dead)" in both


def test_pipeline_with_the_overlap_schedule_trains_like_the_local_launcher(tmp_path):
    """``--pp 2 --ep 2 --schedule overlap`` (two lanes of one micro-batch each, so the gradient
    sums are order-free) under torchrun gives the local launcher's losses."""
    args = ["--pp", "2", "--ep", "2", "--schedule", "overlap", "--microbatches", "2", "--steps", "4", "--timeout", "60"]
    local = train_cli(*args, "--out", str(tmp_path / "local"), "--name", "job")
    assert local.returncode == 0, local.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "ep_runtime.train", *args, "--out", str(tmp_path / "torchrun"), "--name", "job"]
    done = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_losses(tmp_path / "torchrun" / "job") == read_losses(tmp_path / "local" / "job")
