"""Discovery inside a real 2-process gloo job on localhost (CPU only)."""

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from topology import Topology, discover, plan

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(tmp_path, hosts) -> list[dict]:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # spawned children inherit sys.path and import the worker from here
    import _discover_worker

    ctx = mp.start_processes(_discover_worker.run, args=(_free_port(), 2, hosts, str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("discovery job did not finish in 120 s")
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def test_discover_cpu_job_one_host(tmp_path):
    docs = _run_job(tmp_path, hosts=None)
    assert docs[0] == docs[1]  # every rank sees the same topology
    t = Topology.from_dict({k: v for k, v in docs[0].items() if k != "node_of_gpu"})
    assert (t.num_nodes, t.gpus_per_node, t.num_gpus) == (1, 2, 2)
    assert t.intra_node.kind == "host" and t.inter_node is None
    assert all(doc["gpu"] == "cpu" for doc in docs)
    # and it plans
    p = plan([[3.0, 1.0, 1.0, 1.0]], t, 4, traffic=None)
    assert p.experts_per_gpu == 2


def test_discover_two_hosts(tmp_path):
    docs = _run_job(tmp_path, hosts=["host-b", "host-a"])
    assert docs[0] == docs[1]  # every rank sees the same topology
    doc = docs[0]
    assert doc["nodes"] == 2 and doc["gpus_per_node"] == 1
    assert doc["hosts"] == ["host-b", "host-a"] and doc["node_of_gpu"] == [0, 1]
    assert doc["inter_node"]["kind"] in ("rdma", "ethernet")


def test_discover_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"^group: torch\.distributed is not initialized; call init_process_group "
                                           r"first$"):
        discover()
