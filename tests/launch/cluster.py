"""Processes the launch tests start and stop: torchrun agents and a two-node Ray cluster, all on
loopback, each in its own session so that teardown ends exactly the processes a test started (by
session id, never by name)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# A loopback-only test cluster: no usage reports, no token auth (whatever ~/.ray holds).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """The environment of every process a launch test starts: the checkout importable, one thread
    per process (results do not depend on how many processes share a node), loopback only."""
    env = dict(os.environ)
    env.pop("EP_RUNTIME_FAIL_AT_STEP", None)
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", **RAY_ENV)
    env.update(extra)
    return env


def session_pids(sid: int) -> list[int]:
    """Processes whose session is ``sid`` (the session a test's process started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session; skip zombies
            pids.append(int(entry.name))
    return pids


def end_session(sid: int, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, to every process of session ``sid``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Starts ``cmd`` in a new session, output to ``log``."""
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


class RayCluster:
    """A head node (127.0.0.2) and a second node (127.0.0.3, with resource ``node_b``), one CPU
    and one (fake) GPU each, started by ``ray start`` in sessions of their own."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="ep-ray-", dir="/tmp"))  # short: Ray's socket paths
        self.port = 0  # the head's, set when it starts
        self.sessions: list[int] = []

    @property
    def address(self) -> str:
        return f"127.0.0.2:{self.port}"

    def _ports(self) -> list[str]:
        return ["--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()),
                "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port())]

    def start(self) -> RayCluster:
        """Starts both nodes; a node whose ``ray start`` fails is stopped and started once more, on
        fresh ports: Ray gives a raylet 30 s to register, which a 2-core CI machine busy with other
        tests can exceed (seen once)."""
        self._start_node(0, self._head)
        self._start_node(1, self._second)
        return self

    def _head(self) -> list[str]:
        self.port = free_port()
        return [str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.2", "--port", str(self.port),
                "--num-cpus", "1", "--num-gpus", "1", "--temp-dir", str(self.dir), "--include-dashboard", "false",
                "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()),
                "--disable-usage-stats", *self._ports()]

    def _second(self) -> list[str]:
        return [str(BIN / "ray"), "start", "--address", self.address, "--node-ip-address", "127.0.0.3", "--num-cpus",
                "1", "--temp-dir", str(self.dir / "node_b"), "--num-gpus", "1", "--resources",
                json.dumps({"node_b": 1}), "--disable-usage-stats", *self._ports()]

    def _start_node(self, i: int, command) -> None:
        for attempt in range(2):
            cmd, log = command(), self.dir / f"ray-start-{i}-{attempt}.log"
            proc = start(cmd, job_env(), log)
            if proc.wait(timeout=120) == 0:
                self.sessions.append(proc.pid)
                return
            end_session(proc.pid)
        raise RuntimeError(f"{' '.join(cmd)} failed twice:\n{log.read_text()}")

    def stop(self) -> None:
        for sid in reversed(self.sessions):
            end_session(sid)
        shutil.rmtree(self.dir, ignore_errors=True)
