"""What ``ep-runtime bench kernels`` measures: the shapes, one ``Case`` per op at a shape (ours, its
reference, its peers, the bytes it must move, how its output is checked), the inputs every case
of a shape shares (built with the tests' generators) and the helpers the per-family case modules
(``kernels_<family>.py``) build their cases with.

Shape suffixes: T tokens, E experts, K routes per token, D hidden, I SwiGLU intermediate, P layout
rows, G scale groups, B batch (the Engram hash: sequences), N mHC streams, M mHC mixes, S positions in
a sequence, C Engram hash columns, V token ids before compression, W an n-gram window (the largest
order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


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
    "mhc_post_backward", "engram_gate_backward", "requant", "per_block_cast_lossless",
    "per_token_cast_fp4", "per_token_cast_fp4_e4m3_sf", "cast_back_fp4",
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


def nbytes(*tensors: torch.Tensor) -> int:
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


def load_tile_kernels():
    """The tile-kernels module, or the import error as a string."""
    try:
        import tile_kernels

        return tile_kernels
    except Exception as error:  # any failure to import is reported, not raised
        return f"{type(error).__name__}: {error}"


def tk_peer(tk, name: str, call: Callable[[Any], Any]) -> dict[str, Callable[[], Any]]:
    """``{"tile_kernels": thunk}``; the thunk raises the import error if tile-kernels is missing."""
    if tk is None:
        return {}
    if isinstance(tk, str):
        def failed():
            raise RuntimeError(f"tile_kernels unavailable: {tk}")

        return {name: failed}
    return {name: lambda: call(tk)}


def reference_grads(fn: Callable[..., Any], outputs: int = 1) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``grads(*inputs, *g)``: the gradients of ``fn(*inputs)`` for the gradients ``g`` of its
    ``outputs`` outputs, by autograd through the reference."""

    def grads(*args):
        leaves = [a.detach().requires_grad_() for a in args[:-outputs]]
        return torch.autograd.grad(fn(*leaves), leaves, args[-outputs:])

    return grads


def backward_op(kernel: Callable[..., Any], fn: Callable[..., Any], args: tuple, outputs: int = 1) -> Callable[[], Any]:
    """Ours for a backward op: its kernel where TileLang runs, else the reference's gradients (the
    CPU smoke run)."""
    from kernels.select import use_tilelang

    if use_tilelang(args[0].device):
        return lambda: kernel(*args)
    return lambda: reference_grads(fn, outputs)(*args)
