"""What the cluster looks like: nodes, GPUs per node and the links between them.

A :class:`Topology` is built from a YAML/JSON description (:meth:`Topology.from_file`), from a few
numbers (:meth:`Topology.uniform`), or discovered inside a running job (:func:`topology.discover`).
Bandwidths are in GB/s (gigabytes per second, one direction); descriptions may also write them as
strings with a unit (``"400 Gb/s"``, ``"450 GB/s"``).

GPU ``g`` is rank ``g`` of the expert-parallel group; ``node_of_gpu[g]`` says which node holds it
(by default nodes hold consecutive ranks, as torchrun numbers them).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["INTER_NODE_KINDS", "INTRA_NODE_KINDS", "Link", "Topology"]

INTRA_NODE_KINDS = ("nvswitch", "nvlink", "pcie", "host")
"""Links inside a node: NVSwitch (all-to-all NVLink), NVLink (direct, not switched), PCIe (no
NVLink; copies go through the host bridge), host (CPU processes sharing memory)."""

INTER_NODE_KINDS = ("rdma", "ethernet")
"""Links between nodes: RDMA NICs (InfiniBand/RoCE, as DeepEP's internode kernels use) or plain
Ethernet/TCP."""



@dataclass(frozen=True, kw_only=True)
class Link:
    """One class of link. ``bandwidth_GBps`` is per link, one direction; ``count`` links in parallel.

    Inside a node the link is counted per GPU (an H100 SXM: one NVSwitch port group of 450 GB/s);
    between nodes per node (8 NICs of 50 GB/s = 400 Gb/s each).
    """

    kind: str
    bandwidth_GBps: float
    count: int = 1

    def __post_init__(self) -> None:
        kinds = INTRA_NODE_KINDS + INTER_NODE_KINDS
        if self.kind not in kinds:
            raise ValueError(f"Link.kind: expected one of {kinds}, got {self.kind!r}")
        if not (isinstance(self.bandwidth_GBps, (int, float)) and math.isfinite(self.bandwidth_GBps)
                and self.bandwidth_GBps > 0):
            raise ValueError(f"Link.bandwidth_GBps: expected a positive number, got {self.bandwidth_GBps!r}")
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ValueError(f"Link.count: expected a positive int, got {self.count!r}")

    @property
    def total_GBps(self) -> float:
        """All ``count`` links together, one direction."""
        return self.bandwidth_GBps * self.count


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Nodes, GPUs per node and link classes of an expert-parallel group.

    Fields:
        num_nodes: nodes (hosts).
        gpus_per_node: GPUs (ranks) per node, the same on every node.
        intra_node: the link each GPU has into its node's fabric (kind in ``INTRA_NODE_KINDS``).
        inter_node: the NICs of one node (kind in ``INTER_NODE_KINDS``); None for one node.
        hosts: node names, one per node ("" when unknown).
        node_of_gpu: node of each rank; empty means consecutive ranks per node.
        gpu: device name (e.g. "H100-SXM-80GB"; "cpu" for CPU processes).
        name: a label for reports.
    """

    num_nodes: int
    gpus_per_node: int
    intra_node: Link
    inter_node: Link | None = None
    hosts: tuple[str, ...] = ()
    node_of_gpu: tuple[int, ...] = ()
    gpu: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        _check_int("Topology.num_nodes", self.num_nodes)
        _check_int("Topology.gpus_per_node", self.gpus_per_node)
        if not isinstance(self.intra_node, Link) or self.intra_node.kind not in INTRA_NODE_KINDS:
            raise ValueError(f"Topology.intra_node: expected a Link of kind {INTRA_NODE_KINDS}, "
                             f"got {self.intra_node!r}")
        if self.inter_node is None:
            if self.num_nodes > 1:
                raise ValueError(f"Topology.inter_node: required with {self.num_nodes} nodes, got None")
        elif not isinstance(self.inter_node, Link) or self.inter_node.kind not in INTER_NODE_KINDS:
            raise ValueError(f"Topology.inter_node: expected a Link of kind {INTER_NODE_KINDS}, "
                             f"got {self.inter_node!r}")
        if not self.hosts:
            object.__setattr__(self, "hosts", tuple("" for _ in range(self.num_nodes)))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        if len(self.hosts) != self.num_nodes:
            raise ValueError(f"Topology.hosts: expected {self.num_nodes} names, got {len(self.hosts)}")
        num_gpus = self.num_nodes * self.gpus_per_node
        if not self.node_of_gpu:
            object.__setattr__(self, "node_of_gpu", tuple(g // self.gpus_per_node for g in range(num_gpus)))
        object.__setattr__(self, "node_of_gpu", tuple(int(n) for n in self.node_of_gpu))
        if len(self.node_of_gpu) != num_gpus:
            raise ValueError(f"Topology.node_of_gpu: expected {num_gpus} entries, got {len(self.node_of_gpu)}")
        for n in range(self.num_nodes):
            held = self.node_of_gpu.count(n)
            if held != self.gpus_per_node:
                raise ValueError(f"Topology.node_of_gpu: expected {self.gpus_per_node} GPUs on node {n}, "
                                 f"got {held}")

    # ----------------------------------------------------------------------------------------- views
    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def local_rank_of_gpu(self) -> tuple[int, ...]:
        """Index of each GPU among its node's GPUs, in rank order (DeepEP's RDMA peers share it)."""
        seen = [0] * self.num_nodes
        out = []
        for n in self.node_of_gpu:
            out.append(seen[n])
            seen[n] += 1
        return tuple(out)

    @property
    def gpus_of_node(self) -> tuple[tuple[int, ...], ...]:
        """GPUs (ranks) of each node, ascending."""
        return tuple(tuple(g for g, m in enumerate(self.node_of_gpu) if m == n) for n in range(self.num_nodes))

    def describe(self) -> str:
        """One line for reports."""
        inter = "single node" if self.inter_node is None else (
            f"{self.inter_node.count}x {self.inter_node.kind} {self.inter_node.bandwidth_GBps * 8:g} Gb/s per node")
        label = f"{self.name}: " if self.name else ""
        gpu = f" {self.gpu}" if self.gpu else ""
        return (f"{label}{self.num_nodes} nodes x {self.gpus_per_node}{gpu}; intra-node "
                f"{self.intra_node.kind} {self.intra_node.total_GBps:g} GB/s per GPU; {inter}")

    # ---------------------------------------------------------------------------------- constructors
    @classmethod
    def uniform(
        cls,
        nodes: int,
        gpus_per_node: int,
        *,
        intra_node: str = "nvswitch",
        intra_node_GBps: float = 450.0,
        nics_per_node: int = 8,
        nic_GBps: float = 50.0,
        inter_node: str = "rdma",
        gpu: str = "H100-SXM-80GB",
        name: str = "",
    ) -> Topology:
        """Identical nodes; defaults describe H100 SXM nodes with 8x 400 Gb/s RDMA NICs."""
        _check_int("nodes", nodes)
        inter = None if nodes == 1 else Link(kind=inter_node, bandwidth_GBps=nic_GBps, count=nics_per_node)
        return cls(num_nodes=nodes, gpus_per_node=gpus_per_node,
                   intra_node=Link(kind=intra_node, bandwidth_GBps=intra_node_GBps),
                   inter_node=inter, gpu=gpu, name=name or f"{nodes}x{gpus_per_node}")

    @classmethod
    def from_file(cls, path: str | Path) -> Topology:
        """Reads a YAML (``.yaml``/``.yml``) or JSON description; see ``topology/examples/``.

        Keys: ``nodes``, ``gpus_per_node``, ``intra_node: {kind, bandwidth}``, ``inter_node: {kind,
        nics, bandwidth}`` (bandwidth per NIC), optional ``name``, ``gpu``, ``hosts``. Errors name the
        file and the key.
        """
        path = Path(path)
        text = path.read_text()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: object, *, source: str = "topology") -> Topology:
        """Builds a Topology from the parsed description (the schema of :meth:`from_file`)."""
        if not isinstance(data, dict):
            raise TypeError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        known = {"name", "nodes", "gpus_per_node", "gpu", "hosts", "intra_node", "inter_node"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; expected some of {sorted(known)}")

        def need(key: str) -> object:
            if key not in data:
                raise ValueError(f"{source}: missing key {key!r}")
            return data[key]

        nodes = _check_int(f"{source}: nodes", need("nodes"))
        gpus_per_node = _check_int(f"{source}: gpus_per_node", need("gpus_per_node"))
        intra = need("intra_node")
        if not isinstance(intra, dict):
            raise TypeError(f"{source}: intra_node: expected a mapping with kind and bandwidth, got {intra!r}")
        intra_link = _link(f"{source}: intra_node", intra, count_key=None)
        inter = data.get("inter_node")
        inter_link = None
        if inter is not None:
            if not isinstance(inter, dict):
                raise TypeError(f"{source}: inter_node: expected a mapping with kind, nics and bandwidth, "
                                 f"got {inter!r}")
            inter_link = _link(f"{source}: inter_node", inter, count_key="nics")
        elif nodes > 1:
            raise ValueError(f"{source}: inter_node: required with {nodes} nodes")
        hosts = data.get("hosts", ())
        if not isinstance(hosts, (list, tuple)) or not all(isinstance(h, str) for h in hosts):
            raise ValueError(f"{source}: hosts: expected a list of names, got {hosts!r}")
        if hosts and len(hosts) != nodes:
            raise ValueError(f"{source}: hosts: expected {nodes} names, got {len(hosts)}")
        return cls(num_nodes=nodes, gpus_per_node=gpus_per_node, intra_node=intra_link, inter_node=inter_link,
                   hosts=tuple(hosts), gpu=str(data.get("gpu", "")), name=str(data.get("name", _path_stem(source))))

    def to_dict(self) -> dict:
        """The description :meth:`from_dict` reads back (bandwidths in GB/s)."""
        out: dict = {"name": self.name, "nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node,
                     "gpu": self.gpu,
                     "intra_node": {"kind": self.intra_node.kind, "bandwidth": f"{self.intra_node.bandwidth_GBps:g} GB/s"}}
        if self.inter_node is not None:
            out["inter_node"] = {"kind": self.inter_node.kind, "nics": self.inter_node.count,
                                 "bandwidth": f"{self.inter_node.bandwidth_GBps:g} GB/s"}
        if any(self.hosts):
            out["hosts"] = list(self.hosts)
        return out


def _path_stem(source: str) -> str:
    return Path(source).stem if source else ""


def parse_bandwidth(name: str, value: object) -> float:
    """A bandwidth in GB/s from a number (GB/s) or a string with a unit: '400 Gb/s', '450 GB/s'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        gbps = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)\s*", value)
        if not m:
            raise ValueError(f"{name}: expected a number with a unit such as '400 Gb/s' or '450 GB/s', got {value!r}")
        number, unit = float(m.group(1)), m.group(2)
        # The case of the 'b' tells bits from bytes: Gb/s = gigabits, GB/s = gigabytes.
        if re.fullmatch(r"[GMT]b(/s|ps|it/s)", unit):
            scale = {"G": 1 / 8, "M": 1 / 8000, "T": 1000 / 8}[unit[0]]
        elif re.fullmatch(r"[GMT]B(/s|ps)", unit):
            scale = {"G": 1.0, "M": 1e-3, "T": 1e3}[unit[0]]
        else:
            raise ValueError(f"{name}: unknown unit {unit!r}; use Gb/s (bits) or GB/s (bytes)")
        gbps = number * scale
    else:
        raise TypeError(f"{name}: expected a bandwidth (number or string), got {value!r}")
    if not (math.isfinite(gbps) and gbps > 0):
        raise ValueError(f"{name}: expected a positive bandwidth, got {value!r}")
    return gbps


def _link(name: str, spec: dict, *, count_key: str | None) -> Link:
    allowed = {"kind", "bandwidth"} | ({count_key} if count_key else set())
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; expected some of {sorted(allowed)}")
    for key in ("kind", "bandwidth"):
        if key not in spec:
            raise ValueError(f"{name}: missing key {key!r}")
    kinds = INTRA_NODE_KINDS if count_key is None else INTER_NODE_KINDS
    if spec["kind"] not in kinds:
        raise ValueError(f"{name}.kind: expected one of {kinds}, got {spec['kind']!r}")
    count = 1
    if count_key is not None:
        count = _check_int(f"{name}.{count_key}", spec.get(count_key, 1))
    return Link(kind=spec["kind"], bandwidth_GBps=parse_bandwidth(f"{name}.bandwidth", spec["bandwidth"]),
                count=count)
