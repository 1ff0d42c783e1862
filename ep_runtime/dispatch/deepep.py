"""The ``deepep`` backend: dispatch/combine through DeepEP's ``Buffer`` (intranode normal mode).

Any module with DeepEP's ``Buffer`` API serves: ``deep_ep`` itself when it is installed (its NVLink
kernels, bf16 activations), or ``ep_runtime.compat.deep_ep`` (ep-runtime's facade of that API,
which is how the conformance suite runs this adapter without DeepEP). Tokens and their routes go
out in one ``Buffer.dispatch`` (FP8 ``(data, scales)`` when ``fp8``), received rows come back
grouped by source rank; the local experts' layout is built here. The transport of the autograd
(``autograd.py``) is DeepEP's cached dispatch (``scatter``) and combine (``gather_home``; the
router weights' gradients ride on combine's ``topk_weights``).

Shape letters: T tokens, K routes, D hidden, R received rows, P layout rows.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.permute import ExpertLayout, expert_layout
from kernels.quant import per_token_cast
from kernels.reduce import weighted_reduce
from kernels.validate import check_routes

from .autograd import CombineFn, DispatchFn, Fp8Rows, expand_rows
from .protocol import Dispatcher, DispatchHandle, check_combine_args, check_dispatch_args, local_experts


@dataclass(frozen=True)
class BufferRoute:
    """DeepEP's handle of the dispatch, and the layout built from its received routes."""

    handle: tuple
    layout: ExpertLayout
    num_tokens: int


def import_deep_ep() -> types.ModuleType:
    try:
        import deep_ep
    except ImportError as e:
        raise ValueError("model.moe.dispatcher: 'deepep' needs the deep_ep package (github.com/deepseek-ai/DeepEP), "
                         f"which does not import here ({e}); use 'nvlink' or 'all_to_all'") from None
    return deep_ep


class DeepEPDispatcher(Dispatcher, name="deepep"):
    """Dispatch/combine through ``buffer_api.Buffer`` over ``group`` (default: ``deep_ep``)."""

    @classmethod
    def from_config(cls, cfg, ctx):
        if ctx.ep_rail_group is not None:
            raise ValueError("model.moe.dispatcher: 'deepep' runs DeepEP's intranode mode, and this EP group spans "
                             "nodes; use 'nvlink' (two stages: NVLink inside nodes, all_to_all between them) or "
                             "'all_to_all'")
        return cls(num_experts=cfg.num_experts, group=ctx.ep_group, alignment=cfg.alignment,
                   fp8=cfg.dispatch_format == "e4m3")

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup, alignment: int = 128, fp8: bool = False,
                 buffer_api: types.ModuleType | None = None, num_nvl_bytes: int = 1 << 30):
        world, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.num_local_experts = num_experts, local_experts(num_experts, world)
        self.alignment, self.fp8 = alignment, fp8
        self.bf16_only = buffer_api is None  # DeepEP's own kernels combine bf16 rows only
        self.buffer = (buffer_api or import_deep_ep()).Buffer(group, num_nvl_bytes)

    def scatter(self, rows_TX: torch.Tensor, route: BufferRoute) -> torch.Tensor:
        return self.buffer.dispatch(rows_TX, handle=route.handle)[0]

    def gather_home(self, rows_RX: torch.Tensor, route: BufferRoute) -> torch.Tensor:
        return self.buffer.combine(rows_RX.contiguous(), route.handle)[0]

    def gather_weights_home(self, weights_RK: torch.Tensor, route: BufferRoute) -> torch.Tensor:
        """The router weights' gradients go home as combine's ``topk_weights`` (DeepEP combines
        bf16 rows only: a few zero bf16 columns ride along)."""
        rows = torch.zeros(weights_RK.shape[0], 8, dtype=torch.bfloat16, device=weights_RK.device)
        return self.buffer.combine(rows, route.handle, topk_weights=weights_RK.contiguous())[1]

    def reduce_home(self, y_PD: torch.Tensor, weights_RK: torch.Tensor, route: BufferRoute) -> torch.Tensor:
        return self.gather_home(weighted_reduce(y_PD, route.layout.pos_TK, weights_RK, out_dtype=y_PD.dtype), route)

    def check_bf16(self, name: str, rows: torch.Tensor) -> None:
        """Named here, before DeepEP's kernels meet rows they do not take."""
        if self.bf16_only and rows.dtype != torch.bfloat16:
            raise TypeError(f"{name}: expected torch.bfloat16 with dispatcher 'deepep' (DeepEP combines bf16 rows "
                            f"only), got {rows.dtype}")

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        check_dispatch_args(x_TD, topk_idx_TK, topk_weights_TK)
        self.check_bf16("x_TD", x_TD)
        check_routes(topk_idx_TK, self.num_experts)  # DeepEP's dispatch syncs anyway
        idx_TK = topk_idx_TK.to(torch.int64)
        with torch.no_grad():
            per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx_TK, self.num_experts)
            x = per_token_cast(x_TD) if self.fp8 else x_TD
            recv_x, recv_idx_RK, recv_weights_RK, _, handle, _ = self.buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx_TK, topk_weights=topk_weights_TK)
            if self.fp8:
                recv_x = Fp8Rows(q_RD=recv_x[0], sf_RG=recv_x[1], dtype=x_TD.dtype)
        layout = expert_layout(recv_idx_RK, self.num_local_experts, alignment=self.alignment)
        route = BufferRoute(handle=handle, layout=layout, num_tokens=x_TD.shape[0])
        x_PD, weights_RK = DispatchFn.apply(x_TD, topk_weights_TK, expand_rows(recv_x, layout), recv_weights_RK, route,
                                            self)
        return x_PD, layout, DispatchHandle(route=route, recv_weights_RK=weights_RK)

    def combine(self, y_PD, handle: DispatchHandle):
        check_combine_args(y_PD, handle)
        self.check_bf16("y_PD", y_PD)
        return CombineFn.apply(y_PD, handle.recv_weights_RK, handle.route, self, False)
