"""``bench kernels`` cases of ``kernels.mhc``: pre-apply, post, the fused pre, norm_fn and split +
Sinkhorn, forward and backward."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from .kernels_cases import Case, StreamInputs, backward_op, nbytes, reference_grads, tk_peer
from .kernels_check import normwise, within_largest

def _case_mhc_pre_apply(inp: StreamInputs, tk) -> Case:
    from kernels import mhc
    from kernels.mhc import reference

    x, pre = inp.x_TND, inp.pre_TN
    t, n, d = x.shape

    def tk_call(tk):
        o = x.new_empty(t, d)
        tk.mhc.mhc_pre_apply_mix_fwd(x, pre, o)
        return o

    return Case("mhc_pre_apply", lambda: mhc.pre_apply(x, pre), reference.pre_apply, (x, pre),
                bytes=nbytes(x, pre) + t * d * 2, bytes_note="read x [T,N,D] bf16 + pre [T,N] f32; write y [T,D] bf16",
                exact=False, peers=tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_post(inp: StreamInputs, tk) -> Case:
    from kernels import mhc
    from kernels.mhc import reference

    f, x, post, comb = inp.f_TD, inp.x_TND, inp.post_TN, inp.comb_TNN
    t, n, d = x.shape

    def tk_call(tk):  # its comb is indexed [output, input]: ours transposed
        return tk.mhc.mhc_post_fwd(f[None], x[None], post[None, :, :, None].contiguous(),
                                   comb.transpose(1, 2)[None].contiguous())

    return Case("mhc_post", lambda: mhc.post(f, x, post, comb), reference.post, (f, x, post, comb),
                bytes=nbytes(f, x, post, comb) + nbytes(x),
                bytes_note="read f [T,D] + x [T,N,D] bf16 + post, comb f32; write x' [T,N,D] bf16",
                exact=False, peers=tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_pre_fused(inp: StreamInputs, tk) -> Case:
    from kernels import mhc
    from kernels.mhc import reference

    x, fn, scale, base = inp.x_TND, inp.fn_MK, inp.scale_3, inp.base_M
    t, n, d = x.shape
    from kernels.mhc.pre_fused_kernel import within_tolerance

    return Case("mhc_pre_fused", lambda: mhc.pre_fused(x, fn, scale, base), reference.pre_fused, (x, fn, scale, base),
                bytes=nbytes(x, fn) + t * d * 2 + t * (n + n * n) * 4,
                bytes_note="read x [T,N,D] bf16 + fn [N(N+2),ND] f32; write y [T,D] bf16 + post, comb f32 "
                "(x is read twice, the second time mostly from L2)",
                exact=False, within=lambda got, want: within_tolerance(x, got, want))


def _case_mhc_pre_apply_backward(inp: StreamInputs, tk) -> Case:
    from kernels.mhc import reference
    from kernels.mhc.pre_apply_kernel import pre_apply_backward

    x, pre, g = inp.x_TND, inp.pre_TN, inp.g_TD
    t, n, d = x.shape
    x_grad = torch.zeros_like(x)  # tile-kernels adds into it

    def tk_call(tk):
        return x_grad, tk.mhc.mhc_pre_apply_mix_bwd(g, x, pre, x_grad)

    return Case("mhc_pre_apply_backward", backward_op(pre_apply_backward, reference.pre_apply, (x, pre, g)),
                reference_grads(reference.pre_apply),
                (x, pre, g), bytes=nbytes(x, pre, g, x, pre),
                bytes_note="read x [T,N,D] + g [T,D] bf16 + pre f32; write grad_x [T,N,D] bf16 + grad_pre f32 "
                "(tile-kernels adds into grad_x: reads it too)",
                exact=False, within=normwise, compile_peer=False, peers=tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_post_backward(inp: StreamInputs, tk) -> Case:
    from kernels.mhc import reference
    from kernels.mhc.post_kernel import post_backward

    f, x, post, comb, g = inp.f_TD, inp.x_TND, inp.post_TN, inp.comb_TNN, inp.g_TND
    comb_t = comb.transpose(1, 2)[None].contiguous()  # tile-kernels' [output, input]

    def tk_call(tk):
        return tk.mhc.mhc_post_bwd(f[None], x[None], post[None, :, :, None].contiguous(), comb_t, g[None])

    return Case("mhc_post_backward", backward_op(post_backward, reference.post, (f, x, post, comb, g)),
                reference_grads(reference.post),
                (f, x, post, comb, g), bytes=2 * nbytes(f, x, post, comb) + nbytes(g),
                bytes_note="read g, x [T,N,D] + f [T,D] bf16 + post, comb f32; write grad_x, grad_f, grad_post, "
                "grad_comb", exact=False, within=normwise, compile_peer=False,
                peers=tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_norm_fn(inp: StreamInputs, tk) -> Case:
    # No tile-kernels peer: its norm_fn entry points (mhc_fn_normw_merge_*,
    # mhc_reduce_partials_and_rmsnorm_*) fold a norm weight into fn and reduce a split-K GEMM's
    # partials into the normed mixes; the GEMM over the streams itself is DeepGEMM's, outside
    # tile-kernels, so it has no kernel doing this op's work.
    from kernels import mhc
    from kernels.mhc import reference

    x, fn = inp.x_TND, inp.fn_MK
    t, m = x.shape[0], fn.shape[0]
    return Case("mhc_norm_fn", lambda: mhc.norm_fn(x, fn), reference.norm_fn, (x, fn),
                bytes=nbytes(x, fn) + t * (m + 1) * 4,
                bytes_note="read x [T,N,D] bf16 + fn [N(N+2),ND] f32; write mixes [T,N(N+2)] + rstd [T] f32 "
                "(rstd: what its backward takes)", exact=False, within=normwise)


def _case_mhc_norm_fn_backward(inp: StreamInputs, tk) -> Case:
    from kernels.mhc import norm_fn_kernel, reference

    x, fn, g = inp.x_TND, inp.fn_MK, inp.g_TM
    t, m = g.shape
    forward = functools.cache(lambda: norm_fn_kernel.norm_fn(x, fn, eps=1e-6, tf32=False))  # mixes, rstd: saved

    def ours(x_TND, fn_MK, g_TM):  # kernels.mhc.norm_fn's backward: grad_x by the kernel, grad_fn by torch
        return norm_fn_kernel.norm_fn_backward(x_TND, fn_MK, *forward(), g_TM, False)

    return Case("mhc_norm_fn_backward", backward_op(ours, reference.norm_fn, (x, fn, g)),
                reference_grads(reference.norm_fn), (x, fn, g),
                bytes=2 * nbytes(x, fn) + nbytes(g) + t * (m + 1) * 4,
                bytes_note="read x [T,N,D] bf16 + fn f32 + g, mixes [T,N(N+2)] + rstd [T] f32; write grad_x [T,N,D] "
                "bf16 + grad_fn [N(N+2),ND] f32 (ours reads x again, as a float32 copy, for grad_fn's GEMM)",
                exact=False, within=normwise, compile_peer=False)


SPLIT_OPTIONS = dict(pre_eps=1e-6, post_mult=2.0, sinkhorn_eps=1e-6, iters=20)  # kernels.mhc.split_sinkhorn's defaults


def _split_sinkhorn(mixes_TM, scale_3, base_M):
    from kernels.mhc import reference

    return reference.split_sinkhorn(mixes_TM, scale_3, base_M, **SPLIT_OPTIONS)


def _tk_split_mixes(tk, mixes_TM: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor):
    """tile-kernels' ``mhc_pre_split_mixes_fwd``: ``(pre [T,N], post [T,N], comb logits [T,N,N])``, float32.
    Its definition is ours: ``pre = sigmoid(a) + pre_eps``, ``post = mult * sigmoid(a)`` (our
    ``post_mult``), the logits ``a[2N:]`` row-major ([T, N*N] there; its Sinkhorn takes [T, N, N])."""
    t, m = mixes_TM.shape
    n = math.isqrt(m + 1) - 1
    pre_TN, post_TN, logits_TNN = mixes_TM.new_empty(t, n), mixes_TM.new_empty(t, n), mixes_TM.new_empty(t, n, n)
    tk.mhc.mhc_pre_split_mixes_fwd(mixes_TM, scale_3, base_M, pre_TN, post_TN, logits_TNN.view(t, n * n),
                                   SPLIT_OPTIONS["post_mult"], SPLIT_OPTIONS["pre_eps"])
    return pre_TN, post_TN, logits_TNN


def _case_mhc_split_sinkhorn(inp: StreamInputs, tk) -> Case:
    # tile-kernels' peer: its split, then its Sinkhorn (repeat = our iters): the same definition
    # (softmax over each row + eps, a column normalization, then iters - 1 row/column pairs, each
    # / (sum + eps)), so the same comb entry for entry. (Its post reads comb as [output, input],
    # ours as [input, output]: a convention of the model, not of this op.)
    from kernels import mhc

    mixes, scale, base = inp.mixes_TM, inp.scale_3, inp.base_M
    t, n = mixes.shape[0], inp.shape.streams

    def tk_call(tk):
        pre_TN, post_TN, logits_TNN = _tk_split_mixes(tk, mixes, scale, base)
        comb_TNN = torch.empty_like(logits_TNN)
        tk.mhc.mhc_sinkhorn_fwd(logits_TNN, comb_TNN, SPLIT_OPTIONS["iters"], SPLIT_OPTIONS["sinkhorn_eps"])
        return pre_TN, post_TN, comb_TNN

    return Case("mhc_split_sinkhorn", lambda: mhc.split_sinkhorn(mixes, scale, base, **SPLIT_OPTIONS), _split_sinkhorn,
                (mixes, scale, base), bytes=nbytes(mixes, scale, base) + t * (2 * n + n * n) * 4,
                bytes_note="read mixes [T,N(N+2)] + scale, base f32; write pre, post [T,N] + comb [T,N,N] f32 "
                "(tile-kernels also writes the comb logits [T,N,N] and reads them back)",
                exact=False, within=within_largest(1e-5), peers=tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_split_sinkhorn_backward(inp: StreamInputs, tk) -> Case:
    from kernels.mhc.split_sinkhorn_kernel import split_sinkhorn_backward

    mixes, scale, base = inp.mixes_TM, inp.scale_3, inp.base_M
    grads_out = (inp.g_pre_TN, inp.g_post_TN, inp.g_comb_TNN)
    t, n = mixes.shape[0], inp.shape.streams
    options = {key: SPLIT_OPTIONS[key] for key in ("post_mult", "sinkhorn_eps", "iters")}

    def ours(mixes_TM, scale_3, base_M, *g):  # kernels.mhc.split_sinkhorn's backward: the kernel, then sum(0)
        return split_sinkhorn_backward(mixes_TM, scale_3, base_M, *g, **options)

    # tile-kernels' backward takes its forward's post and comb logits (which ours recomputes from the
    # mixes): its forward runs at the first call. Then its Sinkhorn backward (to the logits), then
    # the split's backward (to the mixes, scale and base; sigmoid' of post from post itself).
    saved = functools.cache(lambda: _tk_split_mixes(tk, mixes, scale, base)[1:])

    def tk_call(tk):
        post_TN, logits_TNN = saved()
        g_logits_TNN = torch.empty_like(logits_TNN)
        tk.mhc.mhc_sinkhorn_bwd(grads_out[2], logits_TNN, g_logits_TNN, options["iters"], options["sinkhorn_eps"])
        grads = torch.empty_like(mixes), torch.empty_like(scale), torch.empty_like(base)
        tk.mhc.mhc_pre_split_mixes_bwd(*grads_out[:2], g_logits_TNN.view(t, n * n), mixes, post_TN, scale, base,
                                       *grads, options["post_mult"])
        return grads

    args = (mixes, scale, base, *grads_out)
    return Case("mhc_split_sinkhorn_backward", backward_op(ours, _split_sinkhorn, args, outputs=3),
                reference_grads(_split_sinkhorn, outputs=3), args,
                bytes=2 * nbytes(mixes, scale, base) + nbytes(*grads_out),
                bytes_note="read mixes [T,N(N+2)] + scale, base + the gradients of pre, post [T,N] and comb "
                "[T,N,N] f32; write grad_mixes, grad_scale, grad_base (ours recomputes the forward from the mixes; "
                "tile-kernels reads its forward's post and logits, and writes and reads back the logits' gradient)",
                exact=False, within=within_largest(1e-4), compile_peer=False,
                peers=tk_peer(tk, "tile_kernels", tk_call))


CASES: dict[str, Callable[..., Case]] = {
    "mhc_pre_apply": _case_mhc_pre_apply,
    "mhc_post": _case_mhc_post,
    "mhc_pre_fused": _case_mhc_pre_fused,
    "mhc_pre_apply_backward": _case_mhc_pre_apply_backward,
    "mhc_post_backward": _case_mhc_post_backward,
    "mhc_norm_fn": _case_mhc_norm_fn,
    "mhc_norm_fn_backward": _case_mhc_norm_fn_backward,
    "mhc_split_sinkhorn": _case_mhc_split_sinkhorn,
    "mhc_split_sinkhorn_backward": _case_mhc_split_sinkhorn_backward,
}
