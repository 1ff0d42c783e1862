"""A pipelined job (``--pp 2 --ep 2``, 4 local processes) whose stage-1 rank fails ends with that
rank named: by our report when it raises, by the launcher when it is killed."""

import datetime
import re
import subprocess
import sys

import pytest
from cluster import end_session, job_env, start

pytestmark = pytest.mark.timeout(180)


def train_pipelined(tmp_path, fault: str, *, ep: int = 2, timeout: int = 5) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "launch.cli", "train", "--pp", "2", "--ep", str(ep), "--steps", "4",
           "--timeout", str(timeout), "--out", str(tmp_path)]
    log = tmp_path / "job.log"
    job = start(cmd, job_env(EP_RUNTIME_FAIL_AT_STEP=fault), log)
    try:
        code = job.wait(timeout=150)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        end_session(job.pid)
    return code, log.read_text()


def test_a_raising_stage_rank_is_named(tmp_path):
    code, log = train_pipelined(tmp_path, "3:2:raise")  # rank 3: stage 1, EP rank 1
    assert code not in (0, None), log
    assert log.strip().splitlines()[-1] == (
        "ep-runtime train: rank 3 (node 0, local 3, pp 1, ep 1) failed at step 2: RuntimeError: injected fault "
        f"(EP_RUNTIME_FAIL_AT_STEP) at step 2 (log: {tmp_path}/tiny/logs/rank_3.log)")


def test_a_killed_stage_rank_is_named(tmp_path):
    code, log = train_pipelined(tmp_path, "2:2:kill")  # rank 2: stage 1, EP rank 0
    assert code not in (0, None), log
    assert log.strip().splitlines()[-1] == ("ep-runtime train: rank 2 was killed by SIGKILL before it recorded an "
                                            f"error (log: {tmp_path}/tiny/logs/rank_2.log)")


def test_a_rank_stuck_in_a_pipeline_recv_ends_the_job_naming_the_wait(tmp_path):
    """Rank 0 (stage 0) stops taking part at step 2; rank 1 (stage 1) waits for its activations.
    The job ends within the timeout plus a few seconds of the fault, its last line naming the
    waiting rank, its place in the mesh, the step and the wait."""
    timeout = 10
    code, log = train_pipelined(tmp_path, "0:2:hang", ep=1, timeout=timeout)
    ended = datetime.datetime.now()
    assert code not in (0, None), log
    last = log.strip().splitlines()[-1]
    assert re.fullmatch(r"ep-runtime train: rank 1 \(node 0, local 1, pp 1, ep 0\) waited \d+ s in the pipeline recv "
                        rf"from rank 0 at step 2 \(log: {re.escape(str(tmp_path))}/tiny/logs/rank_1\.log\)", last), last
    fired = re.search(r"^(\d\d:\d\d:\d\d) .*injecting the fault now", log, re.MULTILINE)
    assert fired, log
    at = datetime.datetime.combine(ended.date(), datetime.time.fromisoformat(fired.group(1)))
    assert (ended - at).total_seconds() <= timeout + 8, (at, ended)
