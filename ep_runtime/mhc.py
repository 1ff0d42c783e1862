"""mHC layers: the residual stream widened to ``n`` streams and mixed around every sublayer.

``expand`` copies the embedding into the streams at the bottom, one :class:`HyperConnection` per
sublayer (attention, MoE) computes

    y        = sum_i pre_i * x_i                          (the sublayer's input)
    x'_j     = post_j * F(y) + sum_i comb[i, j] * x_i     (comb applied transposed)

with per-token coefficients from the streams themselves (``kernels.mhc.pre``/``post``), and
:class:`MHCHead` mixes the streams into one for the final norm and the LM head. The stream diagram
is in ``mhc.md`` beside this file.

Memory: with ``MHCConfig.recompute`` the layers keep only the inputs of the pre path and recompute
the norm, projection, split, Sinkhorn and pre-mix in backward (``kernels.mhc.pre(recompute=True)``;
the head likewise through ``torch.utils.checkpoint``), and a block (:func:`two_sublayers`) does not
keep the streams between its attention and its FFN: it rebuilds them from the block's input
streams, the attention's output and the coefficients (one ``post``, recomputed twice). See
:func:`saved_bytes` to measure what a forward keeps.

The mHC math runs with autocast off: the coefficients are float32 whatever the sublayers compute in.

Shape letters: B sequences, S positions, T = B*S tokens, N streams, D hidden of one stream,
K = N*D, M = N*(N+2) mixing coefficients per token.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels import mhc

from .config import MHCConfig

__all__ = ["HyperConnection", "MHCHead", "expand", "saved_bytes", "two_sublayers"]

# Initial values. The per-token part starts small (scale) so the static biases set the start:
# the sublayer input is the mean of the streams (half the one stream for N = 1), each stream gets
# F(y) once (post = 1) and keeps mostly itself (comb leans to the identity).
SCALE_INIT = 0.01
COMB_DIAGONAL_INIT = 2.0


def _pre_logit(n: int) -> float:
    """Bias that makes ``sigmoid(b) = 1/n`` (the mean of the streams); 0 (one half) for n = 1."""
    return math.log(1.0 / (n - 1)) if n > 1 else 0.0


def flat_streams(x_BSND: torch.Tensor, n: int) -> torch.Tensor:
    """``x_BSND`` checked (``[B, S, n, D]``: ``model.mhc.n`` streams) and flattened to ``x_TND``."""
    if x_BSND.dim() != 4 or x_BSND.shape[2] != n:
        raise ValueError(f"x_BSND: expected [B, S, {n}, D] ({n} streams, model.mhc.n), got shape "
                         f"{tuple(x_BSND.shape)}")
    b, s, _, d = x_BSND.shape
    return x_BSND.reshape(b * s, n, d)


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) else (
        contextlib.nullcontext())


def expand(h_BSD: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, S, D]`` embedding -> ``[B, S, n, D]`` streams, each a copy (backward sums them)."""
    b, s, d = h_BSD.shape
    return mhc.expand(h_BSD.reshape(b * s, d), n).view(b, s, n, d)


class HyperConnection(nn.Module):
    """The mHC mixing around one sublayer: ``x' = post * F(pre_apply(x)) + comb^T x``.

    Parameters (float32): ``fn_MK`` ``[N*(N+2), N*D]`` (the projection, RMS norm folded in),
    ``scale_3`` ``[3]`` (pre, post, comb), ``base_M`` ``[N*(N+2)]``.
    """

    def __init__(self, cfg: MHCConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        n = cfg.n
        self.fn_MK = nn.Parameter(torch.randn(n * (n + 2), n * hidden) / math.sqrt(n * hidden))
        self.scale_3 = nn.Parameter(torch.full((3,), SCALE_INIT))
        comb_NN = torch.eye(n) * COMB_DIAGONAL_INIT
        self.base_M = nn.Parameter(torch.cat([torch.full((n,), _pre_logit(n)), torch.zeros(n), comb_NN.flatten()]))

    def coefficients(self, x_TND: torch.Tensor, *, recompute: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(y_TD, post_TN, comb_TNN)`` of ``kernels.mhc.pre`` for streams ``x_TND``
        (``recompute`` defaults to the config's)."""
        c = self.cfg
        return mhc.pre(x_TND, self.fn_MK, self.scale_3, self.base_M, norm_eps=c.eps, pre_eps=c.eps,
                       sinkhorn_eps=c.eps, iters=c.sinkhorn_iters,
                       recompute=c.recompute if recompute is None else recompute)

    def streams(self, x_BSND: torch.Tensor) -> torch.Tensor:
        return flat_streams(x_BSND, self.cfg.n)

    def forward(self, x_BSND: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Args:
            x_BSND: ``[B, S, N, D]`` streams.
            sublayer: ``F``, ``[B, S, D] -> [B, S, D]`` (attention or MoE with its norm).
        Returns:
            ``[B, S, N, D]`` streams, ``x_BSND``'s dtype.
        """
        x_TND = self.streams(x_BSND)
        b, s, n, d = x_BSND.shape
        with _no_autocast(x_BSND.device):
            y_TD, post_TN, comb_TNN = self.coefficients(x_TND)
        f_BSD = sublayer(y_TD.view(b, s, d))
        with _no_autocast(x_BSND.device):
            return mhc.post(f_BSD.reshape(b * s, d), x_TND, post_TN, comb_TNN).view(b, s, n, d)


def two_sublayers(x_BSND: torch.Tensor, first: HyperConnection, f_first: Callable[[torch.Tensor], torch.Tensor],
                  second: HyperConnection, f_second: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``second(first(x, f_first), f_second)``: a block's attention and FFN. With
    ``first.cfg.recompute`` the same values and gradients, keeping less for backward: the mixing
    coefficients of both sublayers are recomputed, and so are the streams between the two
    sublayers (``x_mid = post(f_first, x, ...)``, rebuilt from ``x``, ``F`` outputs and the small
    coefficients, so a block keeps one ``[T, N, D]`` stream instead of two)."""
    if not (first.cfg.recompute and torch.is_grad_enabled()):
        return second(first(x_BSND, f_first), f_second)
    b, s, n, d = x_BSND.shape
    x_TND = first.streams(x_BSND)
    with _no_autocast(x_BSND.device):
        y1_TD, post1_TN, comb1_TNN = first.coefficients(x_TND, recompute=True)
    f1_TD = f_first(y1_TD.view(b, s, d)).reshape(b * s, d)
    with _no_autocast(x_BSND.device):  # x_mid lives only inside the two checkpointed regions
        y2_TD, post2_TN, comb2_TNN = checkpoint(_post_then_pre, second, f1_TD, x_TND, post1_TN, comb1_TNN,
                                                second.fn_MK, second.scale_3, second.base_M, use_reentrant=False)
    f2_TD = f_second(y2_TD.view(b, s, d)).reshape(b * s, d)
    with _no_autocast(x_BSND.device):
        out_TND = checkpoint(_post_twice, f1_TD, x_TND, post1_TN, comb1_TNN, f2_TD, post2_TN, comb2_TNN,
                             use_reentrant=False)
    return out_TND.view(b, s, n, d)


def _post_then_pre(second, f1_TD, x_TND, post1_TN, comb1_TNN, fn_MK, scale_3, base_M):
    # the parameters come in as arguments so the checkpoint keeps (and differentiates) them
    x_mid_TND = mhc.post(f1_TD, x_TND, post1_TN, comb1_TNN)
    c = second.cfg
    return mhc.pre(x_mid_TND, fn_MK, scale_3, base_M, norm_eps=c.eps, pre_eps=c.eps, sinkhorn_eps=c.eps,
                   iters=c.sinkhorn_iters)


def _post_twice(f1_TD, x_TND, post1_TN, comb1_TNN, f2_TD, post2_TN, comb2_TNN):
    return mhc.post(f2_TD, mhc.post(f1_TD, x_TND, post1_TN, comb1_TNN), post2_TN, comb2_TNN)


class MHCHead(nn.Module):
    """Mixes the streams into one for the LM head: ``y = sum_i w_i x_i``,
    ``w = sigmoid(norm_fn(x, fn) * scale + base) + eps``.

    Parameters (float32): ``fn_NK`` ``[N, N*D]``, ``scale_1`` ``[1]``, ``base_N`` ``[N]``.
    """

    def __init__(self, cfg: MHCConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        n = cfg.n
        self.fn_NK = nn.Parameter(torch.randn(n, n * hidden) / math.sqrt(n * hidden))
        self.scale_1 = nn.Parameter(torch.full((1,), SCALE_INIT))
        self.base_N = nn.Parameter(torch.full((n,), _pre_logit(n)))

    def _mix(self, x_TND: torch.Tensor, fn_NK, scale_1, base_N) -> torch.Tensor:
        return mhc.head(x_TND, fn_NK, scale_1, base_N, norm_eps=self.cfg.eps, pre_eps=self.cfg.eps)

    def forward(self, x_BSND: torch.Tensor) -> torch.Tensor:
        """``[B, S, N, D]`` streams -> ``[B, S, D]``, ``x_BSND``'s dtype."""
        x_TND = flat_streams(x_BSND, self.cfg.n)
        b, s, d = *x_BSND.shape[:2], x_BSND.shape[3]
        args = (x_TND, self.fn_NK, self.scale_1, self.base_N)
        with _no_autocast(x_BSND.device):
            if self.cfg.recompute and torch.is_grad_enabled():
                y_TD = checkpoint(self._mix, *args, use_reentrant=False)
            else:
                y_TD = self._mix(*args)
        return y_TD.view(b, s, d)


@contextlib.contextmanager
def saved_bytes(module: nn.Module | None = None) -> Iterator[dict[str, int]]:
    """Counts what autograd keeps for backward while the block runs: ``{"bytes", "tensors"}``,
    each distinct storage once (a tensor saved by several nodes counts once), ``module``'s
    parameters and buffers excluded (they exist anyway). Use around a forward::

        with saved_bytes(model) as kept:
            loss = model.loss(tokens)
        print(kept["bytes"])
    """
    result = {"bytes": 0, "tensors": 0}
    skip = set()
    if module is not None:
        skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in skip:
            seen.add(key)
            result["bytes"] += storage.nbytes()
            result["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
