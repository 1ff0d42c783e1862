"""The portable backend: torch.distributed ``all_to_all_single`` (NCCL on GPU, gloo on CPU).

Counts travel first (one int per peer), then the rows. Experts are placed contiguously: global
expert ``e`` lives on EP rank ``e // num_local_experts``. With no process group (one process) the
transport is the identity and every expert is local.

Shape letters: T tokens, K routes per token, D hidden, W EP ranks, S rows sent, R rows received,
P layout rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.permute import expert_layout
from kernels.validate import check_index_range, check_tensor

from .autograd import CombineFn, DispatchFn
from .protocol import DispatchHandle, RowSplits, TokenRoute


class AllToAllDispatcher:
    """Dispatch/combine over ``all_to_all_single`` within ``group`` (None: a single process)."""

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup | None = None, alignment: int = 128,
                 fp8: bool = False):
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        if num_experts % self.world:
            raise ValueError(f"num_experts: expected a multiple of the EP size {self.world}, got {num_experts}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world
        self.alignment = alignment
        self.fp8 = fp8

    # The transport: rows grouped by peer, in rank order.
    def send(self, rows_SX: torch.Tensor, splits: RowSplits) -> torch.Tensor:
        return self._exchange(rows_SX, splits.send, splits.recv)

    def send_back(self, rows_RX: torch.Tensor, splits: RowSplits) -> torch.Tensor:
        return self._exchange(rows_RX, splits.recv, splits.send)

    def _exchange(self, rows: torch.Tensor, in_splits, out_splits) -> torch.Tensor:
        if self.group is None:
            return rows
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), list(out_splits), list(in_splits), group=self.group)
        return out

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        check_tensor("x_TD", x_TD, ndim=2, dtype=(torch.float32, torch.bfloat16, torch.float16))
        num_tokens = x_TD.shape[0]
        check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int64, torch.int32), shape=(num_tokens, None),
                     device=x_TD.device)
        check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=tuple(topk_idx_TK.shape),
                     device=x_TD.device)
        check_index_range("topk_idx_TK", topk_idx_TK, self.num_experts)

        # Which ranks each token goes to: one row per (token, destination rank).
        idx_TK = topk_idx_TK.long()
        dest_TK = torch.where(idx_TK >= 0, idx_TK // self.num_local_experts, -1)
        ranks_W = torch.arange(self.world, device=x_TD.device)
        goes_WT = (dest_TK[None] == ranks_W[:, None, None]).any(-1)
        dest_S, send_token_S = goes_WT.nonzero(as_tuple=True)
        mine_SK = dest_TK[send_token_S] == dest_S[:, None]
        local_idx_SK = torch.where(mine_SK, idx_TK[send_token_S] - dest_S[:, None] * self.num_local_experts, -1)
        weights_SK = torch.where(mine_SK, topk_weights_TK[send_token_S], 0.0)

        send_splits = goes_WT.sum(1)
        recv_splits = self._exchange(send_splits, [1] * self.world, [1] * self.world)
        send, recv = torch.stack([send_splits, recv_splits]).tolist()  # this backend's one host sync
        splits = RowSplits(send=tuple(send), recv=tuple(recv))
        layout = expert_layout(self.send(local_idx_SK, splits), self.num_local_experts, alignment=self.alignment)
        route = TokenRoute(send_token_S=send_token_S, splits=splits, layout=layout, num_tokens=num_tokens)
        x_PD, recv_weights_RK = DispatchFn.apply(x_TD, weights_SK, route, self, self.fp8)
        return x_PD, layout, DispatchHandle(route=route, recv_weights_RK=recv_weights_RK)

    def combine(self, y_PD, handle: DispatchHandle):
        check_tensor("y_PD", y_PD, shape=(handle.route.layout.num_rows, None),
                     dtype=(torch.float32, torch.bfloat16, torch.float16))
        return CombineFn.apply(y_PD, handle.recv_weights_RK, handle.route, self)

