"""How ``bench kernels`` checks an op's output against its reference: bit for bit, or within a
float tolerance, or by the op's own rule (``normwise``, ``within_largest``: the GPU tests' rules);
and how far a peer's output agrees with it (for information)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def _leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of an op's output (a tensor, a tuple of them, or an ExpertLayout)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out):
        return [getattr(out, f.name) for f in dataclasses.fields(out) if isinstance(getattr(out, f.name), torch.Tensor)]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _leaves(item)]
    return []


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def check(got: Any, want: Any, exact: bool, within: Callable[[Any, Any], bool] | None = None) -> dict:
    """``{"ok", "exact", "max_abs_err"}``: bit-exact comparison of every output tensor; with
    ``exact=False``, floating outputs may differ by rtol 1e-5, or one unit in the last place of a
    16-bit output (a sum reassociated, then rounded once), or as ``within(got, want)`` allows;
    integer outputs still exactly."""
    got_t, want_t = _leaves(got), _leaves(want)
    if len(got_t) != len(want_t):
        return {"ok": False, "exact": False, "error": f"{len(got_t)} outputs, reference has {len(want_t)}"}
    ok, all_exact, worst = True, True, 0.0
    for g, w in zip(got_t, want_t):
        if g.shape != w.shape or g.dtype != w.dtype:
            return {"ok": False, "exact": False, "error": f"got {g.dtype}{list(g.shape)}, want {w.dtype}{list(w.shape)}"}
        same = torch.equal(_bits(g), _bits(w)) if g.element_size() == 1 else torch.equal(g, w)
        if same:
            continue
        all_exact = False
        if g.is_floating_point() and g.element_size() > 1:
            worst = max(worst, float((g.double() - w.double()).abs().max()))
            rtol = max(1e-5, torch.finfo(g.dtype).eps)
            close = within is not None or torch.allclose(g.double(), w.double(), rtol=rtol, atol=1e-6)
            ok = ok and not exact and close
        else:
            ok = False
    if ok and not all_exact and within is not None:
        ok = within(got, want)
    return {"ok": ok, "exact": all_exact, "max_abs_err": worst}


def agreement(got: Any, want: Any) -> float | None:
    """Fraction of equal elements in the first output tensor (a peer's outputs, for information);
    integer outputs of different widths (a peer's int32 indices) by value."""
    try:
        g, w = _leaves(got)[0], _leaves(want)[0]
    except IndexError:
        return None
    if g.shape != w.shape:
        return None
    if g.numel() == 0:
        return 1.0
    if g.element_size() != w.element_size():
        if g.is_floating_point() or w.is_floating_point():
            return None
        return float((g.long() == w.long()).float().mean())
    if g.dtype != w.dtype:
        g, w = _bits(g).view(torch.uint8), _bits(w).view(torch.uint8)
    return float((_bits(g) == _bits(w)).float().mean())


def _errors(got: Any, want: Any) -> list[tuple[float, float, torch.dtype]]:
    """``(max |got - want|, max |want|, dtype)`` of each non-empty output."""
    return [(float((g.double() - w.double()).abs().max()), float(w.double().abs().max()), w.dtype)
            for g, w in zip(_leaves(got), _leaves(want)) if w.numel()]


def normwise(got: Any, want: Any) -> bool:
    """The backward ops' and norm_fn's check: every output within two units in the last place of its
    dtype (1e-5 for float32) of the reference's largest magnitude. Their sums (over D, over N*D for
    norm_fn) run in another order than the reference's, so elementwise closeness fails where a sum
    cancels; the GPU tests hold them to reassociation bounds."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
    return all(err <= tol[dtype] * largest for err, largest, dtype in _errors(got, want))


def within_largest(rel: float) -> Callable[[Any, Any], bool]:
    """A check rule: every output within ``rel`` of the reference's largest magnitude, or of 1 where
    that is smaller (the split + Sinkhorn GPU tests' rule: ``expf`` against ``torch.exp`` may differ
    by an ulp, carried through 39 normalizations, and back in the backward)."""
    return lambda got, want: all(err <= rel * max(largest, 1.0) for err, largest, _ in _errors(got, want))
