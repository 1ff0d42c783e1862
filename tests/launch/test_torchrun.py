"""torchrun across two nodes, emulated on loopback: two agents (``--nnodes 2 --nproc-per-node 1``)
meeting through c10d rendezvous, each in a session of its own that the test ends."""

import re
import subprocess
import sys

import pytest
from cluster import end_session, free_port, job_env, start
from conftest import STEPS, read_losses, train_cli

pytestmark = pytest.mark.timeout(180)


# A failure's report comes within the collective timeout of its cause plus this: the 1-s resolution
# of the logs' timestamps on both ends, the stuck-rank watch's poll and a process's exit on a loaded
# 2-core machine.
MARGIN_S = 4


def run_two_agents(tmp_path, *train_args: str, fault: str | None = None, timeout: float = 120):
    """Starts two torchrun agents of one 2-node job; returns their exit codes and the logs of
    their workers, ranks 0 and 1 (``OUT/NAME/logs/rank_<r>.log``)."""
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
    logs = [tmp_path / "job" / "logs" / f"rank_{rank}.log" for rank in range(2)]
    return codes, [log.read_text() if log.is_file() else (tmp_path / f"agent{rank}.log").read_text()
                   for rank, log in enumerate(logs)]


def test_two_nodes_train_like_one(tmp_path, reference_losses):
    codes, logs = run_two_agents(tmp_path)
    assert codes == [0, 0], logs
    assert read_losses(tmp_path / "job") == reference_losses  # same seed, same world size: same losses
    both = "\n".join(logs)
    assert "[node 0 rank 0/2 local 0]" in both and "[node 1 rank 1/2 local 0]" in both  # node and local rank


RANK0, RANK1 = "rank 0 (node 0, local 0, pp 0, ep 0)", "rank 1 (node 1, local 0, pp 0, ep 1)"


def stamped(log: str, rank: int, pattern: str) -> float:
    """The time (seconds since midnight) of the line of ``rank``'s log (``HH:MM:SS [node N rank
    R/2 local 0] ...``) whose message matches ``pattern`` in full; fails naming the pattern when none does."""
    line = re.compile(rf"^(\d\d:\d\d:\d\d) \[node {rank} rank {rank}/2 local 0\] (?:{pattern})$", re.MULTILINE)
    found = line.search(log)
    assert found, f"no line of rank {rank} matches {pattern!r} in:\n{log[-3000:]}"
    hours, minutes, seconds = map(int, found.group(1).split(":"))
    return hours * 3600 + minutes * 60 + seconds


def elapsed(start: float, end: float) -> float:
    return (end - start) % 86400  # across midnight too


def test_failing_rank_is_named_on_both_nodes(tmp_path):
    """Each node's log names its own rank's end: rank 1 its fault, rank 0 that it stopped because
    of rank 1's; rank 0 learns it from the failure report, well before the 5-s timeout."""
    codes, logs = run_two_agents(tmp_path, "--timeout", "5", fault="1:3:raise", timeout=90)
    assert codes == [1, 1], (codes, logs)
    failed = stamped(logs[1], 1, re.escape(f"{RANK1} failed at step 3: RuntimeError: injected fault "
                                           "(EP_RUNTIME_FAIL_AT_STEP) at step 3"))
    stopped = stamped(logs[0], 0, re.escape(f"{RANK0} stopped at step 3, because {RANK1} failed at step 3: "
                                            "RuntimeError: injected fault (EP_RUNTIME_FAIL_AT_STEP) at step 3"))
    assert elapsed(failed, stopped) <= MARGIN_S, (failed, stopped)


def test_withheld_rank_times_out_and_is_named(tmp_path):
    """Rank 1 hangs at step 3: rank 0's collective times out after --timeout 4 s, waits the
    report's grace (the timeout, at most ``REPORT_GRACE_S``: 4 s) for the other ranks' reports, and
    names the silent rank; rank 1, told of rank 0's failure, ends itself within 4 s more."""
    codes, logs = run_two_agents(tmp_path, "--timeout", "4", fault="1:3:hang", timeout=90)
    assert codes == [1, 1], (codes, logs)  # neither node hangs
    fired = stamped(logs[1], 1, "EP_RUNTIME_FAIL_AT_STEP=1:3:hang: injecting the fault now")
    stopped = stamped(logs[0], 0, re.escape(f"{RANK0} stopped at step 3: a collective failed (") + r".*"
                      + re.escape("): rank 1 never reported within 4 s (withheld, hung or dead)"))
    ended = stamped(logs[1], 1, re.escape(f"{RANK1}: ending this process, which neither finished nor failed "
                                          f"within 4 s of this: {RANK0} reported a failure"))
    assert 4 + 4 - 1 <= elapsed(fired, stopped) <= 4 + 4 + MARGIN_S, (fired, stopped)
    assert elapsed(stopped, ended) <= 4 + MARGIN_S, (stopped, ended)


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
