"""Argument checks shared by every kernel op.

Each check raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError`` (shape, device, range,
non-finite values) with a message naming the argument, what was expected and what it got.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

SIGNATURES = 256  # kept per check: a transport gives a few (each holds the regions it was given)


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Checks that ``t`` is a tensor of the given dtype(s), rank, shape (None = any) and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name}: expected shape {expected}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_dtype(name: str, value: object, allowed: Sequence[torch.dtype]) -> torch.dtype:
    """A dtype argument (e.g. ``out_dtype``) that must be one of ``allowed``."""
    if value not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected {want}, got {value}")
    return value


def check_finite(name: str, t: torch.Tensor) -> None:
    """NaN or Inf in ``t`` is an error (a router must never pick from them silently)."""
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name}: expected finite values, got {bad} NaN/Inf entries")


def check_index_range(name: str, t: torch.Tensor, high: int, *, allow_masked: bool = True) -> None:
    """Entries must lie in ``[0, high)``, or be -1 (masked) where ``allow_masked``."""
    if t.numel():
        _check_range(name, *torch.stack([t.min(), t.max()]).tolist(), high, allow_masked)


def _check_range(name: str, lo: int, hi: int, high: int, allow_masked: bool) -> None:
    if lo < (-1 if allow_masked else 0) or hi >= high:
        allowed = f"-1 or [0, {high})" if allow_masked else f"[0, {high})"
        raise ValueError(f"{name}: expected entries in {allowed}, got values in [{lo}, {hi}]")


def check_routes(topk_idx_TK: torch.Tensor, num_experts: int, name: str = "topk_idx_TK") -> None:
    """A router's ``[T, K]`` routes: experts in ``[0, num_experts)`` or -1, and a token's experts
    distinct (what a top-k gives; receive buffers sized per token count on it). One host sync;
    kernels that must not sync check on the device (``kernels.comm.plan_kernel.assert_routes``),
    a transport that syncs anyway reads :func:`route_stats` with its own values."""
    raise_for_routes(topk_idx_TK, route_stats(topk_idx_TK).tolist(), num_experts, name)


def route_stats(topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """``[lowest expert, highest expert, tokens naming an expert twice]`` of ``[T, K]`` routes, on
    their device (no sync): what :func:`raise_for_routes` reads. ``[0, -1, 0]`` without routes."""
    if not topk_idx_TK.numel():
        return torch.tensor([0, -1, 0], device=topk_idx_TK.device)
    sorted_TK, repeated_T = _sorted_and_repeated(topk_idx_TK)
    return torch.stack([sorted_TK[:, 0].min().long(), sorted_TK[:, -1].max().long(), repeated_T.sum()])


def _sorted_and_repeated(topk_idx_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's routes sorted, and whether it names an expert twice."""
    sorted_TK = topk_idx_TK.sort(dim=1).values
    return sorted_TK, ((sorted_TK[:, 1:] == sorted_TK[:, :-1]) & (sorted_TK[:, 1:] >= 0)).any(1)


def routes_invalid(stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Whether :func:`raise_for_routes` will raise on ``stats``, as a bool on their device (no
    sync): for peers that must stop with this rank rather than wait for it."""
    return (stats[0] < -1) | (stats[1] >= num_experts) | (stats[2] > 0)


def raise_for_routes(topk_idx_TK: torch.Tensor, stats: Sequence[int], num_experts: int,
                     name: str = "topk_idx_TK") -> None:
    """:func:`check_routes` on its :func:`route_stats`, read on the host (``stats``)."""
    lo, hi, repeats = stats
    if hi >= lo:  # some route
        _check_range(name, lo, hi, num_experts, True)
    if repeats:
        t = int(_sorted_and_repeated(topk_idx_TK)[1].nonzero()[0, 0])
        raise ValueError(f"{name}: expected distinct experts per token, token {t} has {topk_idx_TK[t].tolist()}")


def assert_routes_async(topk_idx_TK: torch.Tensor, num_experts: int, name: str = "topk_idx_TK") -> None:
    """:func:`check_routes`' range check without a host sync where the routes live on a GPU: a
    device-side assert (``torch._assert_async``) stops the process at its next sync, as PyTorch's
    own index checks do. On a CPU the full check runs (a sync costs nothing there)."""
    if not topk_idx_TK.is_cuda:
        check_routes(topk_idx_TK, num_experts, name)
    elif topk_idx_TK.numel():
        in_range = torch.logical_and(topk_idx_TK >= -1, topk_idx_TK < num_experts).all()
        torch._assert_async(in_range, f"{name}: expected entries in -1 or [0, {num_experts})")


def check_positive(name: str, value: int) -> int:
    """An integer size or count that must be >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def per_signature(check):
    """``check``, a check of shapes, dtypes and devices only, run once per signature of its
    positional arguments (each tensor's shape, dtype and device; any other argument with its type,
    hashable) and its result kept: an eager launch would otherwise repeat it on every call
    (``reduce_sum_home``'s checks take 11.3 us on an H200's host, their look-up 5.7). A bad argument
    still raises on every call: a signature is kept once its check passed. A kept signature holds
    its arguments that are not tensors: give it objects that live on anyway (a transport's
    regions), never one made per call."""
    passed = {}

    @functools.wraps(check)
    def checked(*args):
        key = tuple([(a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a) for a in args])
        result = passed.get(key, passed)
        if result is passed:
            result = check(*args)
            if len(passed) >= SIGNATURES:
                passed.clear()
            passed[key] = result
        return result

    return checked
