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
# Forward math shared by the autograd Functions and pre_fused (so both compute the same bits).


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _flatten(x_TND: torch.Tensor) -> torch.Tensor:
    t, n, d = x_TND.shape
    return x_TND.reshape(t, n * d)


def _norm_fn_fwd(flat_TK: torch.Tensor, fn_MK: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd_T = torch.rsqrt(flat_TK.square().mean(-1) + eps)
    mixes_TM = (flat_TK @ fn_MK.T) * rstd_T[:, None]
    return mixes_TM, rstd_T


def _scale_M(scale_3: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([scale_3[0].expand(n), scale_3[1].expand(n), scale_3[2].expand(n * n)])


def _split_fwd(
    mixes_TM: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor, n: int, pre_eps: float, post_mult: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a_TM = mixes_TM * _scale_M(scale_3, n) + base_M
    pre_TN = torch.sigmoid(a_TM[:, :n]) + pre_eps
    post_TN = post_mult * torch.sigmoid(a_TM[:, n : 2 * n])
    logits_TNN = a_TM[:, 2 * n :].reshape(-1, n, n)
    return pre_TN, post_TN, logits_TNN


def _sinkhorn_fwd(logits_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    p_TNN = torch.softmax(logits_TNN, dim=-1) + eps
    p_TNN = p_TNN / (p_TNN.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        p_TNN = p_TNN / (p_TNN.sum(-1, keepdim=True) + eps)
        p_TNN = p_TNN / (p_TNN.sum(-2, keepdim=True) + eps)
    return p_TNN


def _sinkhorn_bwd(logits_TNN: torch.Tensor, grad_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Gradient of :func:`_sinkhorn_fwd` w.r.t. the logits, recomputing the forward from them.

    Each normalization ``X = A / (sum_axis(A) + eps)`` has the backward
    ``dA = (dX - sum_axis(dX * X)) / (sum_axis(A) + eps)``; softmax's is ``P * (dP - sum(dP * P))``.
    """
    p_TNN = torch.softmax(logits_TNN, dim=-1)
    steps = []  # (axis, normalized output, divisor), in forward order
    out_TNN = p_TNN + eps
    for axis in [-2] + [-1, -2] * (iters - 1):
        div = out_TNN.sum(axis, keepdim=True) + eps
        out_TNN = out_TNN / div
        steps.append((axis, out_TNN, div))
    g_TNN = grad_TNN
    for axis, out_TNN, div in reversed(steps):
        g_TNN = (g_TNN - (g_TNN * out_TNN).sum(axis, keepdim=True)) / div
    return p_TNN * (g_TNN - (g_TNN * p_TNN).sum(-1, keepdim=True))


def _pre_apply_fwd(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
    cdt = _compute_dtype(x_TND, pre_TN)
    return (pre_TN.to(cdt)[:, :, None] * x_TND.to(cdt)).sum(1).to(x_TND.dtype)


def _post_fwd(f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> torch.Tensor:
    cdt = _compute_dtype(f_TD, x_TND, post_TN, comb_TNN)
    mixed_TND = torch.einsum("tij,tid->tjd", comb_TNN.to(cdt), x_TND.to(cdt))
    return (post_TN.to(cdt)[:, :, None] * f_TD.to(cdt)[:, None, :] + mixed_TND).to(x_TND.dtype)


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """Rounds float32 values to the nearest TF32 value (10 mantissa bits; ties away from zero).

    This is what a TF32 tensor-core matmul sees of an fp32 operand converted with round-to-nearest;
    ``norm_fn(..., tf32=True)`` uses it to specify the kernel's TF32 projection exactly (a bfloat16
    ``x`` is already exact in TF32). Finite inputs only.
    """
    check_tensor("t", t, dtype=torch.float32)
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view_as(t)


# ---------------------------------------------------------------------------------------------
# Autograd Functions: forward = the op, backward = the explicit gradient (the backward kernels' spec).


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TND, fn_MK, eps, tf32):
        cdt = _compute_dtype(x_TND, fn_MK)
        flat_TK = _flatten(x_TND).to(cdt)
        w_MK = (round_to_tf32(fn_MK.float()) if tf32 else fn_MK).to(cdt)
        mixes_TM, rstd_T = _norm_fn_fwd(flat_TK, w_MK, eps)
        ctx.save_for_backward(x_TND, fn_MK, mixes_TM, rstd_T)
        ctx.tf32 = tf32
        return mixes_TM

    @staticmethod
    def backward(ctx, g_TM):
        return (*norm_fn_backward(*ctx.saved_tensors, g_TM, ctx.tf32), None, None)


def norm_fn_backward_terms(g_TM, mixes_TM, rstd_T, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g * rstd, sum_m(g * mixes) * rstd^2 / K)``: what :func:`norm_fn_backward` multiplies
    ``fn`` and ``flat`` by."""
    return g_TM * rstd_T[:, None], (g_TM * mixes_TM).sum(-1) * rstd_T.square() / k


def norm_fn_backward(x_TND, fn_MK, mixes_TM, rstd_T, g_TM, tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_fn)`` of :func:`norm_fn` from its forward's ``mixes`` and ``rstd``."""
    # mixes = (flat @ w.T) * rstd, rstd = (sum(flat^2)/K + eps)^-1/2, d rstd/d flat = -rstd^3 flat / K:
    #   d flat = (g * rstd) @ w - sum_m(g * mixes) * rstd^2 / K * flat;   d w = (g * rstd).T @ flat.
    # TF32 rounding of fn is treated as the identity (straight-through).
    cdt = mixes_TM.dtype
    flat_TK = _flatten(x_TND).to(cdt)
    w_MK = (round_to_tf32(fn_MK.float()) if tf32 else fn_MK).to(cdt)
    gproj_TM, coef_T = norm_fn_backward_terms(g_TM.to(cdt), mixes_TM, rstd_T, flat_TK.shape[1])
    grad_flat_TK = gproj_TM @ w_MK - coef_T[:, None] * flat_TK
    grad_fn_MK = gproj_TM.T @ flat_TK
    return grad_flat_TK.view_as(x_TND).to(x_TND.dtype), grad_fn_MK.to(fn_MK.dtype)


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TNN, iters, eps):
        ctx.save_for_backward(logits_TNN)  # only the logits: backward recomputes the iterations
        ctx.iters, ctx.eps = iters, eps
        return _sinkhorn_fwd(logits_TNN, iters, eps)

    @staticmethod
    def backward(ctx, g_TNN):
        (logits_TNN,) = ctx.saved_tensors
        return _sinkhorn_bwd(logits_TNN, g_TNN.to(logits_TNN.dtype), ctx.iters, ctx.eps), None, None


class _SplitSinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixes_TM, scale_3, base_M, n, pre_eps, post_mult, sinkhorn_eps, iters):
        cdt = _compute_dtype(mixes_TM, scale_3, base_M)
        pre_TN, post_TN, logits_TNN = _split_fwd(
            mixes_TM.to(cdt), scale_3.to(cdt), base_M.to(cdt), n, pre_eps, post_mult
        )
        comb_TNN = _sinkhorn_fwd(logits_TNN, iters, sinkhorn_eps)
        ctx.save_for_backward(mixes_TM, scale_3, base_M)  # the rest is recomputed in backward
        ctx.n, ctx.post_mult, ctx.sinkhorn_eps, ctx.iters = n, post_mult, sinkhorn_eps, iters
        return pre_TN, post_TN, comb_TNN

    @staticmethod
    def backward(ctx, g_pre_TN, g_post_TN, g_comb_TNN):
        # a = mixes * scale_M + base; pre = sigmoid(a_pre) + eps; post = post_mult * sigmoid(a_post);
        # comb = sinkhorn(a_comb). d a = sigmoid' * g (pre, post), sinkhorn backward (comb);
        # d mixes = d a * scale_M; d base = sum_T d a; d scale_s = sum_T sum_{m in part s} d a * mixes.
        mixes_TM, scale_3, base_M = ctx.saved_tensors
        n, t = ctx.n, mixes_TM.shape[0]
        cdt = _compute_dtype(mixes_TM, scale_3, base_M)
        m_TM = mixes_TM.to(cdt)
        scale_M = _scale_M(scale_3.to(cdt), n)
        a_TM = m_TM * scale_M + base_M.to(cdt)
        zeros = m_TM.new_zeros
        g_pre_TN = zeros(t, n) if g_pre_TN is None else g_pre_TN.to(cdt)
        g_post_TN = zeros(t, n) if g_post_TN is None else g_post_TN.to(cdt)
        g_comb_TNN = zeros(t, n, n) if g_comb_TNN is None else g_comb_TNN.to(cdt)
        s_pre_TN = torch.sigmoid(a_TM[:, :n])
        s_post_TN = torch.sigmoid(a_TM[:, n : 2 * n])
        da_TM = torch.cat(
            [
                g_pre_TN * s_pre_TN * (1 - s_pre_TN),
                g_post_TN * ctx.post_mult * s_post_TN * (1 - s_post_TN),
                _sinkhorn_bwd(a_TM[:, 2 * n :].reshape(t, n, n), g_comb_TNN, ctx.iters, ctx.sinkhorn_eps).reshape(
                    t, n * n
                ),
            ],
            dim=1,
        )
        return (*split_sinkhorn_grads(da_TM, mixes_TM, scale_3, base_M), None, None, None, None, None)


class _PreApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TND, pre_TN):
        ctx.save_for_backward(x_TND, pre_TN)
        return _pre_apply_fwd(x_TND, pre_TN)

    @staticmethod
    def backward(ctx, g_TD):
        # y = sum_i pre_i x_i:  d x_i = pre_i * g;  d pre_i = sum_d g * x_i.
        x_TND, pre_TN = ctx.saved_tensors
        cdt = _compute_dtype(x_TND, pre_TN)
        g_TD = g_TD.to(cdt)
        grad_x_TND = pre_TN.to(cdt)[:, :, None] * g_TD[:, None, :]
        grad_pre_TN = (x_TND.to(cdt) * g_TD[:, None, :]).sum(-1)
        return grad_x_TND.to(x_TND.dtype), grad_pre_TN.to(pre_TN.dtype)


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f_TD, x_TND, post_TN, comb_TNN):
        ctx.save_for_backward(f_TD, x_TND, post_TN, comb_TNN)
        return _post_fwd(f_TD, x_TND, post_TN, comb_TNN)

    @staticmethod
    def backward(ctx, g_TND):
        # x'_j = post_j f + sum_i comb[i, j] x_i:
        #   d f = sum_j post_j g_j;  d post_j = sum_d g_j f;  d x_i = sum_j comb[i, j] g_j;
        #   d comb[i, j] = sum_d x_i g_j.
        f_TD, x_TND, post_TN, comb_TNN = ctx.saved_tensors
        cdt = _compute_dtype(f_TD, x_TND, post_TN, comb_TNN)
        g_TND = g_TND.to(cdt)
        f, x, post_, comb = f_TD.to(cdt), x_TND.to(cdt), post_TN.to(cdt), comb_TNN.to(cdt)
        grad_f_TD = torch.einsum("tj,tjd->td", post_, g_TND)
        grad_post_TN = torch.einsum("tjd,td->tj", g_TND, f)
        grad_x_TND = torch.einsum("tij,tjd->tid", comb, g_TND)
        grad_comb_TNN = torch.einsum("tid,tjd->tij", x, g_TND)
        return (
            grad_f_TD.to(f_TD.dtype),
            grad_x_TND.to(x_TND.dtype),
            grad_post_TN.to(post_TN.dtype),
            grad_comb_TNN.to(comb_TNN.dtype),
        )


class _HeadMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixes_TN, scale_1, base_N, pre_eps):
        ctx.save_for_backward(mixes_TN, scale_1, base_N)
        cdt = _compute_dtype(mixes_TN, scale_1, base_N)
        return torch.sigmoid(mixes_TN.to(cdt) * scale_1.to(cdt) + base_N.to(cdt)) + pre_eps

    @staticmethod
    def backward(ctx, g_TN):
        # w = sigmoid(mixes * scale + base) + eps:  d a = g * s (1 - s);  d mixes = d a * scale;
        # d scale = sum_T sum_N d a * mixes;  d base = sum_T d a.
        mixes_TN, scale_1, base_N = ctx.saved_tensors
        cdt = _compute_dtype(mixes_TN, scale_1, base_N)
        m_TN = mixes_TN.to(cdt)
        s_TN = torch.sigmoid(m_TN * scale_1.to(cdt) + base_N.to(cdt))
        da_TN = g_TN.to(cdt) * s_TN * (1 - s_TN)
        return (
            (da_TN * scale_1.to(cdt)).to(mixes_TN.dtype),
            (da_TN * m_TN).sum().reshape(1).to(scale_1.dtype),
            da_TN.sum(0).to(base_N.dtype),
            None,
        )


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, n):
        return h_TD[:, None, :].expand(h_TD.shape[0], n, h_TD.shape[1]).contiguous()

    @staticmethod
    def backward(ctx, g_TND):
        # every stream is a copy of h: d h = sum_i g_i (accumulated in the compute dtype).
        return g_TND.to(_compute_dtype(g_TND)).sum(1).to(g_TND.dtype), None


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


def _n_from_mixes(m: int) -> int:
    n = math.isqrt(m + 1) - 1
    if n < 1 or n * (n + 2) != m:
        raise ValueError(
            f"mixes_TM: expected N*(N+2) columns for some N >= 1 (3, 8, 15, 24, ...), got {m}"
        )
    return n


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
    return _Expand.apply(h_TD, n)


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
    return _NormFn.apply(x_TND, fn_MK, check_norm_fn_args(x_TND, fn_MK, eps), bool(tf32))


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
    return _Sinkhorn.apply(logits_TNN, iters, float(eps))


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
    return _SplitSinkhorn.apply(mixes_TM, scale_3, base_M, n, float(pre_eps), float(post_mult), float(sinkhorn_eps),
                                iters)


def check_split_args(mixes_TM, scale_3, base_M, *, pre_eps: float, sinkhorn_eps: float, iters: int,
                     values: bool = True) -> int:
    """Raises on bad :func:`split_sinkhorn` arguments; returns ``N``."""
    check_tensor("mixes_TM", mixes_TM, dtype=PARAM_DTYPES, ndim=2)
    n = _n_from_mixes(mixes_TM.shape[1])
    if values:
        check_finite("mixes_TM", mixes_TM)
    _check_param("scale_3", scale_3, (3,), mixes_TM.device, values=values)
    _check_param("base_M", base_M, (mixes_TM.shape[1],), mixes_TM.device, values=values)
    _check_sinkhorn_args(iters, sinkhorn_eps)
    check_eps("pre_eps", pre_eps)
    return n


def split_sinkhorn_grads(da_TM: torch.Tensor, mixes_TM: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor):
    """``(grad_mixes, grad_scale, grad_base)`` from ``da``, the gradient of ``a = mixes * scale_M +
    base`` (in the compute dtype), each in its input's dtype."""
    n = _n_from_mixes(mixes_TM.shape[1])
    m_TM = mixes_TM.to(da_TM.dtype)
    dam_M = (da_TM * m_TM).sum(0)
    grad_scale_3 = torch.stack([dam_M[:n].sum(), dam_M[n : 2 * n].sum(), dam_M[2 * n :].sum()])
    return ((da_TM * _scale_M(scale_3.to(da_TM.dtype), n)).to(mixes_TM.dtype), grad_scale_3.to(scale_3.dtype),
            da_TM.sum(0).to(base_M.dtype))


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
    return _PreApply.apply(x_TND, pre_TN)


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
    return _Post.apply(f_TD, x_TND, post_TN, comb_TNN)


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
    return compose_pre(_NormFn.apply, _SplitSinkhorn.apply, _PreApply.apply, x_TND, fn_MK, scale_3, base_M,
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
    cdt = _compute_dtype(x_TND, fn_MK, scale_3, base_M)
    with torch.no_grad():
        w_MK = (round_to_tf32(fn_MK.float()) if tf32 else fn_MK).to(cdt)
        mixes_TM, _ = _norm_fn_fwd(_flatten(x_TND).to(cdt), w_MK, norm_eps)
        pre_TN, post_TN, logits_TNN = _split_fwd(mixes_TM, scale_3.to(cdt), base_M.to(cdt), n, pre_eps, post_mult)
        comb_TNN = _sinkhorn_fwd(logits_TNN, iters, sinkhorn_eps)
        return _pre_apply_fwd(x_TND, pre_TN), post_TN, comb_TNN


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
    mixes_TN = _NormFn.apply(x_TND, fn_NK, check_eps("norm_eps", norm_eps), bool(tf32))
    w_TN = _HeadMix.apply(mixes_TN, scale_1, base_N, check_eps("pre_eps", pre_eps))
    return _PreApply.apply(x_TND, w_TN)


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
