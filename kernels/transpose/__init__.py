"""Batched matrix transpose (see :mod:`kernels.transpose.reference`)."""

from kernels.transpose.reference import batched_transpose

__all__ = ["batched_transpose"]
