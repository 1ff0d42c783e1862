"""The tiny DeepSeek-style model written out from its math, independently of ``ep_runtime``:
float64, per token where the math is per token, differentiable through torch's own autograd.

Weights come as a dict of float64 leaves named as the model's ``named_parameters`` (plus the
routers' ``bias_E`` buffers); :func:`leaves_of` makes it. Per block, with the residual ``x``
(``[B, S, D]``, or ``N`` streams ``[B, S, N, D]`` with mHC):

    Engram (its layers):  idx_c  = (XOR_{k<n} id[s-k] * mult_k) mod size_c + offset_c   (column c:
                                   order n = 2 + c // heads; ids before the sequence start are 0)
                          e      = the rows table[idx_c] side by side;  k_h = (K e)_h;  v = V e
                          dot_h  = sum_d x_hd q_hd k_hd w_hd rstd(x_h) rstd(k_h) / sqrt(D)
                          g_h    = sigmoid(sign(dot_h) sqrt(max(|dot_h|, 1e-6))) v
                          x_h   += g_h + silu(causal dilated depthwise conv of rmsnorm(g_h))
    attention, FFN:       x += F(rmsnorm(x)), or with mHC per token (flat = x as N*D):
                          m = (fn flat) / sqrt(mean(flat^2) + eps);  a = m * scales + base
                          pre = sigmoid(a[:N]) + eps;  post = 2 sigmoid(a[N:2N]);
                          comb = sinkhorn(a[2N:] as N x N);  y = sum_i pre_i x_i
                          x'_j = post_j F(y) + sum_i comb[i, j] x_i
    head:                 mHC: y = sum_i w_i x_i, w = sigmoid(m_head * scale + base) + eps;
                          logits = rmsnorm(y) W_head^T

Attention is causal softmax attention with ``H`` heads of ``D / H`` (``qkv`` rows: q, k, v, each
head-major), scaled by ``1/sqrt(D / H)``; the MoE is ``moe_spec.moe_layer``; a dense FFN is one
SwiGLU MLP. RMS norms: ``x / sqrt(mean(x^2) + eps) * w`` with float32's epsilon for the model's
norms (what ``nn.RMSNorm`` uses by default), 1e-5 for the Engram conv's.
"""

from __future__ import annotations

import math

import torch
from moe_spec import F64, MoEParams, Mlp, RouterSpec, moe_layer

NORM_EPS = torch.finfo(torch.float32).eps
CONV_NORM_EPS = 1e-5
GATE_EPS, GATE_CLAMP = 1e-6, 1e-6
CONV_TAPS = 4


def leaves_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Float64 leaves of every parameter, and the routers' bias buffers (constants)."""
    out = {name: p.detach().to(F64).clone().requires_grad_() for name, p in model.named_parameters()}
    out |= {name: b.detach().to(F64).clone() for name, b in model.named_buffers() if name.endswith("bias_E")}
    return out


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w


def sigmoid(a: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-a))


def silu(a: torch.Tensor) -> torch.Tensor:
    return a * sigmoid(a)


def swiglu(x: torch.Tensor, w13_2ID: torch.Tensor, w2_DI: torch.Tensor) -> torch.Tensor:
    inter = w13_2ID.shape[0] // 2
    return Mlp(w13_2ID[:inter].T, w13_2ID[inter:].T, w2_DI.T)(x)


def attention(x_BSD: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, d = x_BSD.shape
    dh = d // heads
    rows = []
    for bi in range(b):
        qkv_S3HE = (x_BSD[bi] @ qkv.T).view(s, 3, heads, dh)
        per_head = []
        for h in range(heads):
            q, k, v = qkv_S3HE[:, 0, h], qkv_S3HE[:, 1, h], qkv_S3HE[:, 2, h]
            outs = []
            for i in range(s):
                logits = (k[: i + 1] @ q[i]) / math.sqrt(dh)
                p = torch.exp(logits - logits.max().detach())
                outs.append((p / p.sum()) @ v[: i + 1])
            per_head.append(torch.stack(outs))
        rows.append(torch.cat(per_head, -1) @ out.T)
    return torch.stack(rows)


def sinkhorn(logits_NN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    z = torch.exp(logits_NN - logits_NN.max(-1, keepdim=True).values.detach())
    p = z / z.sum(-1, keepdim=True) + eps
    p = p / (p.sum(0, keepdim=True) + eps)
    for _ in range(iters - 1):
        p = p / (p.sum(1, keepdim=True) + eps)
        p = p / (p.sum(0, keepdim=True) + eps)
    return p


def hyper_connection(x_BSND, fn, scale, base, f, *, iters: int, eps: float):
    """``x'_j = post_j F(y) + sum_i comb[i, j] x_i`` with per-token coefficients (module doc)."""
    b, s, n, d = x_BSND.shape
    ys, coefficients = [], []
    for t in range(b * s):
        x_ND = x_BSND[t // s, t % s]
        flat = x_ND.reshape(-1)
        m = (fn @ flat) / torch.sqrt(flat.square().mean() + eps)
        a = torch.cat([m[:n] * scale[0], m[n:2 * n] * scale[1], m[2 * n:] * scale[2]]) + base
        pre = sigmoid(a[:n]) + eps
        post = 2 * sigmoid(a[n:2 * n])
        comb = sinkhorn(a[2 * n:].view(n, n), iters, eps)
        ys.append((pre[:, None] * x_ND).sum(0))
        coefficients.append((post, comb))
    f_TD = f(torch.stack(ys).view(b, s, d)).reshape(b * s, d)
    out = []
    for t, (post, comb) in enumerate(coefficients):
        x_ND = x_BSND[t // s, t % s]
        out.append(post[:, None] * f_TD[t] + comb.T @ x_ND)
    return torch.stack(out).view(b, s, n, d)


def ngram_indices(ids_BS: torch.Tensor, multipliers, table_sizes) -> list[list[list[int]]]:
    """``[B][S][C]`` rows of the concatenated table (see the module doc)."""
    sizes = [size for order in table_sizes for size in order]
    offsets = [sum(sizes[:c]) for c in range(len(sizes))]
    heads = len(table_sizes[0])
    out = []
    for seq in ids_BS.tolist():
        rows = []
        for s in range(len(seq)):
            h, cols = 0, []
            for k, mult in enumerate(multipliers):
                h ^= (seq[s - k] if s - k >= 0 else 0) * mult
                if k >= 1:
                    for head in range(heads):
                        c = (k - 1) * heads + head
                        cols.append(h % sizes[c] + offsets[c])
            rows.append(cols)
        out.append(rows)
    return out


def engram(x_BSND, ids_BS, P: dict, prefix: str, hash_cfg) -> torch.Tensor:
    b, s, n, d = x_BSND.shape
    table = P[prefix + "table.weight_LE"]
    idx = ngram_indices(ids_BS, hash_cfg.multipliers, hash_cfg.table_sizes)
    key, value = P[prefix + "key.weight"], P[prefix + "value.weight"]
    qn, kn = P[prefix + "query_norm_ND"], P[prefix + "key_norm_ND"]
    gated = torch.zeros(b, s, n, d, dtype=F64)
    rows = []
    for bi in range(b):
        for si in range(s):
            e = torch.cat([table[r] for r in idx[bi][si]])
            k_ND, v_D = (key @ e).view(n, d), value @ e
            x_ND = x_BSND[bi, si]
            g = []
            for h in range(n):
                rx = 1 / torch.sqrt(x_ND[h].square().mean() + GATE_EPS)
                rk = 1 / torch.sqrt(k_ND[h].square().mean() + GATE_EPS)
                dot = (x_ND[h] * qn[h] * k_ND[h] * kn[h]).sum() * rx * rk / math.sqrt(d)
                mag = torch.sqrt(dot.abs()) if float(dot.abs()) >= GATE_CLAMP else math.sqrt(GATE_CLAMP)
                g.append(sigmoid(torch.sign(dot.detach()) * mag) * v_D)
            rows.append(torch.stack(g))
    gated = torch.stack(rows).view(b, s, n, d)
    normed = rmsnorm(gated, P[prefix + "conv_norm_ND"], CONV_NORM_EPS)
    taps, dilation = P[prefix + "conv_NDW"], hash_cfg.max_ngram
    conv = []
    for si in range(s):
        acc = torch.zeros(b, n, d, dtype=F64)
        for w in range(CONV_TAPS):
            src = si - (CONV_TAPS - 1 - w) * dilation
            if src >= 0:
                acc = acc + taps[:, :, w] * normed[:, src]
        conv.append(silu(acc))
    return x_BSND + gated + torch.stack(conv, 1)


def moe_params(P: dict, prefix: str) -> MoEParams:
    w13, w2 = P[prefix + "experts.w13_EDI2"], P[prefix + "experts.w2_EID"]
    inter = w13.shape[2] // 2
    experts = tuple(Mlp(w13[e, :, :inter], w13[e, :, inter:], w2[e]) for e in range(w13.shape[0]))
    shared = None
    if prefix + "shared.w13.weight" in P:
        w13s = P[prefix + "shared.w13.weight"]
        half = w13s.shape[0] // 2
        shared = Mlp(w13s[:half].T, w13s[half:].T, P[prefix + "shared.w2.weight"].T)
    return MoEParams(router=P[prefix + "router.weight"], bias=P[prefix + "router.bias_E"], experts=experts,
                     shared=shared)


def block(x, tokens_BS, P: dict, cfg, layer: int, hash_cfg=None):
    """One block of ``cfg`` (an ``ep_runtime.config.ModelConfig``) on the residual ``x``."""
    pre = f"blocks.{layer}."

    def attn(y_BSD):
        return attention(rmsnorm(y_BSD, P[pre + "attn_norm.weight"]), P[pre + "attn.qkv.weight"],
                         P[pre + "attn.out.weight"], cfg.num_heads)

    def ffn(y_BSD):
        h = rmsnorm(y_BSD, P[pre + "ffn_norm.weight"])
        if layer < cfg.dense_layers:
            return swiglu(h, P[pre + "ffn.w13.weight"], P[pre + "ffn.w2.weight"])
        out, _ = moe_layer(h.reshape(-1, cfg.hidden), moe_params(P, pre + "ffn."), RouterSpec.of(cfg.moe.router))
        return out.view_as(h)

    if hash_cfg is not None:
        x = engram(x if cfg.mhc else x[:, :, None], tokens_BS, P, pre + "engram.", hash_cfg)
        x = x if cfg.mhc else x[:, :, 0]
    if cfg.mhc is None:
        x = x + attn(x)
        return x + ffn(x)
    for name, f in (("attn_hc.", attn), ("ffn_hc.", ffn)):
        x = hyper_connection(x, P[pre + name + "fn_MK"], P[pre + name + "scale_3"], P[pre + name + "base_M"], f,
                             iters=cfg.mhc.sinkhorn_iters, eps=cfg.mhc.eps)
    return x


def model_loss(tokens_BS: torch.Tensor, P: dict, cfg, hash_cfgs: dict) -> torch.Tensor:
    """Next-token cross-entropy of the model on ``tokens_BS`` (inputs all but the last position)."""
    inputs, targets = tokens_BS[:, :-1], tokens_BS[:, 1:]
    b, s = inputs.shape
    x = torch.stack([torch.stack([P["embed.weight"][int(inputs[bi, si])] + P["pos_embed.weight"][si]
                                  for si in range(s)]) for bi in range(b)])
    if cfg.mhc is not None:
        x = x[:, :, None].expand(b, s, cfg.mhc.n, cfg.hidden)
    for layer in range(cfg.num_layers):
        x = block(x, inputs, P, cfg, layer, hash_cfgs.get(layer))
    if cfg.mhc is not None:
        eps, mixed = cfg.mhc.eps, []
        for t in range(b * s):
            x_ND = x[t // s, t % s]
            flat = x_ND.reshape(-1)
            m = (P["mhc_head.fn_NK"] @ flat) / torch.sqrt(flat.square().mean() + eps)
            w = sigmoid(m * P["mhc_head.scale_1"][0] + P["mhc_head.base_N"]) + eps
            mixed.append((w[:, None] * x_ND).sum(0))
        x = torch.stack(mixed).view(b, s, cfg.hidden)
    logits = rmsnorm(x, P["norm.weight"]) @ P["head.weight"].T
    total = 0.0
    for bi in range(b):
        for si in range(s):
            z = logits[bi, si]
            top = z.max().detach()
            total = total + (torch.log(torch.exp(z - top).sum()) + top - z[int(targets[bi, si])])
    return total / (b * s)
