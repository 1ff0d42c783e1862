"""Permutation: the expert-major layout of routes for grouped GEMM, and gathers into and out of it.

The ops below are the PyTorch references (``reference.py``, the specification); TileLang kernels
will be chosen here per device through :func:`kernels.select.use_tilelang`.
"""

from .reference import ExpertLayout, expand, expert_layout, max_rows, unexpand

__all__ = ["ExpertLayout", "expand", "expert_layout", "max_rows", "unexpand"]
