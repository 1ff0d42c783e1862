"""``ep-runtime bench kernels``: every routing / permute / quant / reduce / transpose op against its
peers, at DeepSeek-V3's shapes, and the mHC / Engram ops (``MHC_OPS``: norm_fn, split + Sinkhorn,
pre-apply, post, the fused pre, the Engram gate, and their backward; the Engram n-gram hash) at
DeepSeek-V4-like ones, in one run.

    ep-runtime bench kernels [--shapes large|small|all] [--ops a,b] [--iters N] [--skip-peers]
                             [--skip-compile] [--kernel-time] [--quick] [--device cuda|cpu] [--out PATH]

For each shape and op: the op's public function (``kernels.<family>.<op>``: the TileLang kernel on
Hopper, the reference elsewhere) is checked once against the reference on fresh inputs (a new seed
each run unless ``--seed``), then timed, then its peers on the same inputs: the reference in eager
PyTorch, ``torch.compile`` of the reference, and tile-kernels 2.1.0 where it has the op. A peer
that fails to import, compile or run is recorded as an error string.

Timing (CUDA): warm-up calls, then each timed call is preceded by a read of a 512 MiB buffer (L2 is
50 MiB on an H100: the op's inputs start in device memory; a read, not a write, so no dirty lines
are written back inside the timed region) and bracketed by CUDA events; the median over the runs
(up to ``--iters``, fewer for slow calls: about 0.3 s per measurement). Before each flush the GPU
spins for about a millisecond (``torch.cuda._sleep``), so the host has enqueued the events and the
call before the GPU reaches them: a host that falls behind (a stall of a few hundred microseconds
in the wrapper's Python) would otherwise show as device time (session 8 saw single entries 1.5-3x
slow in each full run without it). The copy ceiling
is a ``copy_`` of a 1 GiB buffer, timed the same way in the same run; GB/s everywhere counts bytes
read plus bytes written.

Bytes are the op's minimal traffic (each input byte read once, each output byte written once; for
gathers only the rows that are read), listed per op in ``bytes_note``; the same count divides every
implementation's time, so a peer that moves more bytes shows a lower GB/s.

Fused ops (router + counts, expand + per-token cast, SwiGLU + per-token cast, weighted reduce with
FP8 dequantization) are also timed as the unfused sequence of our own ops; the bar compares the
speedup with the ratio of bytes the fusion saves.

``--kernel-time`` adds each call's GPU work alone (CUPTI through ``torch.profiler``: its kernels,
memsets and copies summed, the L2 flushed before each call, the median of 50 calls) for ours, the
peers and the unfused sequences, and the ratio and fusion bars by that time beside the timer's.
At 128 tokens the timer's launch and events cost 3.5-4 us of a 6 us measurement (sessions 20-21,
``bench/scripts/launch_gap.py``), paid once per measurement whether the call launches one kernel
or two, which hides what a fusion saves; the GPU time leaves out the gap between an unfused
sequence's kernels, so it favours the sequence.

On the CPU (``--device cpu``) only the references run (the public ops pick them there), with host
timers and no peers; ``--quick`` there uses a tiny shape: a smoke test of the program.

Shape suffixes: T tokens, E experts, K routes per token, D hidden, I SwiGLU intermediate, P layout
rows, G scale groups, B batch (the Engram hash: sequences), N mHC streams, M mHC mixes, S positions in
a sequence, C Engram hash columns, V token ids before compression, W an n-gram window (the largest
order).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .ep_scaling import HEAD_START_CYCLES

E4M3 = torch.float8_e4m3fn
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark configuration (DeepSeek-V3's MoE layer by default)."""

    tokens: int
    hidden: int = 7168
    experts: int = 256
    groups: int = 8
    topk_groups: int = 4
    topk: int = 8
    alignment: int = 128
    intermediate: int = 2048  # SwiGLU output width per expert (moe_intermediate_size)
    transpose_batch: int = 8  # batched_transpose input: [B, T / B, D]
    routed_scaling_factor: float = 2.5
    streams: int = 4  # mHC residual streams (the mHC and Engram ops)
    sequences: int = 2  # the Engram hash's ids: B sequences of T / B tokens


SHAPES = {
    "large": Shape(tokens=16384),
    "small": Shape(tokens=128),
    # DeepSeek-V4-like mHC sublayers: 8192 tokens, 4 streams, hidden 4096 or 7168.
    "v4-d4096": Shape(tokens=8192, hidden=4096),
    "v4-d7168": Shape(tokens=8192, hidden=7168),
    "tiny": Shape(tokens=64, hidden=256, experts=16, groups=4, topk_groups=2, topk=4, alignment=8, intermediate=128),
}
# at the v4 shapes (and tiny); the rest at large/small
MHC_OPS = ("mhc_pre_apply", "mhc_post", "mhc_pre_fused", "engram_gate", "mhc_pre_apply_backward", "mhc_post_backward",
           "engram_gate_backward", "mhc_norm_fn", "mhc_norm_fn_backward", "mhc_split_sinkhorn",
           "mhc_split_sinkhorn_backward", "engram_hash")

# Ops whose cost is moving bytes at these shapes (held to the copy-bandwidth bar); the routing ops
# touch a few MiB and are latency-bound.
MEMORY_BOUND = {
    "expand", "unexpand", "per_token_cast", "per_block_cast", "per_channel_cast", "cast_back", "swiglu",
    "swiglu_per_token_cast", "swiglu_backward", "weighted_reduce", "weighted_reduce_fp8", "batched_transpose",
    "expand_per_token_cast", "expand_cast_back", "mhc_pre_apply", "mhc_post", "engram_gate", "mhc_pre_apply_backward",
    "mhc_post_backward", "engram_gate_backward",
}
# Not in it: mhc_pre_fused, mhc_norm_fn and mhc_norm_fn_backward: their projection is 24 float32 FMAs
# per element of the streams (the FMA and shared-memory pipes, not memory; norm_fn measured 307 us
# at D = 4096 for ~270 MB, 29% of copy speed); mhc_split_sinkhorn and its backward: ~1.5 MB and 20
# Sinkhorn iterations a token (latency, as the routing ops); engram_hash: ~1.2 MB at T = 8192 (16
# int64 indices a token), 0.4 us at copy speed, less than a kernel launch (latency; its kernel is
# built to stream its output at copy speed, which only a larger T would show).

# The Engram hash at the v4 shapes: the configuration of DeepSeek's Engram demo (deepseek-ai/Engram,
# engram_demo_v1.py): DeepSeek-V3's tokenizer (129280 ids) compressed by normalization (23.4% fewer
# ids, the Engram paper's appendix C: ~99k), 2- and 3-grams with 8 heads each (C = 16 columns),
# every head's table the next unused prime from 5 * 129280 rows (~10.3M rows a layer), Engram
# layers 1 and 15 (we time layer 1), padding token 2 (mapped through the compression, as there).
ENGRAM_TOKEN_IDS = 129_280
ENGRAM_HASH = dict(layer_ids=(1, 15), vocab_size=98_990, max_ngram=3, num_heads=8, table_size=5 * ENGRAM_TOKEN_IDS)
ENGRAM_PAD_ID = 2


@dataclasses.dataclass
class Case:
    """One op at one shape: ours, its reference (eager and compiled), peers, bytes, check rule."""

    op: str
    ours: Callable[[], Any]
    reference: Callable[..., Any]  # called as reference(*args); torch.compile wraps it
    args: tuple
    bytes: int
    bytes_note: str
    exact: bool = True  # outputs must match bit for bit; else float closeness (see check)
    # the op's own closeness rule ((got, want) -> bool, its GPU test's), instead of check's rtol
    within: Callable[[Any, Any], bool] | None = None
    compile_peer: bool = True  # False for the backward ops: their reference calls autograd.grad
    peers: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    # peers doing only part of the op's work: timed and shown, left out of the "fastest peer" ratio
    partial_peers: tuple[str, ...] = ()
    unfused: Callable[[], Any] | None = None  # fused ops: the same work as a sequence of our ops
    unfused_bytes: int = 0
    unfused_note: str = ""


# ---------------------------------------------------------------------------------------------
# Inputs and cases


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Inputs:
    """Every op's inputs for one shape, built once on the device from the shared generators."""

    def __init__(self, shape: Shape, device: torch.device, seed: int):
        # Built with the references, so that each kernel's first call in the benchmark is its first
        # call in the process (its compile time is measured there).
        from kernels.permute import reference as permute
        from kernels.quant import reference as quant
        from kernels.routing import reference as routing
        from kernels.testing import cast_input, router_inputs, swiglu_input

        s = shape
        self.shape, self.device = s, device
        self.router_options = dict(
            topk=s.topk, scoring="sigmoid", num_groups=s.groups, topk_groups=s.topk_groups, normalize=True,
            routed_scaling_factor=s.routed_scaling_factor,
        )
        self.logits_TE, self.bias_E = router_inputs(s.tokens, s.experts, device=device, seed=seed)
        idx_TK, weights_TK = routing.topk_route(self.logits_TE, bias_E=self.bias_E, **self.router_options)
        # The reference returns a column slice of a sort; the ops take what a router returns: contiguous.
        self.topk_idx_TK, self.weights_TK = idx_TK.contiguous(), weights_TK.contiguous()
        self.layout = permute.expert_layout(self.topk_idx_TK, s.experts, alignment=s.alignment)
        self.capacity = permute.max_rows(s.tokens, s.topk, s.experts, s.alignment)
        self.x_TD = cast_input(s.tokens, s.hidden, device=device, seed=seed + 1)
        self.y_PD = permute.expand(self.x_TD, self.layout)  # stands in for the experts' outputs
        self.q_PD, self.sf_PG = quant.per_token_cast(self.y_PD)
        self.q_TD, self.sf_TG = quant.per_token_cast(self.x_TD)
        self.x_TI2, self.grad_TI = swiglu_input(s.tokens, s.intermediate, device=device, seed=seed + 2)
        self.routed = int((self.layout.pos_TK >= 0).sum())  # rows a gather by pos_TK reads


class StreamInputs:
    """The mHC and Engram ops' inputs for one shape: bf16 streams, float32 coefficients, int64 token ids."""

    def __init__(self, shape: Shape, device: torch.device, seed: int):
        from kernels.testing import engram_ids

        g = torch.Generator().manual_seed(seed)
        t, n, d = shape.tokens, shape.streams, shape.hidden
        self.shape, self.device = shape, device

        def randn(*size, scale=1.0, dtype=torch.bfloat16):
            return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

        self.x_TND, self.f_TD, self.v_TD = randn(t, n, d), randn(t, d), randn(t, d)
        self.g_TD, self.g_TND = randn(t, d), randn(t, n, d)  # output gradients of the backward ops
        self.k_TND = (randn(t, n, d, scale=0.1).float() + 0.3 * self.x_TND.float()).to(torch.bfloat16)
        self.pre_TN = torch.rand(t, n, generator=g).to(device) + 0.1
        self.post_TN = 2 * torch.rand(t, n, generator=g).to(device)
        self.comb_TNN = torch.softmax(torch.randn(t, n, n, generator=g), -1).to(device)
        self.wh_ND = (torch.rand(n, d, generator=g) + 0.5).to(device)
        self.we_ND = (torch.rand(n, d, generator=g) + 0.5).to(device)
        m = n * (n + 2)  # the mHC pre's parameters
        self.fn_MK = (torch.randn(m, n * d, generator=g) / (n * d) ** 0.5).to(device)
        self.scale_3 = (torch.rand(3, generator=g) + 0.5).to(device)
        self.base_M = (torch.randn(m, generator=g) * 0.5).to(device)
        # split + Sinkhorn's input: norm_fn's output has this spread (rms-normed streams, fn rows of norm ~1)
        self.mixes_TM = randn(t, m, dtype=torch.float32)
        self.g_TM = randn(t, m, dtype=torch.float32)  # norm_fn backward's output gradient
        self.g_pre_TN, self.g_post_TN = randn(t, n, dtype=torch.float32), randn(t, n, dtype=torch.float32)
        self.g_comb_TNN = randn(t, n, n, dtype=torch.float32)
        # the Engram hash's token ids (B sequences) and the tokenizer compression's map
        b = shape.sequences
        self.ids_BS, self.compress_V = engram_ids(b, t // b, ENGRAM_HASH["vocab_size"], num_ids=ENGRAM_TOKEN_IDS,
                                                  device=device, seed=seed + 1)


def build_cases(inp: Inputs | StreamInputs, names: list[str], with_peers: bool) -> list[Case]:
    """The cases for ``names`` that take ``inp`` (the mHC/Engram ops take ``StreamInputs``)."""
    streams = isinstance(inp, StreamInputs)
    tk = _tile_kernels() if with_peers else None
    return [builder(inp, tk) for name, builder in CASE_BUILDERS.items() if name in names and (name in MHC_OPS) == streams]


def _tile_kernels():
    """The tile-kernels module, or the import error as a string."""
    try:
        import tile_kernels

        return tile_kernels
    except Exception as error:  # any failure to import is reported, not raised
        return f"{type(error).__name__}: {error}"


def _tk_peer(tk, name: str, call: Callable[[Any], Any]) -> dict[str, Callable[[], Any]]:
    """``{"tile_kernels": thunk}``; the thunk raises the import error if tile-kernels is missing."""
    if tk is None:
        return {}
    if isinstance(tk, str):
        def failed():
            raise RuntimeError(f"tile_kernels unavailable: {tk}")

        return {name: failed}
    return {name: lambda: call(tk)}


def _case_topk_route(inp: Inputs, tk) -> Case:
    from kernels import routing
    from kernels.routing import reference

    s, opts = inp.shape, inp.router_options
    logits, bias = inp.logits_TE, inp.bias_E

    def ref(logits_TE, bias_E):
        return reference.topk_route(logits_TE, bias_E=bias_E, **opts)

    peers = {}
    scores_TE = (torch.sigmoid(logits) + bias).contiguous()  # topk_gate takes selection scores
    weights_TK = inp.weights_TK.contiguous()
    peers.update(_tk_peer(tk, "tile_kernels.topk_gate", lambda tk: tk.moe.topk_gate(scores_TE, s.topk)))
    peers.update(_tk_peer(tk, "tile_kernels.normalize_weight", lambda tk: tk.moe.normalize_weight(weights_TK)))
    return Case(
        "topk_route", lambda: routing.topk_route(logits, bias_E=bias, **opts), ref, (logits, bias),
        bytes=_nbytes(logits, bias) + s.tokens * s.topk * (8 + 4),
        bytes_note="read logits [T,E] f32 + bias; write idx [T,K] i64 + weights [T,K] f32",
        exact=False, peers=peers,
        # normalize_weight alone is a sliver of the router; topk_gate (plain top-k over ready
        # scores, no groups) is the issue's named comparison.
        partial_peers=("tile_kernels.normalize_weight",),
    )


def _case_topk_route_with_counts(inp: Inputs, tk) -> Case:
    from kernels import routing
    from kernels.routing import reference

    s, opts = inp.shape, inp.router_options
    logits, bias = inp.logits_TE, inp.bias_E

    def ref(logits_TE, bias_E):
        idx, w = reference.topk_route(logits_TE, bias_E=bias_E, **opts)
        return idx, w, reference.expert_counts(idx, s.experts)

    def unfused():
        idx, w = routing.topk_route(logits, bias_E=bias, **opts)
        return idx, w, routing.expert_counts(idx, s.experts)

    route_bytes = _nbytes(logits, bias) + s.tokens * s.topk * 12
    return Case(
        "topk_route_with_counts", lambda: routing.topk_route_with_counts(logits, bias_E=bias, **opts), ref,
        (logits, bias), bytes=route_bytes + s.experts * 4,
        bytes_note="topk_route's bytes + write counts [E] i32", exact=False,
        unfused=unfused, unfused_bytes=route_bytes + s.tokens * s.topk * 8 + s.experts * 4,
        unfused_note="topk_route, then expert_counts (reads idx [T,K] i64 again)",
    )


def _case_topk_route_sqrtsoftplus(inp: Inputs, tk) -> Case:
    """The configuration tile-kernels' ``moe_topk_gate_forward`` computes: sqrt-softplus scores,
    bias, plain top-k (no groups), normalized and scaled weights."""
    from kernels import routing
    from kernels.routing import reference

    s = inp.shape
    opts = dict(topk=s.topk, scoring="sqrtsoftplus", normalize=True, routed_scaling_factor=s.routed_scaling_factor)
    logits, bias = inp.logits_TE, inp.bias_E

    def ref(logits_TE, bias_E):
        return reference.topk_route(logits_TE, bias_E=bias_E, **opts)

    peers = _tk_peer(
        tk, "tile_kernels.moe_topk_gate_forward",
        lambda tk: tk.moe.moe_topk_gate_forward(logits, s.topk, False, 0, s.routed_scaling_factor, 0,
                                                scoring_func="sqrtsoftplus", bias=bias),
    )
    return Case(
        "topk_route_sqrtsoftplus", lambda: routing.topk_route(logits, bias_E=bias, **opts), ref, (logits, bias),
        bytes=_nbytes(logits, bias) + s.tokens * s.topk * 12, bytes_note="as topk_route", exact=False, peers=peers,
    )


def _case_expert_counts(inp: Inputs, tk) -> Case:
    from kernels import routing
    from kernels.routing import reference

    s, idx = inp.shape, inp.topk_idx_TK
    return Case(
        "expert_counts", lambda: routing.expert_counts(idx, s.experts),
        lambda topk_idx_TK: reference.expert_counts(topk_idx_TK, s.experts), (idx,),
        bytes=_nbytes(idx) + s.experts * 4, bytes_note="read idx [T,K] i64; write counts [E] i32",
    )


def _case_expert_layout(inp: Inputs, tk) -> Case:
    from kernels import permute
    from kernels.permute import reference

    s, idx, cap = inp.shape, inp.topk_idx_TK, inp.capacity
    return Case(
        "expert_layout", lambda: permute.expert_layout(idx, s.experts, alignment=s.alignment, num_rows=cap),
        lambda topk_idx_TK: reference.expert_layout(topk_idx_TK, s.experts, alignment=s.alignment, num_rows=cap),
        (idx,), bytes=_nbytes(idx) + s.experts * 8 + s.tokens * s.topk * 4 + cap * 4,
        bytes_note="read idx [T,K] i64; write counts, offsets [E] i32, pos [T,K] i32, src [P_cap] i32 "
                   "(static capacity: no host sync)",
    )


def _case_expand(inp: Inputs, tk) -> Case:
    from kernels import permute
    from kernels.permute import reference

    x, layout = inp.x_TD, inp.layout
    return Case(
        "expand", lambda: permute.expand(x, layout), reference.expand, (x, layout),
        bytes=_nbytes(x, layout.pos_TK, layout.src_P) + layout.num_rows * x.shape[1] * x.element_size(),
        bytes_note="read x [T,D] once + pos [T,K] + src [P]; write [P,D] (padding rows included)",
    )


def _case_unexpand(inp: Inputs, tk) -> Case:
    from kernels import permute
    from kernels.permute import reference

    y, layout, s = inp.y_PD, inp.layout, inp.shape
    row = y.shape[1] * y.element_size()
    return Case(
        "unexpand", lambda: permute.unexpand(y, layout), reference.unexpand, (y, layout),
        bytes=inp.routed * row + _nbytes(layout.pos_TK) + s.tokens * s.topk * row,
        bytes_note="read the routed rows of y [P,D] + pos [T,K]; write [T,K,D]",
    )


def _cast_case(op: str, inp: Inputs, tk, block: tuple[int, int], tk_call) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TD
    m, n = x.shape
    scales = math.ceil(m / block[0]) * math.ceil(n / block[1])
    ours = {
        "per_token_cast": lambda: quant.per_token_cast(x),
        "per_block_cast": lambda: quant.per_block_cast(x),
        "per_channel_cast": lambda: quant.per_channel_cast(x),
    }[op]
    return Case(
        op, ours, getattr(reference, op), (x,), bytes=_nbytes(x) + m * n + scales * 4,
        bytes_note=f"read x [T,D] bf16; write e4m3 [T,D] + f32 scales per {block[0]}x{block[1]}",
        peers=_tk_peer(tk, f"tile_kernels.{op}", tk_call),
    )


def _case_per_token_cast(inp: Inputs, tk) -> Case:
    return _cast_case("per_token_cast", inp, tk, (1, 128), lambda tk: tk.quant.per_token_cast(inp.x_TD, "e4m3", 128))


def _case_per_block_cast(inp: Inputs, tk) -> Case:
    return _cast_case(
        "per_block_cast", inp, tk, (128, 128), lambda tk: tk.quant.per_block_cast(inp.x_TD, "e4m3", (128, 128))
    )


def _case_per_channel_cast(inp: Inputs, tk) -> Case:
    return _cast_case(
        "per_channel_cast", inp, tk, (128, 1), lambda tk: tk.quant.per_channel_cast(inp.x_TD, "e4m3", 128)
    )


def _case_cast_back(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    q, sf = inp.q_TD, inp.sf_TG

    def ref(q_TD, sf_TG):
        return reference.cast_back(q_TD, sf_TG, block=(1, 128))

    return Case(
        "cast_back", lambda: quant.cast_back(q, sf, block=(1, 128)), ref, (q, sf),
        bytes=_nbytes(q, sf) + q.numel() * 2, bytes_note="read e4m3 [T,D] + f32 scales [T,D/128]; write bf16 [T,D]",
        peers=_tk_peer(tk, "tile_kernels.cast_back", lambda tk: tk.quant.cast_back((q, sf), "bf16", (1, 128))),
    )


def _case_swiglu(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TI2
    return Case(
        "swiglu", lambda: quant.swiglu(x), reference.swiglu, (x,), bytes=_nbytes(x) + x.numel(),
        bytes_note="read [T,2I] bf16; write [T,I] bf16",
        peers=_tk_peer(tk, "tile_kernels.swiglu_forward", lambda tk: tk.quant.swiglu_forward(x, "bf16")),
    )


def _case_swiglu_per_token_cast(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TI2
    t, i = x.shape[0], x.shape[1] // 2
    out_bytes = t * i + t * math.ceil(i / 128) * 4
    return Case(
        "swiglu_per_token_cast", lambda: quant.swiglu_per_token_cast(x), reference.swiglu_per_token_cast, (x,),
        bytes=_nbytes(x) + out_bytes, bytes_note="read [T,2I] bf16; write e4m3 [T,I] + f32 scales [T,I/128]",
        peers=_tk_peer(tk, "tile_kernels.swiglu_forward_and_per_token_cast",
                       lambda tk: tk.quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128)),
        unfused=lambda: quant.per_token_cast(quant.swiglu(x)),
        unfused_bytes=_nbytes(x) + t * i * 2 + t * i * 2 + out_bytes,
        unfused_note="swiglu (writes bf16 [T,I]), then per_token_cast (reads it)",
    )


def _case_swiglu_backward(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x, g = inp.x_TI2, inp.grad_TI
    return Case(
        "swiglu_backward", lambda: quant.swiglu_backward(x, g), reference.swiglu_backward, (x, g),
        bytes=_nbytes(x, g) + _nbytes(x), bytes_note="read x [T,2I] + grad [T,I] bf16; write [T,2I] bf16",
        peers=_tk_peer(tk, "tile_kernels.swiglu_backward", lambda tk: tk.quant.swiglu_backward(x, g, "bf16")),
    )


def _case_weighted_reduce(inp: Inputs, tk) -> Case:
    from kernels import reduce
    from kernels.reduce import reference

    y, pos, w = inp.y_PD, inp.layout.pos_TK, inp.weights_TK
    row = y.shape[1] * y.element_size()
    return Case(
        "weighted_reduce", lambda: reduce.weighted_reduce(y, pos, w), reference.weighted_reduce, (y, pos, w),
        bytes=inp.routed * row + _nbytes(pos, w) + pos.shape[0] * row,
        bytes_note="read the routed rows of y [P,D] bf16 + pos, weights [T,K]; write [T,D] bf16",
    )


def _case_weighted_reduce_fp8(inp: Inputs, tk) -> Case:
    from kernels import quant, reduce
    from kernels.reduce import reference

    q, sf, pos, w = inp.q_PD, inp.sf_PG, inp.layout.pos_TK, inp.weights_TK
    d, groups = q.shape[1], sf.shape[1]
    t = pos.shape[0]

    def ref(q_PD, pos_TK, weights_TK, sf_PG):
        return reference.weighted_reduce(q_PD, pos_TK, weights_TK, sf_PG=sf_PG)

    fused_bytes = inp.routed * (d + groups * 4) + _nbytes(pos, w) + t * d * 2
    p = q.shape[0]
    return Case(
        "weighted_reduce_fp8", lambda: reduce.weighted_reduce(q, pos, w, sf_PG=sf), ref, (q, pos, w, sf),
        bytes=fused_bytes,
        bytes_note="read the routed rows of q [P,D] e4m3 and their f32 scales + pos, weights; write [T,D] bf16",
        exact=True,
        unfused=lambda: reduce.weighted_reduce(quant.cast_back(q, sf, block=(1, 128)), pos, w),
        unfused_bytes=p * (d + groups * 4) + p * d * 2 + inp.routed * d * 2 + _nbytes(pos, w) + t * d * 2,
        unfused_note="cast_back to bf16 [P,D], then weighted_reduce of it",
    )


def _case_batched_transpose(inp: Inputs, tk) -> Case:
    from kernels import transpose
    from kernels.transpose import reference

    s = inp.shape
    x = inp.x_TD.view(s.transpose_batch, s.tokens // s.transpose_batch, s.hidden)
    return Case(
        "batched_transpose", lambda: transpose.batched_transpose(x), reference.batched_transpose, (x,),
        bytes=2 * _nbytes(x), bytes_note="read [B,T/B,D] bf16; write [B,D,T/B]",
    )


def _case_expand_per_token_cast(inp: Inputs, tk) -> Case:
    from kernels import permute, quant
    from kernels.quant import reference

    x, layout = inp.x_TD, inp.layout
    p, d = layout.num_rows, x.shape[1]
    out_bytes = p * d + p * math.ceil(d / 128) * 4
    index_bytes = _nbytes(layout.pos_TK, layout.src_P)
    return Case(
        "expand_per_token_cast", lambda: quant.expand_per_token_cast(x, layout), reference.expand_per_token_cast,
        (x, layout), bytes=_nbytes(x) + index_bytes + out_bytes,
        bytes_note="read x [T,D] bf16 once + pos, src; write e4m3 [P,D] + f32 scales [P,D/128]",
        unfused=lambda: quant.per_token_cast(permute.expand(x, layout)),
        unfused_bytes=_nbytes(x) + index_bytes + p * d * 2 + p * d * 2 + out_bytes,
        unfused_note="expand (writes bf16 [P,D]), then per_token_cast (reads it)",
    )


def _case_expand_cast_back(inp: Inputs, tk) -> Case:
    from kernels import permute, quant
    from kernels.quant import reference

    q, sf, layout = inp.q_TD, inp.sf_TG, inp.layout
    p, (t, d) = layout.num_rows, q.shape
    in_bytes = _nbytes(q, sf, layout.pos_TK, layout.src_P)
    return Case(
        "expand_cast_back", lambda: quant.expand_cast_back(q, sf, layout), reference.expand_cast_back, (q, sf, layout),
        bytes=in_bytes + p * d * 2,
        bytes_note="read e4m3 [T,D] + f32 scales [T,D/128] once + pos, src; write bf16 [P,D] (padding rows included)",
        unfused=lambda: permute.expand(quant.cast_back(q, sf, block=(1, 128)), layout),
        unfused_bytes=in_bytes + t * d * 2 + t * d * 2 + p * d * 2,
        unfused_note="cast_back (writes bf16 [T,D]), then expand (reads it)",
    )


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
                bytes=_nbytes(x, pre) + t * d * 2, bytes_note="read x [T,N,D] bf16 + pre [T,N] f32; write y [T,D] bf16",
                exact=False, peers=_tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_post(inp: StreamInputs, tk) -> Case:
    from kernels import mhc
    from kernels.mhc import reference

    f, x, post, comb = inp.f_TD, inp.x_TND, inp.post_TN, inp.comb_TNN
    t, n, d = x.shape

    def tk_call(tk):  # its comb is indexed [output, input]: ours transposed
        return tk.mhc.mhc_post_fwd(f[None], x[None], post[None, :, :, None].contiguous(),
                                   comb.transpose(1, 2)[None].contiguous())

    return Case("mhc_post", lambda: mhc.post(f, x, post, comb), reference.post, (f, x, post, comb),
                bytes=_nbytes(f, x, post, comb) + _nbytes(x),
                bytes_note="read f [T,D] + x [T,N,D] bf16 + post, comb f32; write x' [T,N,D] bf16",
                exact=False, peers=_tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_pre_fused(inp: StreamInputs, tk) -> Case:
    from kernels import mhc
    from kernels.mhc import reference

    x, fn, scale, base = inp.x_TND, inp.fn_MK, inp.scale_3, inp.base_M
    t, n, d = x.shape
    from kernels.mhc.pre_fused_kernel import within_tolerance

    return Case("mhc_pre_fused", lambda: mhc.pre_fused(x, fn, scale, base), reference.pre_fused, (x, fn, scale, base),
                bytes=_nbytes(x, fn) + t * d * 2 + t * (n + n * n) * 4,
                bytes_note="read x [T,N,D] bf16 + fn [N(N+2),ND] f32; write y [T,D] bf16 + post, comb f32 "
                "(x is read twice, the second time mostly from L2)",
                exact=False, within=lambda got, want: within_tolerance(x, got, want))


def _case_engram_gate(inp: StreamInputs, tk) -> Case:
    from kernels import engram
    from kernels.engram import reference

    x, k, v, wh, we = inp.x_TND, inp.k_TND, inp.v_TD, inp.wh_ND, inp.we_ND
    kv = torch.cat([k, v[:, None]], 1)  # its keys and value in one tensor

    def tk_call(tk):
        return tk.engram.engram_gate_fwd(x, kv, wh * we, 1e-6, 1e-6, save_for_backward=False)[0]

    return Case("engram_gate", lambda: engram.gate(x, k, v, wh, we), reference.gate, (x, k, v, wh, we),
                bytes=_nbytes(x, k, v, wh, we) + _nbytes(x),
                bytes_note="read x, k [T,N,D] + v [T,D] bf16 + wh, we [N,D] f32; write out [T,N,D] bf16",
                exact=False, peers=_tk_peer(tk, "tile_kernels", tk_call))


def _reference_grads(fn: Callable[..., Any], outputs: int = 1) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``grads(*inputs, *g)``: the gradients of ``fn(*inputs)`` for the gradients ``g`` of its
    ``outputs`` outputs, by autograd through the reference."""

    def grads(*args):
        leaves = [a.detach().requires_grad_() for a in args[:-outputs]]
        return torch.autograd.grad(fn(*leaves), leaves, args[-outputs:])

    return grads


def _backward(kernel: Callable[..., Any], fn: Callable[..., Any], args: tuple, outputs: int = 1) -> Callable[[], Any]:
    """Ours for a backward op: its kernel where TileLang runs, else the reference's gradients (the
    CPU smoke run)."""
    from kernels.select import use_tilelang

    if use_tilelang(args[0].device):
        return lambda: kernel(*args)
    return lambda: _reference_grads(fn, outputs)(*args)


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


def _case_mhc_pre_apply_backward(inp: StreamInputs, tk) -> Case:
    from kernels.mhc import reference
    from kernels.mhc.pre_apply_kernel import pre_apply_backward

    x, pre, g = inp.x_TND, inp.pre_TN, inp.g_TD
    t, n, d = x.shape
    x_grad = torch.zeros_like(x)  # tile-kernels adds into it

    def tk_call(tk):
        return x_grad, tk.mhc.mhc_pre_apply_mix_bwd(g, x, pre, x_grad)

    return Case("mhc_pre_apply_backward", _backward(pre_apply_backward, reference.pre_apply, (x, pre, g)),
                _reference_grads(reference.pre_apply),
                (x, pre, g), bytes=_nbytes(x, pre, g, x, pre),
                bytes_note="read x [T,N,D] + g [T,D] bf16 + pre f32; write grad_x [T,N,D] bf16 + grad_pre f32 "
                "(tile-kernels adds into grad_x: reads it too)",
                exact=False, within=normwise, compile_peer=False, peers=_tk_peer(tk, "tile_kernels", tk_call))


def _case_mhc_post_backward(inp: StreamInputs, tk) -> Case:
    from kernels.mhc import reference
    from kernels.mhc.post_kernel import post_backward

    f, x, post, comb, g = inp.f_TD, inp.x_TND, inp.post_TN, inp.comb_TNN, inp.g_TND
    comb_t = comb.transpose(1, 2)[None].contiguous()  # tile-kernels' [output, input]

    def tk_call(tk):
        return tk.mhc.mhc_post_bwd(f[None], x[None], post[None, :, :, None].contiguous(), comb_t, g[None])

    return Case("mhc_post_backward", _backward(post_backward, reference.post, (f, x, post, comb, g)),
                _reference_grads(reference.post),
                (f, x, post, comb, g), bytes=2 * _nbytes(f, x, post, comb) + _nbytes(g),
                bytes_note="read g, x [T,N,D] + f [T,D] bf16 + post, comb f32; write grad_x, grad_f, grad_post, "
                "grad_comb", exact=False, within=normwise, compile_peer=False,
                peers=_tk_peer(tk, "tile_kernels", tk_call))


def _case_engram_gate_backward(inp: StreamInputs, tk) -> Case:
    from kernels.engram import reference
    from kernels.engram.gate_kernel import backward_excess, gate, gate_backward

    x, k, v, wh, we, g = inp.x_TND, inp.k_TND, inp.v_TD, inp.wh_ND, inp.we_ND, inp.g_TND
    kv = torch.cat([k, v[:, None]], 1)
    w = wh * we
    # tile-kernels' forward keeps dot, gate, rstd_x, rstd_k for its backward (run at the first call)
    saved = functools.cache(lambda: tk.engram.engram_gate_fwd(x, kv, w, 1e-6, 1e-6, save_for_backward=True)[1:])

    def tk_call(tk):
        grad_x, grad_kv, partial = tk.engram.engram_gate_bwd(g, x, kv, w, *saved(), 1e-6)
        grad_w = partial.sum(0)
        return grad_x, grad_kv, grad_w * we, grad_w * wh

    stats = functools.cache(lambda: gate(x, k, v, wh, we, return_stats=True)[1])  # ours, likewise: its row statistics

    def ours(*args):
        return gate_backward(*args, stats())

    return Case("engram_gate_backward", _backward(ours, reference.gate, (x, k, v, wh, we, g)),
                _reference_grads(reference.gate),
                (x, k, v, wh, we, g), bytes=2 * _nbytes(x, k, v, wh, we) + _nbytes(g),
                bytes_note="read x, k, g [T,N,D] + v [T,D] bf16 + wh, we f32; write grad_x, grad_k, grad_v, grad_wh, "
                "grad_we (both from their forward's saved row statistics)",
                exact=False, within=lambda got, want: all(e <= 0 for e in backward_excess(got, want).values()),
                compile_peer=False, peers=_tk_peer(tk, "tile_kernels", tk_call))


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
                bytes=_nbytes(x, fn) + t * (m + 1) * 4,
                bytes_note="read x [T,N,D] bf16 + fn [N(N+2),ND] f32; write mixes [T,N(N+2)] + rstd [T] f32 "
                "(rstd: what its backward takes)", exact=False, within=normwise)


def _case_mhc_norm_fn_backward(inp: StreamInputs, tk) -> Case:
    from kernels.mhc import norm_fn_kernel, reference

    x, fn, g = inp.x_TND, inp.fn_MK, inp.g_TM
    t, m = g.shape
    forward = functools.cache(lambda: norm_fn_kernel.norm_fn(x, fn, eps=1e-6, tf32=False))  # mixes, rstd: saved

    def ours(x_TND, fn_MK, g_TM):  # kernels.mhc.norm_fn's backward: grad_x by the kernel, grad_fn by torch
        return norm_fn_kernel.norm_fn_backward(x_TND, fn_MK, *forward(), g_TM, False)

    return Case("mhc_norm_fn_backward", _backward(ours, reference.norm_fn, (x, fn, g)),
                _reference_grads(reference.norm_fn), (x, fn, g),
                bytes=2 * _nbytes(x, fn) + _nbytes(g) + t * (m + 1) * 4,
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
                (mixes, scale, base), bytes=_nbytes(mixes, scale, base) + t * (2 * n + n * n) * 4,
                bytes_note="read mixes [T,N(N+2)] + scale, base f32; write pre, post [T,N] + comb [T,N,N] f32 "
                "(tile-kernels also writes the comb logits [T,N,N] and reads them back)",
                exact=False, within=within_largest(1e-5), peers=_tk_peer(tk, "tile_kernels", tk_call))


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
    return Case("mhc_split_sinkhorn_backward", _backward(ours, _split_sinkhorn, args, outputs=3),
                _reference_grads(_split_sinkhorn, outputs=3), args,
                bytes=2 * _nbytes(mixes, scale, base) + _nbytes(*grads_out),
                bytes_note="read mixes [T,N(N+2)] + scale, base + the gradients of pre, post [T,N] and comb "
                "[T,N,N] f32; write grad_mixes, grad_scale, grad_base (ours recomputes the forward from the mixes; "
                "tile-kernels reads its forward's post and logits, and writes and reads back the logits' gradient)",
                exact=False, within=within_largest(1e-4), compile_peer=False,
                peers=_tk_peer(tk, "tile_kernels", tk_call))


def _case_engram_hash(inp: StreamInputs, tk) -> Case:
    # tile-kernels' engram_hash is our hash over an n-gram window its caller gathers: with
    # ngram_TW[t, k] our tok[s - k] (compressed ids, the padding before a sequence's start), it
    # mixes h = XOR_{k<n} ngram[t, k] * mult[k] in int64 and writes column (n - 2) * K + head as
    # h mod sizes[n - 2][head] + offsets[column]: our indices, as int32 (a layer's ~10.3M rows fit).
    # It takes every layer's multipliers and tables at once; here the one layer ours hashes. Its
    # window is gathered once, before timing: the compress map's lookup and the shift by position
    # are work ours does in its kernel.
    from kernels.engram import reference
    from kernels.engram.hash_kernel import hash_indices
    from kernels.select import use_tilelang

    ids, compress = inp.ids_BS, inp.compress_V
    b, s = ids.shape
    config = reference.make_hash_config(ENGRAM_HASH["layer_ids"][0], **ENGRAM_HASH)
    w, c = config.max_ngram, config.num_columns

    def ref(ids_BS, compress_V):
        return reference.ngram_hash(ids_BS, config, compress_V=compress_V, pad_id=ENGRAM_PAD_ID)

    # Where TileLang runs, the kernel alone: kernels.engram.ngram_hash first checks the ids' and the
    # map's values (a read of both and a host sync), as the other cases time the kernel wrappers.
    hash_fn = hash_indices if use_tilelang(ids.device) else reference.ngram_hash

    tok_BS = compress[ids]
    padded_BS = torch.nn.functional.pad(tok_BS, (w - 1, 0), value=int(compress[ENGRAM_PAD_ID]))
    ngram_TW = padded_BS.unfold(1, w, 1).flip(-1).reshape(b * s, w).to(torch.int32).contiguous()
    mult_LW = torch.tensor([config.multipliers], dtype=torch.int64, device=ids.device)
    sizes_LOK = torch.tensor([config.table_sizes], dtype=torch.int32, device=ids.device)
    offsets_LC = torch.tensor([config.offsets], dtype=torch.int32, device=ids.device)

    def tk_call(tk):
        return tk.engram.engram_hash(ngram_TW, mult_LW, sizes_LOK, offsets_LC).view(b, s, c)

    return Case("engram_hash", lambda: hash_fn(ids, config, compress_V=compress, pad_id=ENGRAM_PAD_ID), ref,
                (ids, compress), bytes=_nbytes(ids) + ids.unique().numel() * compress.element_size() + b * s * c * 8,
                bytes_note="read ids [B,S] i64 + the compress map's entries they name (each once); write idx "
                "[B,S,C] i64 (tile-kernels reads an n-gram window [T,W] i32 gathered before timing and writes "
                "int32: half the output bytes)", peers=_tk_peer(tk, "tile_kernels", tk_call))


CASE_BUILDERS: dict[str, Callable[[Inputs, Any], Case]] = {
    "topk_route": _case_topk_route,
    "topk_route_with_counts": _case_topk_route_with_counts,
    "topk_route_sqrtsoftplus": _case_topk_route_sqrtsoftplus,
    "expert_counts": _case_expert_counts,
    "expert_layout": _case_expert_layout,
    "expand": _case_expand,
    "unexpand": _case_unexpand,
    "per_token_cast": _case_per_token_cast,
    "per_block_cast": _case_per_block_cast,
    "per_channel_cast": _case_per_channel_cast,
    "cast_back": _case_cast_back,
    "swiglu": _case_swiglu,
    "swiglu_per_token_cast": _case_swiglu_per_token_cast,
    "swiglu_backward": _case_swiglu_backward,
    "weighted_reduce": _case_weighted_reduce,
    "weighted_reduce_fp8": _case_weighted_reduce_fp8,
    "batched_transpose": _case_batched_transpose,
    "expand_per_token_cast": _case_expand_per_token_cast,
    "expand_cast_back": _case_expand_cast_back,
    "mhc_pre_apply": _case_mhc_pre_apply,
    "mhc_post": _case_mhc_post,
    "mhc_pre_fused": _case_mhc_pre_fused,
    "engram_gate": _case_engram_gate,
    "mhc_pre_apply_backward": _case_mhc_pre_apply_backward,
    "mhc_post_backward": _case_mhc_post_backward,
    "engram_gate_backward": _case_engram_gate_backward,
    "mhc_norm_fn": _case_mhc_norm_fn,
    "mhc_norm_fn_backward": _case_mhc_norm_fn_backward,
    "mhc_split_sinkhorn": _case_mhc_split_sinkhorn,
    "mhc_split_sinkhorn_backward": _case_mhc_split_sinkhorn_backward,
    "engram_hash": _case_engram_hash,
}


# ---------------------------------------------------------------------------------------------
# Checking


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


# ---------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Median time of a call on one device (see the module doc)."""

    def __init__(self, device: torch.device, iters: int, warmup: int, budget_s: float, flush_bytes: int,
                 kernel_calls: int = 0):
        self.device, self.iters, self.warmup, self.budget_s = device, iters, warmup, budget_s
        self.kernel_calls = kernel_calls  # > 0: run_case also takes kernel_us over that many calls
        self.cuda = device.type == "cuda"
        self.flush_MB = torch.empty(flush_bytes // 4, dtype=torch.float32, device=device) if self.cuda else None
        if self.flush_MB is not None:
            self.flush_MB.normal_()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def first_call(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """``(output, seconds)`` of one synchronized call (the first includes any compilation)."""
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start

    def flush(self) -> None:
        if self.flush_MB is not None:
            self.flush_MB.sum()

    def median_us(self, fn: Callable[[], Any]) -> tuple[float, int]:
        """``(median microseconds, runs)``."""
        for _ in range(self.warmup):
            fn()
        _, once = self.first_call(fn)
        runs = max(3, min(self.iters, int(self.budget_s / max(once, 1e-6))))
        if not self.cuda:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            return statistics.median(times), runs
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            torch.cuda._sleep(HEAD_START_CYCLES)  # see the module doc: the host gets ahead of the GPU
            self.flush()
            start.record()
            fn()
            end.record()
        self.sync()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events), runs

    def kernel_us(self, fn: Callable[[], Any], calls: int = 50) -> float:
        """Median GPU time of the work ``fn`` launches (CUPTI: kernels, memsets and copies summed per
        call), the L2 flushed before each call. The flush's own events are told apart by position:
        a profile of the flush alone says how many lead each call's."""
        from torch.profiler import ProfilerActivity, profile

        def device_events(prof) -> list:
            return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                          key=lambda e: e.time_range.start)

        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as flush_only:
            self.flush()
            self.sync()
        flush_events = len(device_events(flush_only))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                self.flush()
                fn()
            self.sync()
        events = device_events(prof)
        per_call, rest = divmod(len(events), calls)
        if rest or per_call <= flush_events:
            raise RuntimeError(f"kernel_us: {len(events)} GPU events in {calls} calls, {flush_events} of each "
                               "the flush's: the call does not launch the same work every time")
        per_call_us = [sum(e.device_time for e in events[i * per_call + flush_events:(i + 1) * per_call])
                       for i in range(calls)]
        return round(statistics.median(per_call_us), 3)  # CUPTI's resolution: 1 ns (a sum's float noise off)

    def copy_kernel_us(self, nbytes: int) -> float:
        """:meth:`kernel_us` of a device-to-device copy moving ``nbytes`` (half read, half written)."""
        src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        return self.kernel_us(lambda: dst.copy_(src), self.kernel_calls)


def copy_bandwidth(timer: Timer, nbytes: int) -> dict:
    """Device-to-device ``copy_`` of ``nbytes``: bytes read + written over the median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).random_()
    dst = torch.empty_like(src)
    time_us, runs = timer.median_us(lambda: dst.copy_(src))
    return {"bytes": 2 * nbytes, "time_us": time_us, "gbps": 2 * nbytes / time_us / 1e3, "runs": runs}


# ---------------------------------------------------------------------------------------------
# Running


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def _rate(time_us: float, nbytes: int, copy_gbps: float) -> dict:
    gbps = nbytes / time_us / 1e3 if time_us > 0 else 0.0
    return {"time_us": time_us, "gbps": gbps, "pct_of_copy": 100 * gbps / copy_gbps}


@dataclasses.dataclass
class CompileBudget:
    """Seconds of ``torch.compile`` left for the run (cold Inductor compiles cost seconds each)."""

    seconds: float


def fusion_gain(fused_us: float, unfused_us: float, bytes_ratio: float) -> dict:
    """The fusion bar: the speedup's gain over the unfused sequence at least 70% of the bytes' gain."""
    speedup = unfused_us / fused_us
    gain = (speedup - 1) / (bytes_ratio - 1) if bytes_ratio > 1 else None
    return {"speedup": speedup, "speedup_over_bytes_ratio": speedup / bytes_ratio, "gain_over_bytes_gain": gain,
            "bar_ok": gain is not None and gain >= 0.7}


def copy_fusion(timer: Timer, fused_bytes: int, unfused_bytes: int) -> dict:
    """What the fusion bar asks of a kernel at the copy's speed at this size: device-to-device
    copies moving the fused op's bytes and the unfused sequence's, their GPU times, and the bar
    judged on them. Where a launch's fixed cost dominates (a small batch), a bytes ratio is no time
    ratio, and a miss here says so rather than that a kernel falls short."""
    fused_us, unfused_us = timer.copy_kernel_us(fused_bytes), timer.copy_kernel_us(unfused_bytes)
    return {"fused_us": fused_us, "unfused_us": unfused_us,
            **fusion_gain(fused_us, unfused_us, unfused_bytes / fused_bytes)}


def _fastest_peer(peers: dict, key: str) -> float | None:
    timed = [p[key] for p in peers.values() if key in p and not p.get("partial")]
    return min(timed) if timed else None


def _kernel_time(timer: Timer, thunk: Callable[[], Any]) -> dict:
    """``{"kernel_us": ...}`` with ``--kernel-time``, ``{"kernel_error": ...}`` where CUPTI could not
    tell the call's work apart (the timer's result stands), ``{}`` without."""
    if not timer.kernel_calls:
        return {}
    try:
        return {"kernel_us": timer.kernel_us(thunk, timer.kernel_calls)}
    except Exception as error:
        return {"kernel_error": _error(error)}


def run_case(
    case: Case, timer: Timer, copy_gbps: float, *, with_peers: bool, compile_budget: CompileBudget | None, impl: str
) -> dict:
    """Check, time and compare one case; never raises for a peer's failure."""
    result: dict[str, Any] = {"op": case.op, "impl": impl, "bytes": case.bytes, "bytes_note": case.bytes_note,
                              "memory_bound": case.op in MEMORY_BOUND}
    try:
        got, result["first_call_s"] = timer.first_call(case.ours)
        want = case.reference(*case.args)
        result["check"] = check(got, want, case.exact, case.within)
        del got
        time_us, result["runs"] = timer.median_us(case.ours)
        result.update(_rate(time_us, case.bytes, copy_gbps), **_kernel_time(timer, case.ours))
    except Exception as error:  # ours failing is a result too: report it, go on with the others
        result["error"] = _error(error)
        return result

    peers: dict[str, dict] = {}
    if with_peers:
        peers["torch_eager"] = _run_peer(lambda: case.reference(*case.args), timer, case, copy_gbps, want)
        if compile_budget is not None and case.compile_peer:
            peers["torch_compile"] = _run_compiled(case, timer, copy_gbps, want, compile_budget)
        for name, thunk in case.peers.items():
            peers[name] = _run_peer(thunk, timer, case, copy_gbps, want)
            peers[name]["partial"] = name in case.partial_peers
    result["peers"] = peers
    fastest = _fastest_peer(peers, "time_us")
    if fastest is not None:
        result["fastest_peer_us"], result["ratio_vs_fastest_peer"] = fastest, fastest / result["time_us"]
    fastest = _fastest_peer(peers, "kernel_us")
    if fastest is not None and "kernel_us" in result:
        result["fastest_peer_kernel_us"] = fastest
        result["ratio_vs_fastest_peer_by_kernel_time"] = fastest / result["kernel_us"]

    if case.unfused is not None:
        try:
            unfused_us, _ = timer.median_us(case.unfused)
            bytes_ratio = case.unfused_bytes / case.bytes
            result["fusion"] = {"unfused": case.unfused_note, "unfused_time_us": unfused_us,
                                "unfused_bytes": case.unfused_bytes, "bytes_ratio": bytes_ratio,
                                **fusion_gain(result["time_us"], unfused_us, bytes_ratio)}
            unfused_kernel = _kernel_time(timer, case.unfused)
            if "kernel_us" in unfused_kernel and "kernel_us" in result:
                result["fusion"]["kernel_time"] = {"unfused_kernel_us": unfused_kernel["kernel_us"],
                                                   **fusion_gain(result["kernel_us"], unfused_kernel["kernel_us"],
                                                                 bytes_ratio),
                                                   "copy": copy_fusion(timer, case.bytes, case.unfused_bytes)}
            elif unfused_kernel:
                result["fusion"]["kernel_time"] = unfused_kernel
        except Exception as error:
            result["fusion"] = {"unfused": case.unfused_note, "error": _error(error)}
    return result


def _run_peer(thunk: Callable[[], Any], timer: Timer, case: Case, copy_gbps: float, want: Any) -> dict:
    try:
        out, first = timer.first_call(thunk)
        agree = agreement(out, want)
        del out
        time_us, runs = timer.median_us(thunk)
        return {**_rate(time_us, case.bytes, copy_gbps), "first_call_s": first, "runs": runs, "agreement": agree,
                **_kernel_time(timer, thunk)}
    except Exception as error:
        return {"error": _error(error)}


def _run_compiled(case: Case, timer: Timer, copy_gbps: float, want: Any, budget: CompileBudget) -> dict:
    if budget.seconds <= 0:
        return {"error": "skipped: the run's torch.compile budget (--compile-budget) is spent"}
    start = time.perf_counter()
    try:
        compiled = torch.compile(case.reference, dynamic=False)
        result = _run_peer(lambda: compiled(*case.args), timer, case, copy_gbps, want)
    except Exception as error:
        result = {"error": _error(error)}
    finally:
        budget.seconds -= time.perf_counter() - start
    if "first_call_s" in result:
        result["compile_s"] = result["first_call_s"]
    return result


# ---------------------------------------------------------------------------------------------
# Reporting


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except Exception as error:
        try:
            from importlib.metadata import version

            return version(module.replace("_", "-"))
        except Exception:
            return f"unavailable ({_error(error)})"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def tuning_setup(iters: int) -> tuple[torch.device, int, Timer]:
    """What a tuning script (``bench/scripts``) times with: the CUDA device, a seed from the clock
    (fresh inputs each run) and this benchmark's timer (``iters`` runs at most, caches flushed)."""
    device = torch.device("cuda")
    return device, int(time.time()) % 100_000, Timer(device, iters, 10, 0.3, flush_bytes=512 << 20)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def summarize_bars(results: list[dict]) -> dict:
    """The issues' bars: copy bandwidth at the large shape (the mHC/Engram ops at the v4 shapes),
    the peer ratio at every shape, the fusion gain; with ``--kernel-time`` the last two again by the
    GPU time alone."""
    bars: dict[str, Any] = {"memory_bound_ge_90pct_of_copy": {}, "ratio_vs_fastest_peer_ge_1": {}, "fusion": {}}
    by_kernel_time: dict[str, dict] = {"ratio_vs_fastest_peer_ge_1_by_kernel_time": {}, "fusion_by_kernel_time": {}}
    for r in results:
        key = f"{r['shape']}/{r['op']}"
        if "time_us" not in r:
            continue
        if r["memory_bound"] and (r["shape"] == "large" or (r["op"] in MHC_OPS and r["shape"].startswith("v4"))):
            bars["memory_bound_ge_90pct_of_copy"][key] = r["pct_of_copy"] >= 90
        if "ratio_vs_fastest_peer" in r:
            bars["ratio_vs_fastest_peer_ge_1"][key] = r["ratio_vs_fastest_peer"] >= 1.0
        if "bar_ok" in r.get("fusion", {}):
            bars["fusion"][key] = r["fusion"]["bar_ok"]
        if "ratio_vs_fastest_peer_by_kernel_time" in r:
            by_kernel_time["ratio_vs_fastest_peer_ge_1_by_kernel_time"][key] = (
                r["ratio_vs_fastest_peer_by_kernel_time"] >= 1.0)
        if "bar_ok" in r.get("fusion", {}).get("kernel_time", {}):
            by_kernel_time["fusion_by_kernel_time"][key] = r["fusion"]["kernel_time"]["bar_ok"]
    bars.update((name, bar) for name, bar in by_kernel_time.items() if bar)
    tk_gate = [r for r in results if r["op"] == "topk_route" and r["shape"] == "large" and "time_us" in r]
    if tk_gate and "time_us" in tk_gate[0]["peers"].get("tile_kernels.topk_gate", {}):
        bars["router_faster_than_tile_kernels_topk_gate"] = (
            tk_gate[0]["time_us"] < tk_gate[0]["peers"]["tile_kernels.topk_gate"]["time_us"]
        )
    return bars


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_table(report: dict) -> None:
    copy = report["copy"]
    print(f"\n{report['device']}  commit {report['commit'] or '?'}  copy {copy['gbps']:.0f} GB/s "
          f"({copy['bytes'] / 2**30:.0f} GiB read+write in {copy['time_us']:.0f} us)")
    head = (f"{'shape':6} {'op':27} {'impl':9} {'check':6} {'us':>9} {'GB/s':>7} {'%copy':>6} {'eager us':>9} "
            f"{'compile us':>10} {'tile-k us':>9} {'vs best':>7} {'1st call s':>10}")
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        if "error" in r:
            print(f"{r['shape']:6} {r['op']:27} {r['impl']:9} ERROR  {r['error']}")
            continue
        peers = r.get("peers", {})
        tk = [p["time_us"] for n, p in peers.items() if n.startswith("tile_kernels") and "time_us" in p
              and not p.get("partial")]
        chk = r["check"]
        status = "exact" if chk.get("exact") else ("close" if chk.get("ok") else "FAIL")
        print(f"{r['shape']:6} {r['op']:27} {r['impl']:9} {status:6} {r['time_us']:9.1f} {r['gbps']:7.0f} "
              f"{r['pct_of_copy']:6.1f} {_fmt(peers.get('torch_eager', {}).get('time_us'), '9.1f'):>9} "
              f"{_fmt(peers.get('torch_compile', {}).get('time_us'), '10.1f'):>10} "
              f"{_fmt(min(tk) if tk else None, '9.1f'):>9} {_fmt(r.get('ratio_vs_fastest_peer'), '7.2f'):>7} "
              f"{r['first_call_s']:10.2f}")
    errors = [(r["shape"], r["op"], n, p["error"]) for r in report["results"] for n, p in r.get("peers", {}).items()
              if "error" in p]
    for shape, op, name, error in errors:
        print(f"  peer error {shape}/{op}/{name}: {error}")
    fused = [r for r in report["results"] if "speedup" in r.get("fusion", {})]
    if fused:
        print("\nfused vs the unfused sequence of our ops (bar: speedup gain >= 70% of the bytes gain)")
        for r in fused:
            f = r["fusion"]
            for timing, g in (("timer", f), ("GPU time", f.get("kernel_time", {}))):
                if "speedup" in g:
                    print(f"  {r['shape']:6} {r['op']:27} {timing:8} speedup {g['speedup']:.2f}x  bytes ratio "
                          f"{f['bytes_ratio']:.2f}x  speedup/bytes {g['speedup_over_bytes_ratio']:.2f}  gain/bytes gain "
                          f"{_fmt(g['gain_over_bytes_gain'], '.2f')}  {'ok' if g['bar_ok'] else 'MISSED'}  "
                          f"({f['unfused']})")
            copy = f.get("kernel_time", {}).get("copy")
            if copy:
                print(f"  {r['shape']:6} {r['op']:27} copies of the same bytes: {copy['fused_us']:.2f} / "
                      f"{copy['unfused_us']:.2f} us, speedup {copy['speedup']:.2f}x, gain/bytes gain "
                      f"{_fmt(copy['gain_over_bytes_gain'], '.2f')}  {'ok' if copy['bar_ok'] else 'MISSED'}")
    gpu_timed = [r for r in report["results"] if "kernel_us" in r]
    if gpu_timed:
        print("\nGPU time alone (--kernel-time: CUPTI, kernels + memsets + copies per call)")
        for r in gpu_timed:
            print(f"  {r['shape']:6} {r['op']:27} ours {r['kernel_us']:8.2f} us  fastest peer "
                  f"{_fmt(r.get('fastest_peer_kernel_us'), '8.2f'):>8} us  vs best "
                  f"{_fmt(r.get('ratio_vs_fastest_peer_by_kernel_time'), '.3f')}")
    for name, value in report["bars"].items():
        if isinstance(value, dict):
            missed = [k for k, ok in value.items() if not ok]
            print(f"bar {name}: {len(value) - len(missed)}/{len(value)} met" + (f"; missed: {', '.join(missed)}" if missed else ""))
        else:
            print(f"bar {name}: {value}")


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ep-runtime bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=("large", "small", "v4", "all", "tiny"), default=None,
                   help="large (16384 tokens), small (128 tokens), v4 (the mHC/Engram ops at 8192 tokens, 4 "
                        "streams, hidden 4096 and 7168), all (the three; the default on CUDA), tiny (the CPU "
                        "smoke shape; the default with --device cpu --quick)")
    p.add_argument("--ops", default=None, help=f"comma-separated subset of: {', '.join(CASE_BUILDERS)}")
    p.add_argument("--iters", type=int, default=50, help="timed runs per measurement at most (default 50)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default 3)")
    p.add_argument("--skip-peers", action="store_true", help="time our ops only")
    p.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile peer")
    p.add_argument("--compile-budget", type=float, default=100.0, metavar="S",
                   help="seconds of torch.compile (compiling and timing) for the whole run; later ops "
                        "record the peer as skipped (default 100)")
    p.add_argument("--kernel-time", action="store_true",
                   help="also time each call's GPU work alone (CUPTI; for latency-bound shapes, where the "
                        "timer's launch and events are most of the time) and judge the ratio and fusion bars "
                        "by it too (CUDA only)")
    p.add_argument("--warm-cache", action="store_true",
                   help="let TileLang reuse its on-disk kernel cache (default: off, so first calls show "
                        "compile times)")
    p.add_argument("--quick", action="store_true", help="few runs per measurement (on the CPU: the tiny shape)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: new each run)")
    p.add_argument("--commit", default=None,
                   help="commit to record when git cannot tell (a copy of the tree without .git)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<device>/kernels-<date>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    on_cuda = device.type == "cuda"
    shapes = args.shapes or ("all" if on_cuda or not args.quick else "tiny")
    shape_names = {"all": ["large", "small", "v4-d4096", "v4-d7168"], "v4": ["v4-d4096", "v4-d7168"]}.get(shapes,
                                                                                                        [shapes])
    names = list(CASE_BUILDERS) if args.ops is None else [n.strip() for n in args.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASE_BUILDERS]
    if unknown:
        raise SystemExit(f"ep-runtime bench kernels: --ops: unknown {unknown}; expected some of {list(CASE_BUILDERS)}")
    with_peers = on_cuda and not args.skip_peers  # on the CPU the op is the reference: nothing to compare
    iters, warmup = (min(args.iters, 10), 1) if args.quick else (args.iters, args.warmup)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000

    from kernels.select import use_tilelang

    impl = "tilelang" if use_tilelang(device) else "reference"
    if impl == "tilelang" and not args.warm_cache:
        import tilelang

        tilelang.disable_cache()  # the in-process cache still serves the second shape
    budget_s = 0.1 if args.quick else 0.3
    kernel_calls = 50 if on_cuda and args.kernel_time else 0
    timer = Timer(device, iters, warmup, budget_s, flush_bytes=(512 << 20) if on_cuda else 0, kernel_calls=kernel_calls)
    copy = copy_bandwidth(timer, (1 << 30) if on_cuda else (64 << 20))

    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety
        def tqdm(items, **_):
            return items

    budget = None if args.skip_compile else CompileBudget(args.compile_budget)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "kernels",
        "complete": False,  # true once every shape ran (the file is rewritten after each op)
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device_name(device),
        "device_type": device.type,
        "commit": args.commit or _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")) if _git("rev-parse", "HEAD") else None,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "tilelang": _version("tilelang"),
            "tile_kernels": _version("tile_kernels") if with_peers else "not loaded (no peers)",
        },
        "settings": {"iters": iters, "warmup": warmup, "budget_s_per_measurement": budget_s, "seed": seed,
                     "l2_flush_bytes": (512 << 20) if on_cuda else 0, "peers": with_peers,
                     "torch_compile": with_peers and not args.skip_compile, "quick": args.quick,
                     "tilelang_disk_cache": args.warm_cache, "kernels": impl, "kernel_time_calls": kernel_calls},
        "copy": copy,
        "shapes": {name: dataclasses.asdict(SHAPES[name]) for name in shape_names},
        "results": [],
    }
    out = Path(args.out) if args.out else (
        REPO / "bench" / "results" / slug(report["device"]) / f"kernels-{datetime.date.today().isoformat()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        report["bars"] = summarize_bars(report["results"])
        report["wall_s"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        if shape_name == "tiny":
            makers = [Inputs, StreamInputs]
        else:
            makers = [StreamInputs if shape_name.startswith("v4") else Inputs]
        cases = [case for make in makers for case in build_cases(make(shape, device, seed), names, with_peers)]
        for case in tqdm(cases, desc=f"{shape_name} ({shape.tokens} tokens)", file=sys.stderr):
            result = run_case(case, timer, copy["gbps"], with_peers=with_peers, compile_budget=budget, impl=impl)
            report["results"].append({"shape": shape_name, **result})
            write()
        del cases
    report["complete"] = True
    write()
    print_table(report)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
