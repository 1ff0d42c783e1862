"""Topology planner: what the cluster looks like and where experts go.

Pure PyTorch on the CPU; imports nothing of ``ep_runtime``. See ``topology/README.md``.
"""

from .cluster import Link, Topology
from .discover import discover
from .planner import POLICIES, Migration, Plan, migration, plan, plan_from_phy2log
from .replanner import replan
from .traffic import Traffic, TrafficModel

__all__ = [
    "POLICIES",
    "Link",
    "Migration",
    "Plan",
    "Topology",
    "Traffic",
    "TrafficModel",
    "discover",
    "migration",
    "plan",
    "plan_from_phy2log",
    "replan",
]
