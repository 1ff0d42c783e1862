"""Runs inside the processes that tests/topology/test_discover.py spawns."""

import datetime
import json

import torch.distributed as dist

from topology import discover


def run(rank: int, port: int, world: int, hosts: list, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        t = discover(host=hosts[rank] if hosts else None)
        doc = t.to_dict()
        doc["node_of_gpu"] = list(t.node_of_gpu)
        doc["hosts"] = list(t.hosts)
        with open(f"{out_dir}/{rank}.json", "w") as f:
            json.dump(doc, f)
    finally:
        dist.destroy_process_group()
