"""A pipelined job (``--pp 2 --ep 2``, 4 local processes) whose stage-1 rank fails ends with that
rank named: by our report when it raises, by the launcher when it is killed."""

import subprocess
import sys

import pytest
from cluster import end_session, job_env, start

pytestmark = pytest.mark.timeout(180)


def train_pipelined(tmp_path, fault: str) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "ep_runtime.cli", "train", "--pp", "2", "--ep", "2", "--steps", "4",
           "--timeout", "5", "--out", str(tmp_path)]
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
    assert "RankFailed: rank 3 (node 0, local 3) failed at step 2: RuntimeError: injected fault" in log


def test_a_killed_stage_rank_is_named(tmp_path):
    code, log = train_pipelined(tmp_path, "2:2:kill")  # rank 2: stage 1, EP rank 0
    assert code not in (0, None), log
    assert "Root Cause (first observed failure)" in log and "rank      : 2 (local_rank: 2)" in log
    assert "exitcode: -9" in log
