"""What ``ep-runtime train`` shows on the terminal: rank 0's lines, one line when the job fails or
is stopped, the tracebacks in the ranks' log files, progress at the chosen log level."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU workers: the default process count is 2")


def train_cli(tmp_path, *flags, env=None):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--out", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return out, time.monotonic() - start


def test_a_failed_rank_ends_the_job_in_one_line_and_its_traceback_goes_to_its_log(tmp_path):
    out, elapsed = train_cli(tmp_path, "--steps", "4", env={"EP_RUNTIME_FAIL_AT_STEP": "1:2"})
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).strip().splitlines()
    log = tmp_path / "tiny" / "logs" / "rank_1.log"
    assert re.fullmatch(r"ep-runtime train: rank 1 \(node 0, local 1, pp 0, ep 1\) failed at step 2: RuntimeError: "
                        rf"injected fault \(EP_RUNTIME_FAIL_AT_STEP\) at step 2 \(log: {re.escape(str(log))}\)",
                        lines[-1]), lines[-1]
    assert "Traceback" not in out.stdout + out.stderr
    assert len(lines) <= 6, lines  # rank 0's start lines, its report naming rank 1, the launcher's line
    assert "Traceback" in log.read_text() and 'raise RuntimeError(f"injected fault' in log.read_text()
    # two processes start, run a step and stop: ~8 s on 2 idle cores, 30.4 s once beside another
    # test's processes in CI; a rank left waiting would take the 300 s timeout
    assert elapsed < 60, elapsed


def test_ctrl_c_stops_every_worker_with_one_line(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "launch.cli", "train", "--steps", "100000", "--out", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in job.stdout:  # rank 0 says when training starts
        seen.append(line)
        if "training tiny" in line:
            break
    os.killpg(job.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole process group
    start = time.monotonic()
    rest, _ = job.communicate(timeout=30)
    lines = (("".join(seen)) + rest).strip().splitlines()
    assert job.returncode == 130, lines
    assert time.monotonic() - start < 15
    assert lines[-1] == f"ep-runtime train: stopped by Ctrl-C (SIGINT); every worker ended (logs: {tmp_path}/tiny/logs/)"
    assert not any("Traceback" in line or "SignalException" in line for line in lines), lines


def test_log_level_quiets_the_terminal_not_the_log_files_and_a_restart_is_said(tmp_path):
    out, _ = train_cli(tmp_path, "--steps", "3", "--log-every", "1", "--log-level", "warning", "--max-restarts", "1",
                       env={"EP_RUNTIME_FAIL_AT_STEP": "1:2"})
    assert out.returncode == 0, out.stderr[-2000:]
    terminal = out.stdout + out.stderr
    assert "step 3 loss" not in terminal and "restart 1: every worker started again after a failure" in terminal
    assert "trained 3 steps on 2 processes" in out.stdout
    log = (tmp_path / "tiny" / "logs" / "rank_0.log").read_text()
    assert "---- attempt 2" in log and "step 3 loss" in log
