"""Weighted reduction of expert outputs per token (see :mod:`kernels.reduce.reference`)."""

from kernels.reduce.reference import weighted_reduce

__all__ = ["weighted_reduce"]
