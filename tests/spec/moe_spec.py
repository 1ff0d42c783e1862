"""The MoE layer written out from its math, independently of ``ep_runtime``: plain loops over tokens
and experts in float64, differentiable through torch's own autograd.

For each token ``x`` (``D`` wide) of a layer with ``E`` routed experts, ``K`` routes per token:

    logit_e  = sum_d W[e, d] x_d                                    (router weight W [E, D])
    s_e      = softmax_e(logit) | sigmoid(logit_e) | sqrt(softplus(logit_e))
    select_e = s_e + bias_e                                         (bias: selection only)
    groups   = E / G contiguous groups; a group's score is the sum of its two best select_e (its
               best alone for groups of one); only the experts of the ``topk_groups`` best groups
               may be chosen; the K best of those are chosen (ties: the lower index wins)
    w_k      = s_{e_k}, divided by sum_k s_{e_k} when normalizing, times the routed scaling factor
    out      = sum_k w_k * expert_{e_k}(x) + shared(x)
    mlp(x)   = (silu(x @ gate) * (x @ up)) @ down                   (every expert and the shared one)

With FP8 dispatch an expert sees its token cast to e4m3 and back, per token and 128 columns
(DeepSeek's convention, in float32: ``sf = max(amax, 1e-4) / 448``, ``q = e4m3(x * (448 /
max(amax, 1e-4)))``, seen as ``q * sf``); with FP4 dispatch, cast to e2m1 under two levels of
scales per token (``gsf = max(amax_token, 1e-4) / (448 * 6)``, per 16 columns ``sf = e4m3(max(amax /
amax_token * 448, 2^-9))``, each value the nearest e2m1 magnitude of ``x / (sf * gsf)``, ties to the
even code, saturating at 6, seen as that magnitude times ``sf * gsf``). The backward passes the
gradient straight through either cast.

Weights are given as ``MoEParams`` (float64 leaves the caller may differentiate); ``params_of``
reads them off an ``ep_runtime.moe.MoELayer`` by the layout its docstrings state (an expert's
``w13`` is ``[gate | up]``, ``[D, 2I]``; ``nn.Linear`` weights are ``[out, in]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64
E4M3_MAX = 448.0
FP8_GROUP = 128
FP4_GROUP = 16
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7


@dataclass(frozen=True)
class Mlp:
    """One SwiGLU MLP: ``gate``/``up`` ``[D, I]``, ``down`` ``[I, D]``."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __call__(self, x_D: torch.Tensor) -> torch.Tensor:
        a = x_D @ self.gate
        return (a / (1 + torch.exp(-a)) * (x_D @ self.up)) @ self.down


@dataclass(frozen=True)
class RouterSpec:
    scoring: str = "sigmoid"
    topk: int = 2
    num_groups: int = 1
    topk_groups: int | None = None
    normalize: bool = True
    scaling: float = 1.0

    @classmethod
    def of(cls, cfg) -> RouterSpec:
        """From an ``ep_runtime.config.RouterConfig`` (its fields, by name)."""
        return cls(scoring=cfg.scoring, topk=cfg.topk, num_groups=cfg.num_groups, topk_groups=cfg.topk_groups,
                   normalize=cfg.normalize, scaling=cfg.routed_scaling_factor)


@dataclass(frozen=True)
class MoEParams:
    router: torch.Tensor  # [E, D]
    bias: torch.Tensor  # [E], selection only
    experts: tuple[Mlp, ...]  # by logical expert id
    shared: Mlp | None

    def leaves(self) -> dict[str, torch.Tensor]:
        """Every differentiable tensor by a name: ``router``, ``expert<e>.<gate|up|down>``,
        ``shared.<gate|up|down>``."""
        out = {"router": self.router}
        for e, mlp in enumerate(self.experts):
            out |= {f"expert{e}.{k}": getattr(mlp, k) for k in ("gate", "up", "down")}
        if self.shared is not None:
            out |= {f"shared.{k}": getattr(self.shared, k) for k in ("gate", "up", "down")}
        return out


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", F64).clone().requires_grad_()


def split_w13(w13_D2I: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inter = w13_D2I.shape[1] // 2
    return w13_D2I[:, :inter], w13_D2I[:, inter:]


def mlp_from_linears(w13_2ID: torch.Tensor, w2_DI: torch.Tensor) -> Mlp:
    """An MLP from ``nn.Linear`` weights: ``w13`` ``[2I, D]`` (gate rows first), ``w2`` ``[D, I]``."""
    gate, up = split_w13(_leaf(w13_2ID).T)
    return _mlp(gate, up, _leaf(w2_DI).T)


def _mlp(gate, up, down) -> Mlp:
    # leaves of their own (views of one leaf would share a gradient)
    return Mlp(_leaf(gate), _leaf(up), _leaf(down))


def params_of(layer, all_w13_EDI2: torch.Tensor | None = None, all_w2_EID: torch.Tensor | None = None) -> MoEParams:
    """Float64 leaves on the CPU of an ``MoELayer``'s weights (wherever the layer lives).
    ``all_w13_EDI2``/``all_w2_EID``: every logical expert's weights (an EP run gathers them);
    default the layer's own, slot ``e`` = expert ``e``."""
    w13 = layer.experts.w13_EDI2 if all_w13_EDI2 is None else all_w13_EDI2
    w2 = layer.experts.w2_EID if all_w2_EID is None else all_w2_EID
    experts = tuple(_mlp(*split_w13(w13[e].detach()), w2[e].detach()) for e in range(w13.shape[0]))
    shared = None if layer.shared is None else mlp_from_linears(layer.shared.w13.weight, layer.shared.w2.weight)
    return MoEParams(router=_leaf(layer.router.weight), bias=layer.router.bias_E.detach().to("cpu", F64).clone(),
                     experts=experts, shared=shared)


def initial_expert_weights(seed: int, expert: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``GroupedExperts`` documents: expert ``e``'s own generator seeded ``seed * 1_000_003 + e``
    draws ``w13`` ``[D, 2I]`` ~ N(0, 1/D), then ``w2`` ``[I, D]`` ~ N(0, 1/I)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + expert)
    w13 = torch.empty(hidden, 2 * inter).normal_(0.0, hidden**-0.5, generator=g)
    w2 = torch.empty(inter, hidden).normal_(0.0, inter**-0.5, generator=g)
    return w13, w2


def score(logits_E: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        z = torch.exp(logits_E - logits_E.max().detach())
        return z / z.sum()
    if scoring == "sigmoid":
        return 1 / (1 + torch.exp(-logits_E))
    if scoring == "sqrtsoftplus":
        return torch.sqrt(torch.log1p(torch.exp(logits_E)))
    raise ValueError(scoring)


def _best(values: list[float], candidates: list[int], k: int) -> list[int]:
    """The k best candidates by value, ties to the lower index."""
    return sorted(candidates, key=lambda i: (-values[i], i))[:k]


def choose(select_E: list[float], r: RouterSpec) -> list[int]:
    """The chosen experts, best first."""
    num_experts = len(select_E)
    size = num_experts // r.num_groups
    keep = r.topk_groups or r.num_groups
    allowed = list(range(num_experts))
    if keep < r.num_groups:
        group_score = []
        for g in range(r.num_groups):
            members = sorted((select_E[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_score.append(sum(members[:2]))
        kept = _best(group_score, list(range(r.num_groups)), keep)
        allowed = [e for e in allowed if e // size in kept]
    return _best(select_E, allowed, r.topk)


def route(x_D: torch.Tensor, p: MoEParams, r: RouterSpec) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(chosen experts, their weights [K], the token's scores [E]) of one token."""
    num_experts = p.router.shape[0]
    logits = torch.stack([(p.router[e] * x_D).sum() for e in range(num_experts)])
    s = score(logits, r.scoring)
    select = [float(s[e].detach()) + float(p.bias[e]) for e in range(num_experts)]
    chosen = choose(select, r)
    w = torch.stack([s[e] for e in chosen])
    if r.normalize:
        w = w / w.sum()
    return chosen, w * r.scaling, s


def fp8_roundtrip(x_D: torch.Tensor) -> torch.Tensor:
    """The token as an expert sees it after FP8 dispatch; the gradient passes straight through."""
    x32 = x_D.detach().float()
    parts = []
    for start in range(0, x32.shape[0], FP8_GROUP):
        g = x32[start:start + FP8_GROUP]
        amax = torch.clamp(g.abs().max(), min=1e-4)
        q = (g * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
        parts.append(q.float() * (amax / E4M3_MAX))
    return x_D + (torch.cat(parts).to(F64) - x_D.detach())


def fp4_roundtrip(x_D: torch.Tensor) -> torch.Tensor:
    """The token as an expert sees it after FP4 dispatch; the gradient passes straight through."""
    x32 = x_D.detach().float()
    row = torch.clamp(x32.abs().max(), min=1e-4)
    gsf = row / torch.tensor(448.0 * 6)
    grid = torch.tensor(E2M1_MAGNITUDES)
    even = torch.arange(len(E2M1_MAGNITUDES)) % 2 == 0
    parts = []
    for start in range(0, x32.shape[0], FP4_GROUP):
        g = x32[start:start + FP4_GROUP]
        sf = torch.clamp(g.abs().max() / row * 448.0, min=2.0**-9).to(torch.float8_e4m3fn).float()
        v = g * (1.0 / (sf * gsf))
        dist = (v.abs().clamp(max=6.0)[:, None] - grid).abs()
        nearest = dist == dist.min(dim=1, keepdim=True).values
        pick = torch.where((nearest & even).any(1), (nearest & even).float().argmax(1), nearest.float().argmax(1))
        parts.append(torch.where(v < 0, -grid[pick], grid[pick]) * (sf * gsf))
    return x_D + (torch.cat(parts).to(F64) - x_D.detach())


ROUNDTRIPS = {"bf16": lambda x_D: x_D, "e4m3": fp8_roundtrip, "e2m1": fp4_roundtrip}  # by dispatch format


def moe_layer(x_TD: torch.Tensor, p: MoEParams, r: RouterSpec, *, wire: str = "bf16",
              masked=None) -> tuple[torch.Tensor, list[list[int]]]:
    """``out_TD`` (float64) and each token's routes (-1 where masked); ``wire``: the dispatch
    format the routed experts see their tokens in (``bf16``: as they are).

    ``masked(x_D) -> set of route positions k`` drops routes after the weights are computed
    (weight 0, no expert), as a caller masking the router's picks does."""
    outs, routes = [], []
    for t in range(x_TD.shape[0]):
        x = x_TD[t].to(F64)
        chosen, w, _ = route(x, p, r)
        drop = masked(x) if masked is not None else set()
        x_in = ROUNDTRIPS[wire](x)
        y = torch.zeros_like(x)
        for k, e in enumerate(chosen):
            if k not in drop:
                y = y + w[k] * p.experts[e](x_in)
        if p.shared is not None:
            y = y + p.shared(x)
        outs.append(y)
        routes.append([-1 if k in drop else e for k, e in enumerate(chosen)])
    if not outs:
        return x_TD.new_zeros(x_TD.shape, dtype=F64), routes
    return torch.stack(outs), routes


def balance_loss(x_BSD: torch.Tensor, p: MoEParams, r: RouterSpec, coef: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: ``coef * mean_b sum_e f_e P_e`` with
    ``f_e = E / (K S) * (routes of the sequence to e)`` and ``P_e`` the mean over the sequence of
    ``s_e / sum_e' s_e'``."""
    num_experts = p.router.shape[0]
    total = 0.0
    for b in range(x_BSD.shape[0]):
        seq = x_BSD.shape[1]
        counts = [0] * num_experts
        prob = torch.zeros(num_experts, dtype=F64)
        for s in range(seq):
            chosen, _, scores = route(x_BSD[b, s].to(F64), p, r)
            for e in chosen:
                counts[e] += 1
            prob = prob + scores / scores.sum()
        f = torch.tensor(counts, dtype=F64) * (num_experts / (r.topk * seq))
        total = total + (f * prob / seq).sum()
    return coef * total / x_BSD.shape[0]


def scaled_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want|`` over the element's own size plus the tensor's RMS:
    ``max |got - want| / (|want| + rms(want))``. An error of a few float32 roundings of the
    tensor's typical element reads ~1e-6; zeroing or flipping any element of at least RMS size
    reads >= 0.5."""
    got, want = got.detach().to(F64), want.detach().to(F64)
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not want.numel():
        return 0.0
    rms = float(want.square().mean().sqrt())
    if rms == 0.0:
        return float((got - want).abs().max()) and math.inf
    return float(((got - want).abs() / (want.abs() + rms)).max())


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = scaled_error(got, want)
    assert err <= tol, f"{name}: scaled error {err:.3g} > {tol}"
