"""Which implementation a kernel op runs: the TileLang kernel or the PyTorch reference.

TileLang on CUDA devices of compute capability >= 9.0, the reference everywhere else. The
environment variable ``EP_KERNELS=reference|tilelang`` overrides. The choice is made once per
device and logged; it never depends on a kernel raising. Ops whose kernels have no autograd of
their own (SwiGLU, the weighted reduction, the transpose) run the reference for inputs that need a
gradient (:func:`needs_grad`), so that a direct call is differentiable on every device; the
runtime calls them inside its own ``autograd.Function``s, where grad mode is off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

CHOICES = ("reference", "tilelang")


@functools.cache
def _choice(device_type: str, index: int | None) -> str:
    forced = os.environ.get("EP_KERNELS", "").strip().lower()
    if forced and forced not in CHOICES:
        raise ValueError(f"EP_KERNELS: expected one of {CHOICES}, got {forced!r}")
    if forced:
        choice, why = forced, "EP_KERNELS"
    elif device_type == "cuda" and torch.cuda.get_device_capability(index) >= (9, 0):
        choice, why = "tilelang", "CUDA compute capability >= 9.0"
    else:
        choice, why = "reference", f"{device_type} device"
    if choice == "tilelang" and device_type != "cuda":
        raise ValueError(f"EP_KERNELS=tilelang needs a CUDA device, got {device_type}")
    where = device_type if index is None else f"{device_type}:{index}"
    log.info("kernels on %s: %s (%s)", where, choice, why)
    return choice


def needs_grad(*tensors: object) -> bool:
    """True when grad mode is on and one of ``tensors`` requires a gradient."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def use_tilelang(device: torch.device) -> bool:
    """True when ops on ``device`` run TileLang kernels (cached per device; see module doc)."""
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    return _choice(device.type, index) == "tilelang"
