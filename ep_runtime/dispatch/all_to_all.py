"""The portable backend: torch.distributed ``all_to_all_single`` (NCCL on GPU, gloo on CPU).

Counts travel first, then the rows: a peer's count row holds the rows it gets, their routes per
expert of its own (its layout's size) and whether the sender's routes are valid, read on the host
in the backend's one sync. Experts are placed contiguously: global expert ``e`` lives on EP rank
``e // num_local_experts``. With no process group, or a group of one
rank, the transport is the identity and every expert is local: nothing is counted on the host, so
dispatch and combine never sync (the routes' range is asserted on the device, and the layout keeps
its static capacity, whose unused rows no expert computes).

Shape letters: T tokens, K routes per token, D hidden, W EP ranks, S rows sent (one per token per
destination rank), R rows received, P layout rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.permute import ExpertLayout, expert_layout, max_rows
from kernels.quant import cast_back, per_token_cast, per_token_cast_fp4_e4m3_sf
from kernels.reduce import weighted_reduce
from kernels.validate import assert_routes_async, raise_for_routes, route_stats, routes_invalid

from ..config import DISPATCH_FORMATS
from .autograd import FP4_GROUP, FP8_GROUP, CombineFn, DispatchFn, Fp4Rows, Fp8Rows, expand_rows
from .protocol import Dispatcher, DispatchHandle, check_combine_args, check_dispatch_args, local_experts


@dataclass(frozen=True)
class RowSplits:
    """How many rows go to (``send``) and come from (``recv``) each EP rank, in rank order, and
    the rows of the received routes' layout over the local experts (None: not counted)."""

    send: tuple[int, ...]
    recv: tuple[int, ...]
    layout_rows: int | None = None


@dataclass(frozen=True)
class TokenRoute:
    """Which rows go where: made by ``dispatch`` before any token moves; read-only.

    Attributes:
        send_token_S: int64 [S], the home token of each row this rank sends, grouped by
            destination rank in rank order (ascending tokens within a rank).
        home_TW: int32 [T, W], the sent row of token t bound for rank w, -1 if none: where its
            returning row lands, so the home sum runs in rank order (deterministic).
        splits: rows sent to and received from each EP rank.
        layout: the expert-major layout of the received routes over the local experts
            (its ``pos_TK`` is indexed by received row, [R, K]); None for a stage of a
            hierarchical route, which has one layout at its end.
        num_tokens: T, the tokens this rank dispatched.
    """

    send_token_S: torch.Tensor
    home_TW: torch.Tensor
    splits: RowSplits
    layout: ExpertLayout | None
    num_tokens: int


def home_rows(dest_S: torch.Tensor, send_token_S: torch.Tensor, num_tokens: int, world: int) -> torch.Tensor:
    """``home_TW``: the sent row of token t bound for rank w (rows in the order sent), -1 if none."""
    home_TW = torch.full((num_tokens, world), -1, dtype=torch.int32, device=send_token_S.device)
    home_TW[send_token_S, dest_S] = torch.arange(send_token_S.numel(), dtype=torch.int32, device=send_token_S.device)
    return home_TW


def sum_home(rows_SX: torch.Tensor, home_TW: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's returned rows summed in float32 in rank order, in ``out_dtype`` (default: the
    rows' dtype): the home sum of every backend (all_to_all, nvlink, the DeepEP facade), the same
    bits on every run (no atomics)."""
    out_TX = weighted_reduce(rows_SX.flatten(1), home_TW, None, out_dtype=out_dtype)
    return out_TX.view(home_TW.shape[0], *rows_SX.shape[1:])


class AllToAllDispatcher(Dispatcher, name="all_to_all"):
    """Dispatch/combine over ``all_to_all_single`` within ``group`` (None: a single process)."""

    fp8_combine_capable = True

    @classmethod
    def from_config(cls, cfg, ctx):
        return cls(num_experts=cfg.num_experts, group=ctx.ep_group, alignment=cfg.alignment,
                   dispatch_format=cfg.dispatch_format, fp8_combine=cfg.fp8_combine)

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup | None = None, alignment: int = 128,
                 dispatch_format: str = "bf16", fp8_combine: bool = False):
        if dispatch_format not in DISPATCH_FORMATS:
            raise ValueError(f"dispatch_format: expected one of {DISPATCH_FORMATS}, got {dispatch_format!r}")
        self.world = dist.get_world_size(group) if group is not None else 1
        self.group = group if self.world > 1 else None  # one rank: the identity, no collectives
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        self.num_experts, self.num_local_experts = num_experts, local_experts(num_experts, self.world)
        self.alignment = alignment
        self.dispatch_format, self.fp8_combine = dispatch_format, fp8_combine

    # The transport: rows grouped by peer, in rank order.
    def scatter(self, rows_TX: torch.Tensor, route: TokenRoute) -> torch.Tensor:
        if self.group is None:  # every token stays, each once: its own row
            return rows_TX
        return self._exchange(rows_TX.index_select(0, route.send_token_S), route.splits.send, route.splits.recv)

    def gather_home(self, rows_RX: torch.Tensor, route: TokenRoute, *, fp8: bool = False) -> torch.Tensor:
        """``Dispatcher.gather_home``; with ``fp8`` the rows travel as ``reduce_home``'s do (a rank's
        own rows never do)."""
        if self.group is None:  # one row a token, its own: the float32 sum of one row is the row
            return rows_RX
        if not fp8:
            return sum_home(self._exchange(rows_RX, route.splits.recv, route.splits.send), route.home_TW)
        # Every row travels as e4m3 (the own block too: one collective), but the own block's
        # rows are summed as they were: they never leave this rank.
        q_RX, sf_RG = per_token_cast(rows_RX, group=FP8_GROUP)
        back = route.splits.recv, route.splits.send
        q_SD = self._exchange(q_RX.view(torch.uint8), *back).view(torch.float8_e4m3fn)
        rows_SD = cast_back(q_SD, self._exchange(sf_RG, *back), block=(1, FP8_GROUP), out_dtype=torch.float32)
        own_R, own_S = (slice(sum(splits[:self.ep_rank]), sum(splits[:self.ep_rank + 1])) for splits in back)
        rows_SD[own_S] = rows_RX[own_R].float()
        return sum_home(rows_SD, route.home_TW).to(rows_RX.dtype)

    def reduce_home(self, y_PD: torch.Tensor, weights_RK: torch.Tensor, route: TokenRoute, *,
                    fp8: bool = False) -> torch.Tensor:
        rows_RD = weighted_reduce(y_PD, route.layout.pos_TK, weights_RK, out_dtype=y_PD.dtype)
        return self.gather_home(rows_RD, route, fp8=fp8)

    def _exchange(self, rows: torch.Tensor, in_splits, out_splits) -> torch.Tensor:
        if self.group is None:
            return rows
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), list(out_splits), list(in_splits), group=self.group)
        return out

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        check_dispatch_args(x_TD, topk_idx_TK, topk_weights_TK)
        if self.group is None:
            assert_routes_async(topk_idx_TK, self.num_experts)
        with torch.no_grad():
            route, local_idx_RK, x_RD, weights_RK = self.move_tokens(x_TD, topk_idx_TK, topk_weights_TK)
        capacity = max_rows(*local_idx_RK.shape, self.num_local_experts, self.alignment)
        layout = expert_layout(local_idx_RK, self.num_local_experts, alignment=self.alignment, num_rows=capacity)
        if route.splits.layout_rows is not None:  # trimmed to the rows in use, known from the counts' exchange
            layout = dataclasses.replace(layout, src_P=layout.src_P[:route.splits.layout_rows])
        route = dataclasses.replace(route, layout=layout)
        x_PD, recv_weights_RK = DispatchFn.apply(x_TD, topk_weights_TK, expand_rows(x_RD, layout), weights_RK, route,
                                                 self)
        return x_PD, layout, DispatchHandle(route=route, recv_weights_RK=recv_weights_RK)

    def move_tokens(self, x_TD, topk_idx_TK, topk_weights_TK):
        """Moves each token once to every rank of its experts. Returns the route (without a
        layout), the received rows' routes to local experts ([R, K], -1 elsewhere), the rows
        ([R, D], or ``Fp8Rows`` / ``Fp4Rows`` as ``dispatch_format`` says) and their weights
        ([R, K], 0 elsewhere). Not differentiable."""
        idx_TK = topk_idx_TK.long()
        if self.group is None:
            return self._stay(x_TD, idx_TK, topk_weights_TK)
        world, e_local = self.world, self.num_local_experts
        dest_TK = torch.where(idx_TK >= 0, idx_TK // e_local, -1)
        goes_WT = (dest_TK[None] == torch.arange(world, device=x_TD.device)[:, None, None]).any(-1)
        # The one host sync: each peer learns the rows it gets from this rank, their routes per
        # expert of its own (its layout's rows, without reading them back) and whether this rank's
        # routes are bad, so that every rank raises rather than waits for one that did.
        stats = route_stats(idx_TK)
        in_range_R = torch.where((idx_TK >= 0) & (idx_TK < self.num_experts), idx_TK, self.num_experts).flatten()
        routes_E = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x_TD.device)
        routes_E.scatter_add_(0, in_range_R, torch.ones_like(in_range_R))  # bincount would read its size back
        # A peer's row: the rows it sends here, its routes to each expert of this rank, its bad flag.
        width = e_local + 2
        counts_WX = torch.cat([goes_WT.sum(1, keepdim=True), routes_E[:-1].view(world, e_local),
                               routes_invalid(stats, self.num_experts).long().expand(world, 1)], 1)
        recv_WX = self._exchange(counts_WX, [1] * world, [1] * world)
        host = torch.cat([stats, counts_WX[:, 0], recv_WX.flatten()]).tolist()
        raise_for_routes(idx_TK, host[:3], self.num_experts)
        send, received = host[3:3 + world], host[3 + world:]
        peers = [received[w * width:(w + 1) * width] for w in range(world)]
        if any(row[-1] for row in peers):
            raise ValueError(f"topk_idx_TK: EP ranks {[w for w, row in enumerate(peers) if row[-1]]} of this group "
                             "dispatched invalid routes (their errors say which); every rank stops")
        received_E = [sum(col) for col in zip(*(row[1:-1] for row in peers))]
        splits = RowSplits(send=tuple(send), recv=tuple(row[0] for row in peers),
                           layout_rows=sum(-(-n // self.alignment) * self.alignment for n in received_E))
        dest_S, send_token_S = torch.nonzero_static(goes_WT, size=sum(send)).unbind(1)
        mine_SK = dest_TK[send_token_S] == dest_S[:, None]
        local_idx_SK = torch.where(mine_SK, idx_TK[send_token_S] - dest_S[:, None] * e_local, -1)
        local_idx_RK = self._exchange(local_idx_SK, splits.send, splits.recv)
        route = TokenRoute(send_token_S=send_token_S, home_TW=home_rows(dest_S, send_token_S, x_TD.shape[0], world),
                           splits=splits, layout=None, num_tokens=x_TD.shape[0])
        weights_RK = torch.where(local_idx_RK >= 0, self.scatter(topk_weights_TK, route), 0.0)
        return route, local_idx_RK, self._send_tokens(x_TD, route), weights_RK

    def _stay(self, x_TD, idx_TK, weights_TK):
        """``move_tokens`` when every expert is local: each token is its own received row."""
        num_tokens = x_TD.shape[0]
        tokens_T = torch.arange(num_tokens, dtype=torch.int32, device=x_TD.device)
        route = TokenRoute(send_token_S=tokens_T.long(), home_TW=tokens_T[:, None],
                           splits=RowSplits(send=(num_tokens,), recv=(num_tokens,)), layout=None,
                           num_tokens=num_tokens)
        weights_RK = torch.where(idx_TK >= 0, weights_TK, 0.0)
        return route, idx_TK, self._send_tokens(x_TD, route), weights_RK

    def _send_tokens(self, x_TD: torch.Tensor, route: TokenRoute) -> torch.Tensor | Fp8Rows | Fp4Rows:
        """The tokens' rows at the ranks of their experts; as FP8 e4m3 with per-token 1x128 scales
        travelling alongside (``dispatch_format`` "e4m3"), or as FP4 e2m1 bytes with their e4m3
        scales and per-token scales ("e2m1"): cast once per token, before the rows are copied;
        cast back where they are expanded."""
        if self.dispatch_format == "bf16":
            return self.scatter(x_TD, route)
        if self.dispatch_format == "e2m1":
            q_TH, sf_TG, gsf_T = per_token_cast_fp4_e4m3_sf(x_TD, group=FP4_GROUP)
            sf_RG = self.scatter(sf_TG.view(torch.uint8), route).view(torch.float8_e4m3fn)
            return Fp4Rows(q_RH=self.scatter(q_TH, route), sf_RG=sf_RG, gsf_R=self.scatter(gsf_T, route),
                           dtype=x_TD.dtype)
        q_TD, sf_TG = per_token_cast(x_TD, group=FP8_GROUP)
        q_RD = self.scatter(q_TD.view(torch.uint8), route).view(torch.float8_e4m3fn)
        return Fp8Rows(q_RD=q_RD, sf_RG=self.scatter(sf_TG, route), dtype=x_TD.dtype)

    def combine(self, y_PD, handle: DispatchHandle):
        check_combine_args(y_PD, handle)
        return CombineFn.apply(y_PD, handle.recv_weights_RK, handle.route, self, self.fp8_combine)
