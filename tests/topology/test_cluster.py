"""Topology descriptions: files, constructors, validation, nvidia-smi parsing."""

import json
import re
from pathlib import Path

import pytest

from topology import Link, Topology
from topology.cluster import parse_bandwidth
from topology.discover import parse_nvidia_smi_topo

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


def test_example_files_load():
    big = Topology.from_file(EXAMPLES / "h100-32x8.yaml")
    assert (big.num_nodes, big.gpus_per_node, big.num_gpus) == (32, 8, 256)
    assert big.intra_node == Link(kind="nvswitch", bandwidth_GBps=450.0)
    assert big.inter_node == Link(kind="rdma", bandwidth_GBps=50.0, count=8)  # 8 x 400 Gb/s
    small = Topology.from_file(EXAMPLES / "h100-4x8.yaml")
    assert small.num_gpus == 32 and small.node_of_gpu[8] == 1
    pcie = Topology.from_file(EXAMPLES / "pcie-2x4.json")
    assert pcie.intra_node.kind == "pcie" and pcie.hosts == ("node-a", "node-b")
    assert pcie.inter_node.bandwidth_GBps == pytest.approx(12.5)


def test_uniform_and_round_trip(tmp_path):
    t = Topology.uniform(3, 4, nics_per_node=2)
    assert t.gpus_of_node == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    assert t.local_rank_of_gpu[5] == 1
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_dict()))
    back = Topology.from_file(path)
    assert (back.num_nodes, back.gpus_per_node, back.intra_node, back.inter_node) == \
        (t.num_nodes, t.gpus_per_node, t.intra_node, t.inter_node)
    single = Topology.uniform(1, 2)
    assert single.inter_node is None


def test_interleaved_ranks():
    t = Topology(num_nodes=2, gpus_per_node=2, intra_node=Link(kind="nvlink", bandwidth_GBps=100),
                 inter_node=Link(kind="rdma", bandwidth_GBps=25), node_of_gpu=(0, 1, 0, 1))
    assert t.gpus_of_node == ((0, 2), (1, 3))
    assert t.local_rank_of_gpu == (0, 0, 1, 1)


@pytest.mark.parametrize("value, expected", [("400 Gb/s", 50.0), ("450 GB/s", 450.0), (12.5, 12.5),
                                             ("100Gbps", 12.5), ("1.6 Tb/s", 200.0)])
def test_bandwidth_units(value, expected):
    assert parse_bandwidth("x", value) == pytest.approx(expected)


NVLINK = {"kind": "nvlink", "bandwidth": 1}
KINDS = "('nvswitch', 'nvlink', 'pcie', 'host')"
UNITS = "expected a number with a unit such as '400 Gb/s' or '450 GB/s'"
KEYS = "['gpu', 'gpus_per_node', 'hosts', 'inter_node', 'intra_node', 'name', 'nodes']"


@pytest.mark.parametrize("doc, message", [  # the message after the file's path
    ({"gpus_per_node": 8, "intra_node": {"kind": "nvswitch", "bandwidth": 1}}, "missing key 'nodes'"),
    ({"nodes": 0, "gpus_per_node": 8, "intra_node": {"kind": "nvswitch", "bandwidth": 1}},
     "nodes: expected a positive int, got 0"),
    ({"nodes": 1, "gpus_per_node": 8, "intra_node": {"kind": "warp", "bandwidth": 1}},
     f"intra_node.kind: expected one of {KINDS}, got 'warp'"),
    ({"nodes": 1, "gpus_per_node": 8, "intra_node": {"kind": "nvlink", "bandwidth": "fast"}},
     f"intra_node.bandwidth: {UNITS}, got 'fast'"),
    ({"nodes": 1, "gpus_per_node": 8, "intra_node": {"kind": "nvlink", "bandwidth": "-3 GB/s"}},
     f"intra_node.bandwidth: {UNITS}, got '-3 GB/s'"),
    ({"nodes": 2, "gpus_per_node": 8, "intra_node": NVLINK}, "inter_node: required with 2 nodes"),
    ({"nodes": 2, "gpus_per_node": 8, "intra_node": NVLINK, "inter_node": {"kind": "rdma", "nics": 0, "bandwidth": 1}},
     "inter_node.nics: expected a positive int, got 0"),
    ({"nodes": 1, "gpus_per_node": 8, "gpus": 3, "intra_node": NVLINK},
     f"unknown key(s) ['gpus']; expected some of {KEYS}"),
    ({"nodes": 2, "gpus_per_node": 1, "hosts": ["a"], "intra_node": NVLINK,
      "inter_node": {"kind": "rdma", "bandwidth": 1}},
     "hosts: expected 2 names, got 1"),
])
def test_description_errors_name_the_field(doc, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}: {message}')}$"):
        Topology.from_file(path)


def test_constructor_errors_name_the_field():
    link = Link(kind="nvlink", bandwidth_GBps=1)
    with pytest.raises(ValueError, match=r"^Topology\.node_of_gpu: expected 2 GPUs on node 0, got 3$"):
        Topology(num_nodes=2, gpus_per_node=2, intra_node=link, inter_node=Link(kind="rdma", bandwidth_GBps=1),
                 node_of_gpu=(0, 0, 0, 1))
    with pytest.raises(ValueError, match=r"^Link\.bandwidth_GBps: expected a positive number, got nan$"):
        Link(kind="rdma", bandwidth_GBps=float("nan"))
    message = f"Topology.intra_node: expected a Link of kind {KINDS}, got Link(kind='rdma'"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        Topology(num_nodes=1, gpus_per_node=2, intra_node=Link(kind="rdma", bandwidth_GBps=1))


SMI_NVSWITCH = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-55\t0
GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-55\t0
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t56-111\t1
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t56-111\t1
NIC0\tPXB\tSYS\tSYS\tSYS\t X

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# Captured on the 2 x H200 development machine (with its terminal colour codes).
SMI_H200_PAIR = (
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\t0-31\t0\t\tN/A\n"
    "GPU1\tNV18\t X \t0-31\t0\t\tN/A\n"
    "\nLegend:\n\n  X    = Self\n"
)

SMI_PCIE = """\
\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tPHB\t0-15
GPU1\tPHB\t X \t0-15
"""


def test_parse_nvidia_smi_topo():
    assert parse_nvidia_smi_topo(SMI_NVSWITCH) == ("nvswitch", 18)
    assert parse_nvidia_smi_topo(SMI_H200_PAIR) == ("nvlink", 18)
    assert parse_nvidia_smi_topo(SMI_PCIE) == ("pcie", 0)
    assert parse_nvidia_smi_topo("No devices were found") == ("unknown", 0)
