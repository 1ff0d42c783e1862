"""The mHC operations' math, which :mod:`kernels.mhc.reference` (the specification: each op with
its shapes and dtypes) is built on: the forward functions, shared with ``pre_fused`` so that both
compute the same bits, and the autograd Functions, whose backwards are the explicit gradients the
backward kernels implement. Shape letters as in :mod:`kernels.mhc.reference`.
"""

from __future__ import annotations

import math

import torch

from kernels.validate import check_tensor



def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def flatten(x_TND: torch.Tensor) -> torch.Tensor:
    t, n, d = x_TND.shape
    return x_TND.reshape(t, n * d)


def norm_fn_fwd(flat_TK: torch.Tensor, fn_MK: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd_T = torch.rsqrt(flat_TK.square().mean(-1) + eps)
    mixes_TM = (flat_TK @ fn_MK.T) * rstd_T[:, None]
    return mixes_TM, rstd_T


def mix_scale(scale_3: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([scale_3[0].expand(n), scale_3[1].expand(n), scale_3[2].expand(n * n)])


def split_fwd(
    mixes_TM: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor, n: int, pre_eps: float, post_mult: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a_TM = mixes_TM * mix_scale(scale_3, n) + base_M
    pre_TN = torch.sigmoid(a_TM[:, :n]) + pre_eps
    post_TN = post_mult * torch.sigmoid(a_TM[:, n : 2 * n])
    logits_TNN = a_TM[:, 2 * n :].reshape(-1, n, n)
    return pre_TN, post_TN, logits_TNN


def sinkhorn_fwd(logits_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    p_TNN = torch.softmax(logits_TNN, dim=-1) + eps
    p_TNN = p_TNN / (p_TNN.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        p_TNN = p_TNN / (p_TNN.sum(-1, keepdim=True) + eps)
        p_TNN = p_TNN / (p_TNN.sum(-2, keepdim=True) + eps)
    return p_TNN


def sinkhorn_bwd(logits_TNN: torch.Tensor, grad_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Gradient of :func:`sinkhorn_fwd` w.r.t. the logits, recomputing the forward from them.

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


def pre_apply_fwd(x_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
    cdt = compute_dtype(x_TND, pre_TN)
    return (pre_TN.to(cdt)[:, :, None] * x_TND.to(cdt)).sum(1).to(x_TND.dtype)


def post_fwd(f_TD: torch.Tensor, x_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> torch.Tensor:
    cdt = compute_dtype(f_TD, x_TND, post_TN, comb_TNN)
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


class NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TND, fn_MK, eps, tf32):
        cdt = compute_dtype(x_TND, fn_MK)
        flat_TK = flatten(x_TND).to(cdt)
        w_MK = (round_to_tf32(fn_MK.float()) if tf32 else fn_MK).to(cdt)
        mixes_TM, rstd_T = norm_fn_fwd(flat_TK, w_MK, eps)
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
    flat_TK = flatten(x_TND).to(cdt)
    w_MK = (round_to_tf32(fn_MK.float()) if tf32 else fn_MK).to(cdt)
    gproj_TM, coef_T = norm_fn_backward_terms(g_TM.to(cdt), mixes_TM, rstd_T, flat_TK.shape[1])
    grad_flat_TK = gproj_TM @ w_MK - coef_T[:, None] * flat_TK
    grad_fn_MK = gproj_TM.T @ flat_TK
    return grad_flat_TK.view_as(x_TND).to(x_TND.dtype), grad_fn_MK.to(fn_MK.dtype)


class Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TNN, iters, eps):
        ctx.save_for_backward(logits_TNN)  # only the logits: backward recomputes the iterations
        ctx.iters, ctx.eps = iters, eps
        return sinkhorn_fwd(logits_TNN, iters, eps)

    @staticmethod
    def backward(ctx, g_TNN):
        (logits_TNN,) = ctx.saved_tensors
        return sinkhorn_bwd(logits_TNN, g_TNN.to(logits_TNN.dtype), ctx.iters, ctx.eps), None, None


class SplitSinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixes_TM, scale_3, base_M, n, pre_eps, post_mult, sinkhorn_eps, iters):
        cdt = compute_dtype(mixes_TM, scale_3, base_M)
        pre_TN, post_TN, logits_TNN = split_fwd(
            mixes_TM.to(cdt), scale_3.to(cdt), base_M.to(cdt), n, pre_eps, post_mult
        )
        comb_TNN = sinkhorn_fwd(logits_TNN, iters, sinkhorn_eps)
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
        cdt = compute_dtype(mixes_TM, scale_3, base_M)
        m_TM = mixes_TM.to(cdt)
        scale_M = mix_scale(scale_3.to(cdt), n)
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
                sinkhorn_bwd(a_TM[:, 2 * n :].reshape(t, n, n), g_comb_TNN, ctx.iters, ctx.sinkhorn_eps).reshape(
                    t, n * n
                ),
            ],
            dim=1,
        )
        return (*split_sinkhorn_grads(da_TM, mixes_TM, scale_3, base_M), None, None, None, None, None)


class PreApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TND, pre_TN):
        ctx.save_for_backward(x_TND, pre_TN)
        return pre_apply_fwd(x_TND, pre_TN)

    @staticmethod
    def backward(ctx, g_TD):
        # y = sum_i pre_i x_i:  d x_i = pre_i * g;  d pre_i = sum_d g * x_i.
        x_TND, pre_TN = ctx.saved_tensors
        cdt = compute_dtype(x_TND, pre_TN)
        g_TD = g_TD.to(cdt)
        grad_x_TND = pre_TN.to(cdt)[:, :, None] * g_TD[:, None, :]
        grad_pre_TN = (x_TND.to(cdt) * g_TD[:, None, :]).sum(-1)
        return grad_x_TND.to(x_TND.dtype), grad_pre_TN.to(pre_TN.dtype)


class Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f_TD, x_TND, post_TN, comb_TNN):
        ctx.save_for_backward(f_TD, x_TND, post_TN, comb_TNN)
        return post_fwd(f_TD, x_TND, post_TN, comb_TNN)

    @staticmethod
    def backward(ctx, g_TND):
        # x'_j = post_j f + sum_i comb[i, j] x_i:
        #   d f = sum_j post_j g_j;  d post_j = sum_d g_j f;  d x_i = sum_j comb[i, j] g_j;
        #   d comb[i, j] = sum_d x_i g_j.
        f_TD, x_TND, post_TN, comb_TNN = ctx.saved_tensors
        cdt = compute_dtype(f_TD, x_TND, post_TN, comb_TNN)
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


class HeadMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixes_TN, scale_1, base_N, pre_eps):
        ctx.save_for_backward(mixes_TN, scale_1, base_N)
        cdt = compute_dtype(mixes_TN, scale_1, base_N)
        return torch.sigmoid(mixes_TN.to(cdt) * scale_1.to(cdt) + base_N.to(cdt)) + pre_eps

    @staticmethod
    def backward(ctx, g_TN):
        # w = sigmoid(mixes * scale + base) + eps:  d a = g * s (1 - s);  d mixes = d a * scale;
        # d scale = sum_T sum_N d a * mixes;  d base = sum_T d a.
        mixes_TN, scale_1, base_N = ctx.saved_tensors
        cdt = compute_dtype(mixes_TN, scale_1, base_N)
        m_TN = mixes_TN.to(cdt)
        s_TN = torch.sigmoid(m_TN * scale_1.to(cdt) + base_N.to(cdt))
        da_TN = g_TN.to(cdt) * s_TN * (1 - s_TN)
        return (
            (da_TN * scale_1.to(cdt)).to(mixes_TN.dtype),
            (da_TN * m_TN).sum().reshape(1).to(scale_1.dtype),
            da_TN.sum(0).to(base_N.dtype),
            None,
        )


class Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, n):
        return h_TD[:, None, :].expand(h_TD.shape[0], n, h_TD.shape[1]).contiguous()

    @staticmethod
    def backward(ctx, g_TND):
        # every stream is a copy of h: d h = sum_i g_i (accumulated in the compute dtype).
        return g_TND.to(compute_dtype(g_TND)).sum(1).to(g_TND.dtype), None



def n_from_mixes(m: int) -> int:
    n = math.isqrt(m + 1) - 1
    if n < 1 or n * (n + 2) != m:
        raise ValueError(
            f"mixes_TM: expected N*(N+2) columns for some N >= 1 (3, 8, 15, 24, ...), got {m}"
        )
    return n


def split_sinkhorn_grads(da_TM: torch.Tensor, mixes_TM: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor):
    """``(grad_mixes, grad_scale, grad_base)`` from ``da``, the gradient of ``a = mixes * scale_M +
    base`` (in the compute dtype), each in its input's dtype."""
    n = n_from_mixes(mixes_TM.shape[1])
    m_TM = mixes_TM.to(da_TM.dtype)
    dam_M = (da_TM * m_TM).sum(0)
    grad_scale_3 = torch.stack([dam_M[:n].sum(), dam_M[n : 2 * n].sum(), dam_M[2 * n :].sum()])
    return ((da_TM * mix_scale(scale_3.to(da_TM.dtype), n)).to(mixes_TM.dtype), grad_scale_3.to(scale_3.dtype),
            da_TM.sum(0).to(base_M.dtype))


