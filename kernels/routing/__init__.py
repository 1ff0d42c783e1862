"""Routing: router scores, top-k expert choice and weights, hash routing, load statistics.

The ops below are the PyTorch references (``reference.py``, the specification); TileLang kernels
will be chosen here per device through :func:`kernels.select.use_tilelang`.
"""

from .reference import expert_counts, hash_route, score, sequence_balance_stats, topk_route, topk_weights

__all__ = ["expert_counts", "hash_route", "score", "sequence_balance_stats", "topk_route", "topk_weights"]
