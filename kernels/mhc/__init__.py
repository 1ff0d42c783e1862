"""mHC: manifold-constrained hyper-connections (see :mod:`kernels.mhc.reference`, the specification)."""

from kernels.mhc.reference import (
    expand,
    head,
    norm_fn,
    post,
    pre,
    pre_apply,
    pre_fused,
    replay,
    round_to_tf32,
    sinkhorn,
    split_sinkhorn,
)

__all__ = [
    "expand",
    "head",
    "norm_fn",
    "post",
    "pre",
    "pre_apply",
    "pre_fused",
    "replay",
    "round_to_tf32",
    "sinkhorn",
    "split_sinkhorn",
]
