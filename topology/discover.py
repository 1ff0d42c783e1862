"""Discovering the topology of a running torch.distributed job.

Every rank describes itself (host name, local rank, device, NVLink peers, NICs) and the descriptions
are gathered over the process group with ``all_gather_object``; nodes are hosts, in order of their
first rank. Links come from, in order of preference:

* NVML (``pynvml``, when installed): active NVLink links of the rank's GPU and its PCIe generation;
* ``nvidia-smi topo -m``: ``NV<k>`` between every pair of GPUs means NVLink (NVSwitch with 4+ GPUs);
* torch: GPUs without peer access to each other are on PCIe; otherwise the device name decides
  (SXM parts are on NVSwitch boards);
* ``/sys/class/infiniband``: active RDMA ports and their rate; else the fastest Ethernet interface.

NVLink bandwidth is 25 GB/s per link and direction (NVLink 3 and 4; an H100 SXM has 18 links = 450
GB/s), PCIe 2 GB/s per lane of generation 4 (x16 = 32 GB/s). Nothing is measured. A CPU-only job (gloo)
gives a valid topology: processes on hosts, intra-node kind ``host``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import torch

from .cluster import Link, Topology

__all__ = ["discover", "parse_nvidia_smi_topo"]

_NVLINK_GBPS_PER_LINK = 25.0
_PCIE_GBPS_PER_LANE = {3: 1.0, 4: 2.0, 5: 4.0, 6: 8.0}
_HOST_GBPS = 10.0  # nominal copy bandwidth between CPU processes of one host
_ETHERNET_FALLBACK_GBPS = 1.25  # 10 Gb/s when nothing better is known


def discover(group: object = None, *, host: str | None = None, name: str = "discovered") -> Topology:
    """The topology of the ranks of ``group`` (default: the whole job); a collective on ``group``.

    Args:
        group: a torch.distributed process group, or None for the default group.
        host: this rank's host name (default ``socket.gethostname()``); ranks with equal names share a node.
        name: label of the topology.

    Returns:
        A :class:`Topology` whose GPU ``g`` is rank ``g`` of ``group``.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized; call init_process_group first")
    me = _describe_self(host if host is not None else socket.gethostname())
    world = dist.get_world_size(group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, me, group=group)
    hosts: list[str] = []
    for info in everyone:
        if info["host"] not in hosts:
            hosts.append(info["host"])
    node_of_gpu = tuple(hosts.index(info["host"]) for info in everyone)
    ranks_per_host = {h: node_of_gpu.count(i) for i, h in enumerate(hosts)}
    if len(set(ranks_per_host.values())) != 1:
        raise ValueError(f"group: expected the same number of ranks on every host, got {ranks_per_host}")
    first = [everyone[node_of_gpu.index(n)] for n in range(len(hosts))]
    intra = min((Link(kind=f["intra_kind"], bandwidth_GBps=f["intra_GBps"]) for f in first),
                key=lambda link: link.bandwidth_GBps)
    inter = None
    if len(hosts) > 1:
        inter = min((Link(kind=f["nic_kind"], bandwidth_GBps=f["nic_GBps"], count=f["nic_count"]) for f in first),
                    key=lambda link: link.total_GBps)
    return Topology(num_nodes=len(hosts), gpus_per_node=world // len(hosts), intra_node=intra, inter_node=inter,
                    hosts=tuple(hosts), node_of_gpu=node_of_gpu, gpu=first[0]["device"], name=name)


def _describe_self(host: str) -> dict:
    info = {"host": host, "local_rank": int(os.environ.get("LOCAL_RANK", "-1"))}
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        info["device"] = torch.cuda.get_device_name(index)
        info["intra_kind"], info["intra_GBps"] = _gpu_links(index, info["device"])
    else:
        info["device"] = "cpu"
        info["intra_kind"], info["intra_GBps"] = "host", _HOST_GBPS
    info["nic_kind"], info["nic_count"], info["nic_GBps"] = _nics()
    return info


def _gpu_links(index: int, device_name: str) -> tuple[str, float]:
    """(kind, GB/s per GPU) of the rank's GPU from NVML, nvidia-smi, or the device name."""
    found = _nvml_links(index)
    if found is not None:
        return found
    if shutil.which("nvidia-smi"):
        try:
            text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20,
                                  check=False).stdout
            kind, links = parse_nvidia_smi_topo(text)
            if kind != "unknown":
                return kind, (links * _NVLINK_GBPS_PER_LINK if links else _PCIE_GBPS_PER_LANE[4] * 16)
        except (OSError, subprocess.SubprocessError):
            pass
    count = torch.cuda.device_count()
    if count > 1 and not all(torch.cuda.can_device_access_peer(index, j) for j in range(count) if j != index):
        return "pcie", _PCIE_GBPS_PER_LANE[4] * 16  # no peer access: copies bounce through the host
    if re.search(r"\b(H100|H200|H800|A100|B200|GB200)\b", device_name) and "PCIe" not in device_name:
        return "nvswitch", 450.0 if "A100" not in device_name else 300.0
    return "pcie", _PCIE_GBPS_PER_LANE[4] * 16


def _nvml_links(index: int) -> tuple[str, float] | None:
    """(kind, GB/s per GPU) from NVML; None when pynvml is missing or NVML fails."""
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        links = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                links += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                break
        if links:
            return ("nvswitch" if torch.cuda.device_count() >= 4 else "nvlink"), links * _NVLINK_GBPS_PER_LINK
        gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
        return "pcie", _PCIE_GBPS_PER_LANE.get(gen, 2.0) * width
    except pynvml.NVMLError:
        return None


def parse_nvidia_smi_topo(text: str) -> tuple[str, int]:
    """Reads ``nvidia-smi topo -m``: ("nvswitch" | "nvlink" | "pcie" | "unknown", NVLink links per pair).

    NV<k> between every pair of GPUs means NVLink with at least k links per pair; with 4 or more GPUs
    that is an NVSwitch board. Any pair without NVLink makes the node "pcie"."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # colour codes when run on a terminal
    # Matrix rows start at column 0 with their GPU; the header line starts with whitespace.
    rows = [line.split() for line in text.splitlines() if re.match(r"GPU\d+\s", line)]
    if not rows:
        return "unknown", 0
    n = len(rows)
    links = []
    for i, row in enumerate(rows):
        cells = row[1:1 + n]
        for j, cell in enumerate(cells):
            if i == j:
                continue
            m = re.fullmatch(r"NV(\d+)", cell)
            if not m:
                return "pcie", 0
            links.append(int(m.group(1)))
    if not links:
        return "unknown", 0
    return ("nvswitch" if n >= 4 else "nvlink"), min(links)


def _nics() -> tuple[str, int, float]:
    """(kind, count, GB/s per NIC) of this host: active RDMA ports, else the fastest Ethernet link."""
    rates = []
    for port in sorted(Path("/sys/class/infiniband").glob("*/ports/*")):
        try:
            if "ACTIVE" not in (port / "state").read_text():
                continue
            m = re.match(r"\s*([0-9.]+)\s*Gb/sec", (port / "rate").read_text())
        except OSError:
            continue
        if m:
            rates.append(float(m.group(1)) / 8)
    if rates:
        return "rdma", len(rates), min(rates)
    speeds = []
    for dev in Path("/sys/class/net").glob("*"):
        if dev.name == "lo":
            continue
        try:
            speeds.append(int((dev / "speed").read_text()) / 8000)  # Mb/s -> GB/s
        except (OSError, ValueError):
            continue
    best = max((s for s in speeds if s > 0), default=_ETHERNET_FALLBACK_GBPS)
    return "ethernet", 1, best
