"""mHC (manifold-constrained hyper-connections) in plain PyTorch: the specification.

The residual stream is widened to ``N`` copies. Around every sublayer ``F`` (attention, MoE):

    y = pre-mix of the streams           (pre:  norm_fn -> split_sinkhorn -> pre_apply)
    x'_j = post_j * F(y) + sum_i comb[i, j] * x_i      (post)

with the per-token mixing coefficients computed from the streams themselves:

    flat    = x.view(T, N*D) in float32
    mixes   = (flat @ fn.T) * rsqrt(mean(flat**2) + norm_eps)          (norm_fn; no norm weight)
    a       = mixes * [scale0]*N ++ [scale1]*N ++ [scale2]*N*N + base
    pre     = sigmoid(a[:N]) + pre_eps
    post    = post_mult * sigmoid(a[N:2N])                             (post_mult = 2)
    comb    = sinkhorn(a[2N:].view(N, N))
    y       = sum_i pre_i * x_i                                         (pre_apply)

``sinkhorn(L)``: ``P = softmax(L, -1) + eps``; ``P /= colsum(P) + eps``; then ``iters - 1`` times
``P /= rowsum(P) + eps`` and ``P /= colsum(P) + eps``. ``comb[i, j]`` is the weight of input stream
``i`` in output stream ``j`` (post applies ``comb`` transposed). ``expand`` copies the embedding into
the ``N`` streams; ``head`` mixes them for the LM head with ``sigmoid`` weights of its own.

The ops split the same way as the TileLang kernels: ``norm_fn`` (fused norm + projection),
``split_sinkhorn``, ``pre_apply``, ``post``, plus ``pre`` (their composition) and ``pre_fused``
(inference only, one kernel). Each op is an ``autograd.Function`` with an explicit backward, which
is the specification of the backward kernel. ``sinkhorn``/``split_sinkhorn`` save only their inputs
and recompute the ``2 * iters`` normalizations in backward.

Memory (what backward keeps): per sublayer ``pre`` keeps ``x`` (shared with ``post``), ``fn``,
``scale``, ``base`` and ``T * (N*(N+2) + N + 1)`` floats; ``post`` keeps ``x``, ``F(y)`` and the
``T * N * (N+1)`` coefficients. Two ways to keep less:

* ``pre(..., recompute=True)`` checkpoints the pre path (``torch.utils.checkpoint``, non-reentrant):
  only its inputs are kept; the norm, split, Sinkhorn and the mix are recomputed in backward.
* :func:`replay` rebuilds the residual streams and layer inputs of consecutive sublayers from the
  first stream ``x_0`` and each sublayer's small coefficients and ``F`` outputs; a layer that keeps
  only those (``T * D`` per sublayer instead of ``T * N * D``) recomputes the rest in backward with it.

Shapes (suffixes of tensor names):
    T  tokens (batch and sequence flattened)
    N  residual streams (the expansion rate n >= 1)
    D  hidden size of one stream
    K  N * D, the streams flattened
    M  N * (N + 2) mixing coefficients per token: N pre, N post, N * N comb
    3  the three scales (pre, post, comb)

Dtypes: streams ``x_TND`` and sublayer outputs ``f_TD`` are bfloat16, float16, float32 or float64;
parameters (``fn``, ``scale``, ``base``) and coefficients are float32 or float64. Everything is
computed in float32 (float64 when any input is float64); ``y``/``post`` outputs take ``x``'s dtype,
coefficients the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from kernels.validate import check_finite, check_positive, check_tensor

from .functions import (
    Expand,
    HeadMix,
    NormFn,
    Post,
    PreApply,
    Sinkhorn,
    SplitSinkhorn,
    compute_dtype,
    flatten,
    n_from_mixes,
    norm_fn_fwd,
    pre_apply_fwd,
    round_to_tf32,
    sinkhorn_fwd,
    split_fwd,
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

STREAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
PARAM_DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# Argument checks.


# ``values=False`` (the kernels' wrappers): no NaN/Inf check, which reads the whole tensor and
# syncs with the host on every call; a NaN then shows in the outputs instead.
def _check_stream(name: str, x: torch.Tensor, *, values: bool = True) -> torch.Tensor:
    check_tensor(name, x, dtype=STREAM_DTYPES, ndim=3)
    if values:
        check_finite(name, x)
    return x


def _check_param(name: str, t: torch.Tensor, shape: Sequence[int | None], device: torch.device, *,
                 values: bool = True) -> None:
    check_tensor(name, t, dtype=PARAM_DTYPES, shape=shape, device=device)
    if values:
        check_finite(name, t)


def _check_fn(name: str, fn: torch.Tensor, rows: int, x_TND: torch.Tensor, rows_text: str, *,
              values: bool = True) -> None:
    check_tensor(name, fn, dtype=PARAM_DTYPES, ndim=2, device=x_TND.device)
    _, n, d = x_TND.shape
    if tuple(fn.shape) != (rows, n * d):
        raise ValueError(
            f"{name}: expected shape ({rows_text}, N*D) = ({rows}, {n * d}) for x_TND of shape "
            f"{tuple(x_TND.shape)} (N={n} streams), got {tuple(fn.shape)}"
        )
    if values:
        check_finite(name, fn)


def check_eps(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ValueError(f"{name}: expected a finite float >= 0, got {value!r}")
    return float(value)


def _check_sinkhorn_args(iters: int, eps: float) -> None:
    check_positive("iters", iters)
    check_eps("sinkhorn_eps", eps)


# ---------------------------------------------------------------------------------------------
# Public ops.


def expand(h_TD: torch.Tensor, n: int) -> torch.Tensor:
    """Widens the embedding into ``n`` identical residual streams.

    Args:
        h_TD: ``[T, D]`` bfloat16/float16/float32/float64.
        n: streams, >= 1.

    Returns:
        ``x_TND`` ``[T, n, D]``, ``h_TD``'s dtype, contiguous. Backward sums the streams' gradients.
    """
    check_tensor("h_TD", h_TD, dtype=STREAM_DTYPES, ndim=2)
    check_positive("n", n)
    return Expand.apply(h_TD, n)


def norm_fn(x_TND: torch.Tensor, fn_MK: torch.Tensor, *, eps: float = 1e-6, tf32: bool = False) -> torch.Tensor:
    """Fused RMS norm and projection: ``mixes = (flat @ fn.T) * rsqrt(mean(flat**2) + eps)``.

    ``flat = x_TND.view(T, N*D)`` in the compute dtype; there is no separate norm weight (fold it
    into ``fn``). The number of rows of ``fn`` is free (``N*(N+2)`` for ``pre``, ``N`` for ``head``).

    Args:
        x_TND: ``[T, N, D]`` streams, bfloat16/float16/float32/float64.
        fn_MK: ``[M, N*D]`` float32/float64 projection.
        eps: added to the mean square.
        tf32: round ``fn`` to TF32 (:func:`round_to_tf32`) before the product, as a TF32 kernel
            does; the backward treats the rounding as the identity.

    Returns:
        ``mixes_TM`` ``[T, M]`` in the compute dtype (float32; float64 if an input is float64).
    """
    return NormFn.apply(x_TND, fn_MK, check_norm_fn_args(x_TND, fn_MK, eps), bool(tf32))


def check_norm_fn_args(x_TND, fn_MK, eps, *, values: bool = True) -> float:
    """Raises on bad :func:`norm_fn` arguments; returns ``eps`` as a float."""
    _check_stream("x_TND", x_TND, values=values)
    check_tensor("fn_MK", fn_MK, dtype=PARAM_DTYPES, ndim=2, device=x_TND.device)
    _check_fn("fn_MK", fn_MK, fn_MK.shape[0], x_TND, "M", values=values)
    return check_eps("eps", eps)


def sinkhorn(logits_TNN: torch.Tensor, *, iters: int = 20, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn normalization of per-token ``N x N`` logits into (nearly) doubly stochastic matrices.

    ``P = softmax(L, -1) + eps; P /= colsum(P) + eps``, then ``iters - 1`` times
    ``P /= rowsum(P) + eps; P /= colsum(P) + eps`` (``colsum`` sums over the row index ``i``).
    Backward keeps only ``logits_TNN`` and recomputes the iterations.

    Args:
        logits_TNN: ``[T, N, N]`` float32/float64.
        iters: >= 1.
        eps: >= 0.

    Returns:
        ``comb_TNN`` ``[T, N, N]``, ``logits_TNN``'s dtype.
    """
    check_tensor("logits_TNN", logits_TNN, dtype=PARAM_DTYPES, ndim=3)
    if logits_TNN.shape[1] != logits_TNN.shape[2]:
        raise ValueError(f"logits_TNN: expected square [T, N, N] matrices, got {tuple(logits_TNN.shape)}")
    check_finite("logits_TNN", logits_TNN)
    _check_sinkhorn_args(iters, eps)
    return Sinkhorn.apply(logits_TNN, iters, float(eps))


def split_sinkhorn(
    mixes_TM: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
    sinkhorn_eps: float = 1e-6,
    iters: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits the mixes into the pre, post and comb coefficients (comb through :func:`sinkhorn`).

    ``a = mixes * [scale0]*N ++ [scale1]*N ++ [scale2]*N*N + base``;
    ``pre = sigmoid(a[:, :N]) + pre_eps``, ``post = post_mult * sigmoid(a[:, N:2N])``,
    ``comb = sinkhorn(a[:, 2N:].view(T, N, N))``. ``N`` is inferred from ``M = N*(N+2)``.
    Backward keeps only the three inputs.

    Args:
        mixes_TM: ``[T, M]`` float32/float64 (from :func:`norm_fn`).
        scale_3: ``[3]`` float32/float64.
        base_M: ``[M]`` float32/float64.

    Returns:
        ``(pre_TN, post_TN, comb_TNN)`` in the compute dtype.
    """
    n = check_split_args(mixes_TM, scale_3, base_M, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, iters=iters)
    return SplitSinkhorn.apply(mixes_TM, scale_3, base_M, n, float(pre_eps), float(post_mult), float(sinkhorn_eps),
                                iters)


def check_split_args(mixes_TM, scale_3, base_M, *, pre_eps: float, sinkhorn_eps: float, iters: int,
                     values: bool = True) -> int:
    """Raises on bad :func:`split_sinkhorn` arguments; returns ``N``."""
    check_tensor("mixes_TM", mixes_TM, dtype=PARAM_DTYPES, ndim=2)
    n = n_from_mixes(mixes_TM.shape[1])
    if values:
        check_finite("mixes_TM", mixes_TM)
    _check_param("scale_3", scale_3, (3,), mixes_TM.device, values=values)
    _check_param("base_M", base_M, (mixes_TM.shape[1],), mixes_TM.device, values=values)
    _check_sinkhorn_args(iters, sinkhorn_eps)
    check_eps("pre_eps", pre_eps)
    return n


def pre_apply(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
    """The sublayer input ``y = sum_i pre_i * x_i``, accumulated in the compute dtype.

    Args:
        x_TND: ``[T, N, D]`` streams.
        pre_TN: ``[T, N]`` float32/float64 weights.

    Returns:
        ``y_TD`` ``[T, D]`` in ``x_TND``'s dtype.
    """
    _check_stream("x_TND", x_TND)
    t, n, _ = x_TND.shape
    _check_param("pre_TN", pre_TN, (t, n), x_TND.device)
    return PreApply.apply(x_TND, pre_TN)


def post(f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> torch.Tensor:
    """The new streams ``x'_j = post_j * F(y) + sum_i comb[i, j] * x_i`` (comb applied transposed).

    Args:
        f_TD: ``[T, D]`` the sublayer's output ``F(y)``, bfloat16/float16/float32/float64.
        x_TND: ``[T, N, D]`` the streams that went into ``pre``.
        post_TN: ``[T, N]`` float32/float64.
        comb_TNN: ``[T, N, N]`` float32/float64; ``comb[t, i, j]`` weighs input ``i`` in output ``j``.

    Returns:
        ``[T, N, D]`` in ``x_TND``'s dtype (computed in the compute dtype, rounded once).
    """
    _check_stream("x_TND", x_TND)
    t, n, d = x_TND.shape
    check_tensor("f_TD", f_TD, dtype=STREAM_DTYPES, shape=(t, d), device=x_TND.device)
    check_finite("f_TD", f_TD)
    _check_param("post_TN", post_TN, (t, n), x_TND.device)
    _check_param("comb_TNN", comb_TNN, (t, n, n), x_TND.device)
    return Post.apply(f_TD, x_TND, post_TN, comb_TNN)


def check_pre_args(x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, sinkhorn_eps, iters, *, values=True) -> None:
    _check_stream("x_TND", x_TND, values=values)
    n = x_TND.shape[1]
    m = n * (n + 2)
    _check_fn("fn_MK", fn_MK, m, x_TND, "N*(N+2)", values=values)
    _check_param("scale_3", scale_3, (3,), x_TND.device, values=values)
    _check_param("base_M", base_M, (m,), x_TND.device, values=values)
    check_eps("norm_eps", norm_eps)
    check_eps("pre_eps", pre_eps)
    _check_sinkhorn_args(iters, sinkhorn_eps)


def check_pre_fused_args(x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, sinkhorn_eps, iters, *,
                         values=True) -> None:
    """:func:`check_pre_args`, and no input that autograd would need a gradient of."""
    check_pre_args(x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, sinkhorn_eps, iters, values=values)
    if torch.is_grad_enabled():
        for name, t in (("x_TND", x_TND), ("fn_MK", fn_MK), ("scale_3", scale_3), ("base_M", base_M)):
            if t.requires_grad:
                raise ValueError(
                    f"{name}: pre_fused is inference-only, got a tensor that requires grad with grad "
                    "mode on (use pre(), or torch.no_grad())"
                )


def _pre_ops(norm_op, split_op, apply_op, x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, post_mult, sinkhorn_eps,
             iters, tf32):
    mixes_TM = norm_op(x_TND, fn_MK, norm_eps, tf32)
    pre_TN, post_TN, comb_TNN = split_op(mixes_TM, scale_3, base_M, x_TND.shape[1], pre_eps, post_mult, sinkhorn_eps,
                                         iters)
    return apply_op(x_TND, pre_TN), post_TN, comb_TNN


def compose_pre(norm_op, split_op, apply_op, x_TND, fn_MK, scale_3, base_M, *, norm_eps, pre_eps, post_mult,
                sinkhorn_eps, iters, tf32, recompute, values=True):
    """:func:`pre` over the given autograd ops: ``norm_op(x, fn, eps, tf32)``, ``split_op(mixes,
    scale, base, n, pre_eps, post_mult, sinkhorn_eps, iters)`` and ``apply_op(x, pre)``
    (``kernels.mhc`` passes its kernels', with ``values=False``); arguments checked here, once."""
    check_pre_args(x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, sinkhorn_eps, iters, values=values)
    args = (norm_op, split_op, apply_op, x_TND, fn_MK, scale_3, base_M, float(norm_eps), float(pre_eps), float(post_mult),
            float(sinkhorn_eps), iters, bool(tf32))  # fmt: skip
    if recompute and torch.is_grad_enabled():
        return checkpoint(_pre_ops, *args, use_reentrant=False)
    return _pre_ops(*args)


def pre(
    x_TND: torch.Tensor,
    fn_MK: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
    sinkhorn_eps: float = 1e-6,
    iters: int = 20,
    tf32: bool = False,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a sublayer: ``norm_fn`` -> ``split_sinkhorn`` -> ``pre_apply``, with autograd.

    Args:
        x_TND: ``[T, N, D]`` streams.
        fn_MK: ``[N*(N+2), N*D]`` float32/float64 projection.
        scale_3: ``[3]`` scales of the pre, post and comb logits.
        base_M: ``[N*(N+2)]`` biases.
        norm_eps, pre_eps, post_mult, sinkhorn_eps, iters, tf32: see :func:`norm_fn`,
            :func:`split_sinkhorn`.
        recompute: keep only the inputs for backward and recompute the pre path there
            (``torch.utils.checkpoint``, non-reentrant); same values and gradients. Saves the
            ``T * (N*(N+2) + N + 1)`` intermediate floats; ``x`` is kept either way (see
            :func:`replay` for dropping the streams).

    Returns:
        ``(y_TD, post_TN, comb_TNN)``: the sublayer input in ``x_TND``'s dtype, and the coefficients
        that :func:`post` takes, in the compute dtype.
    """
    return compose_pre(NormFn.apply, SplitSinkhorn.apply, PreApply.apply, x_TND, fn_MK, scale_3, base_M,
                       norm_eps=norm_eps, pre_eps=pre_eps, post_mult=post_mult, sinkhorn_eps=sinkhorn_eps,
                       iters=iters, tf32=tf32, recompute=recompute)


def pre_fused(
    x_TND: torch.Tensor,
    fn_MK: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
    sinkhorn_eps: float = 1e-6,
    iters: int = 20,
    tf32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inference-only :func:`pre` in one pass (norm + split + Sinkhorn + apply): the same values.

    Raises ``ValueError`` when autograd would need a gradient (grad mode on and an input requires
    grad); use :func:`pre` for training. Arguments and results as :func:`pre`.
    """
    check_pre_fused_args(x_TND, fn_MK, scale_3, base_M, norm_eps, pre_eps, sinkhorn_eps, iters)
    n = x_TND.shape[1]
    cdt = compute_dtype(x_TND, fn_MK, scale_3, base_M)
    with torch.no_grad():
        w_MK = (round_to_tf32(fn_MK.float()) if tf32 else fn_MK).to(cdt)
        mixes_TM, _ = norm_fn_fwd(flatten(x_TND).to(cdt), w_MK, norm_eps)
        pre_TN, post_TN, logits_TNN = split_fwd(mixes_TM, scale_3.to(cdt), base_M.to(cdt), n, pre_eps, post_mult)
        comb_TNN = sinkhorn_fwd(logits_TNN, iters, sinkhorn_eps)
        return pre_apply_fwd(x_TND, pre_TN), post_TN, comb_TNN


def head(
    x_TND: torch.Tensor,
    fn_NK: torch.Tensor,
    scale_1: torch.Tensor,
    base_N: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    pre_eps: float = 1e-6,
    tf32: bool = False,
) -> torch.Tensor:
    """Merges the streams for the LM head: ``y = sum_i w_i x_i`` with
    ``w = sigmoid(norm_fn(x, fn) * scale + base) + pre_eps`` (no comb, no post).

    Args:
        x_TND: ``[T, N, D]`` streams.
        fn_NK: ``[N, N*D]`` float32/float64 projection (the head's own).
        scale_1: ``[1]`` scale. base_N: ``[N]`` biases.

    Returns:
        ``y_TD`` ``[T, D]`` in ``x_TND``'s dtype.
    """
    _check_stream("x_TND", x_TND)
    n = x_TND.shape[1]
    _check_fn("fn_NK", fn_NK, n, x_TND, "N")
    _check_param("scale_1", scale_1, (1,), x_TND.device)
    _check_param("base_N", base_N, (n,), x_TND.device)
    mixes_TN = NormFn.apply(x_TND, fn_NK, check_eps("norm_eps", norm_eps), bool(tf32))
    w_TN = HeadMix.apply(mixes_TN, scale_1, base_N, check_eps("pre_eps", pre_eps))
    return PreApply.apply(x_TND, w_TN)


def replay(
    x_TND: torch.Tensor,
    pre_list: Sequence[torch.Tensor],
    post_list: Sequence[torch.Tensor],
    comb_list: Sequence[torch.Tensor],
    f_list: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rebuilds the layer inputs and streams of consecutive sublayers from the first streams.

    For sublayer ``l`` (``L = len(pre_list)``, ``P = len(f_list)``, ``P`` is ``L`` or ``L - 1``):
    ``y_l = pre_apply(x_l, pre_l)`` and, for ``l < P``, ``x_{l+1} = post(f_l, x_l, post_l, comb_l)``
    (rounded to ``x_TND``'s dtype each step, as in the forward). This is the recompute that lets a
    layer keep ``x_0``, the coefficients and the ``F`` outputs instead of every ``x_l``.

    Args:
        x_TND: ``[T, N, D]`` streams before the first sublayer.
        pre_list: ``L`` tensors ``[T, N]``.
        post_list, comb_list, f_list: ``P`` tensors each, ``[T, N]``, ``[T, N, N]``, ``[T, D]``.

    Returns:
        ``(y_list, x_list)``: ``L`` layer inputs ``[T, D]`` and the ``P`` streams ``x_1 .. x_P``.
    """
    _check_stream("x_TND", x_TND)
    n_pre, n_post = len(pre_list), len(f_list)
    if n_post not in (n_pre, n_pre - 1) or len(post_list) != n_post or len(comb_list) != n_post:
        raise ValueError(
            "f_list: expected post_list, comb_list and f_list of one length P, with P = len(pre_list) or "
            f"len(pre_list) - 1, got len(pre_list)={n_pre}, len(post_list)={len(post_list)}, "
            f"len(comb_list)={len(comb_list)}, len(f_list)={n_post}"
        )
    y_list, x_list = [], []
    x = x_TND
    for layer in range(n_pre):
        y_list.append(pre_apply(x, pre_list[layer]))
        if layer < n_post:
            x = post(f_list[layer], x, post_list[layer], comb_list[layer])
            x_list.append(x)
    return y_list, x_list
