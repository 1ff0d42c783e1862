"""FP8 (e4m3) casts and SwiGLU (see :mod:`kernels.quant.reference` for the conventions)."""

from kernels.quant.reference import (
    cast_back,
    per_block_cast,
    per_channel_cast,
    per_token_cast,
    swiglu,
    swiglu_backward,
    swiglu_per_token_cast,
)

__all__ = [
    "cast_back",
    "per_block_cast",
    "per_channel_cast",
    "per_token_cast",
    "swiglu",
    "swiglu_backward",
    "swiglu_per_token_cast",
]
