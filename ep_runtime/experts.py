"""Expert MLPs (SwiGLU): the routed experts as one grouped module, and a plain MLP for shared
experts and dense layers.

Shape letters: T tokens, D hidden, I expert intermediate size, E local experts, P rows of the
expert-major layout (see ``kernels.permute.ExpertLayout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from kernels.permute import ExpertLayout
from kernels.quant import swiglu, swiglu_backward

from .fp8_experts import FP8ExpertsFn


class SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up`` on ``[gate | up]`` through the kernel ops, forward and backward; with
    ``rows`` (int32 ``[1]``, on the device) only the first ``rows[0]`` rows are wanted."""

    @staticmethod
    def forward(ctx, x_TI2, rows=None):
        ctx.save_for_backward(x_TI2, rows)
        return swiglu(x_TI2, rows=rows)

    @staticmethod
    def backward(ctx, grad_TI):
        x_TI2, rows = ctx.saved_tensors
        return swiglu_backward(x_TI2, grad_TI.contiguous(), rows=rows), None


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(SwiGLUFn.apply(self.w13(x_TD)))


class GroupedExperts(nn.Module):
    """``num_local`` SwiGLU experts computed over an expert-major layout.

    On CUDA the two projections are ``torch._grouped_mm`` calls in bfloat16 over the layout's
    aligned offsets; elsewhere a loop over the experts' segments. Each expert's initial weights
    come from its own generator seeded by ``(seed, logical expert id)``, so a rank holding experts
    4..7 starts with exactly the weights that a single process holding all experts gives them, and
    every replica of a logical expert starts with the same weights.

    ``logical_ids`` names the logical expert of each local slot (a placement's slots, see
    ``ep_runtime.placement``); by default slots hold experts ``first_expert, first_expert + 1, ...``.
    With ``fp8`` the CUDA path runs the MLP in FP8 (``ep_runtime.fp8_experts``; the layout's
    segments must be multiples of 128 rows).
    """

    def __init__(self, num_local: int, hidden: int, intermediate: int, *, first_expert: int = 0, seed: int,
                 logical_ids: Sequence[int] | None = None, fp8: bool = False):
        super().__init__()
        self.fp8 = fp8
        if logical_ids is None:
            logical_ids = range(first_expert, first_expert + num_local)
        self.logical_ids = tuple(int(e) for e in logical_ids)
        if len(self.logical_ids) != num_local:
            raise ValueError(f"logical_ids: expected {num_local} experts, got {len(self.logical_ids)}")
        self.w13_EDI2 = nn.Parameter(torch.empty(num_local, hidden, 2 * intermediate))
        self.w2_EID = nn.Parameter(torch.empty(num_local, intermediate, hidden))

        @torch.no_grad()
        def draw(i: int) -> None:
            g = torch.Generator().manual_seed(seed * 1_000_003 + self.logical_ids[i])
            self.w13_EDI2[i].normal_(0.0, hidden**-0.5, generator=g)
            self.w2_EID[i].normal_(0.0, intermediate**-0.5, generator=g)

        # an expert a thread (each draw is serial; at v3-layer's widths they took 55 s one by one)
        with ThreadPoolExecutor() as pool:
            list(pool.map(draw, range(num_local)))

    def forward(self, x_PD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        if x_PD.is_cuda:
            return self._grouped(x_PD, layout)
        return self._looped(x_PD, layout)

    def _grouped(self, x_PD, layout):
        offs = layout.offsets_E
        if self.fp8:
            return FP8ExpertsFn.apply(x_PD, self.w13_EDI2, self.w2_EID, offs)
        h_PI2 = torch._grouped_mm(x_PD.bfloat16(), self.w13_EDI2.bfloat16(), offs=offs)
        # The grouped GEMMs read rows up to offs[-1] only; the SwiGLU skips the capacity past them
        # (a static-capacity layout, e.g. the nvlink backend's, may be several times the rows in use).
        y_PD = torch._grouped_mm(SwiGLUFn.apply(h_PI2, offs[-1:].int()), self.w2_EID.bfloat16(), offs=offs)
        return y_PD.to(x_PD.dtype)

    def _looped(self, x_PD, layout):
        ends = layout.offsets_E.tolist()
        pieces, start = [], 0
        for e, end in enumerate(ends):
            if end > start:  # an expert without tokens computes nothing
                h = SwiGLUFn.apply(x_PD[start:end] @ self.w13_EDI2[e])
                pieces.append(h @ self.w2_EID[e])
            start = end
        pieces.append(x_PD.new_zeros((x_PD.shape[0] - start, x_PD.shape[1])))  # capacity rows past the last
        return torch.cat(pieces)
