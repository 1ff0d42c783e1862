"""The ``nvlink`` backend: tokens stored straight into peers' receive buffers in a symmetric heap,
with no host synchronization.

Every rank's heap holds, per transport call, one receive region of ``W * T_max`` rows: block ``w``
(rows ``[w * T_max, (w + 1) * T_max)``) is written only by rank w. A sender therefore knows where
each of its tokens lands without asking anyone (the token's slot among the sender's tokens bound
for that rank, a prefix sum on the device), writes it there once per destination rank
(``kernels.comm.put_rows``: one read, up to W stores), writes its per-destination counts, and
one barrier on the stream makes everything visible. Sizes are static (``T_max``, the worst case
of a layout over ``W * T_max`` rows), so nothing waits on the host and a CUDA graph can capture
the steady state. Calls alternate between two halves of the heap: a rank may write call n + 1's
rows while a peer still reads call n's, never call n - 1's (every rank read those before it
entered call n's barrier).

Dispatch moves, in one barrier, each token's row (FP8 with its scales when ``fp8``) and its
routes and router weights; the receiver builds its experts' layout from the routes in the blocks'
first ``count`` rows. Combine reduces each received row over its local experts
(``weighted_reduce``), puts it back into block ``me`` of its home rank at the row it came from,
and the home rank sums its blocks' rows per token (``weighted_reduce`` with unit weights, in rank
order, float32).

Overflow is never silent: a rank that dispatches more than ``max_tokens_per_rank`` tokens raises
before anything moves (a shape check, no sync), naming itself and the limit.

Shape letters: T tokens (<= T_max), K routes, D hidden, W EP ranks, R = W * T_max received rows,
P layout rows, G FP8 scale groups, M metadata words per row (K expert ids, K weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.comm import PeerRegion, put_rows
from kernels.permute import ExpertLayout, expert_layout, max_rows
from kernels.quant import cast_back, per_token_cast
from kernels.reduce import weighted_reduce
from kernels.validate import check_positive

from .autograd import CombineFn, DispatchFn
from .protocol import DispatchHandle, check_combine_args, check_dispatch_args
from .symmetric import SymmetricHeap, aligned, make_heap

FP8_GROUP = 128


@dataclass(frozen=True)
class PeerRoute:
    """Where ``NVLinkDispatcher.dispatch`` put each row; read-only.

    Attributes:
        dest_TW: int32, the row of rank w's receive region that token t went to, -1 if none.
        back_RW: int32, for received row r (from rank w, not past its count): the row of rank w's
            region it returns to, -1 in the other columns and for unused rows.
        home_TW: int32, where token t's row from rank w comes back in this rank's region, or -1.
        layout: the local experts' layout over the R received rows (``pos_TK`` is [R, K]).
        num_tokens: T.
    """

    dest_TW: torch.Tensor
    back_RW: torch.Tensor
    home_TW: torch.Tensor
    layout: ExpertLayout
    num_tokens: int


class NVLinkDispatcher:
    """Dispatch/combine through a symmetric heap over ``group`` (GPUs of one NVLink domain, or CPU
    processes of one host). Experts are placed contiguously, as in ``AllToAllDispatcher``."""

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup, device: torch.device, max_tokens_per_rank: int,
                 alignment: int = 128, fp8: bool = False):
        self.group, self.device = group, device
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts: expected a multiple of the EP size {self.world}, got {num_experts}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world
        self.max_tokens = check_positive("max_tokens_per_rank", max_tokens_per_rank)
        self.alignment = check_positive("alignment", alignment)
        self.fp8 = fp8
        self.heap: SymmetricHeap | None = None
        self.calls = 0  # transport calls so far: which half of the heap the next one uses
        self.ranks_W = torch.arange(self.world, dtype=torch.int32, device=device)

    @property
    def num_recv_rows(self) -> int:
        return self.world * self.max_tokens

    # The transport: regions of one half of the heap, filled by put_rows, then one barrier.
    def _regions(self, *widths: tuple[int, int, torch.dtype]) -> list[PeerRegion]:
        """One region per ``(rows, width, dtype)`` in the half of the heap this call uses."""
        sizes = [aligned(rows * width * dtype.itemsize) for rows, width, dtype in widths]
        half = sum(sizes)
        if self.heap is None or self.heap.nbytes < 2 * half:
            # Every rank asks for the same size at the same call (it depends on shapes all ranks
            # share), so this collective allocation stays in step.
            self.heap = make_heap(2 * half, self.group, self.device)
        offset = (self.calls % 2) * (self.heap.nbytes // 2)
        self.calls += 1
        regions = []
        for (rows, width, dtype), size in zip(widths, sizes):
            regions.append(self.heap.region(offset, (rows, width), dtype))
            offset += size
        return regions

    def scatter(self, rows_TX: torch.Tensor, route: PeerRoute) -> torch.Tensor:
        (region,) = self._regions((self.num_recv_rows, rows_TX.shape[1], rows_TX.dtype))
        put_rows(rows_TX.contiguous(), route.dest_TW, region)
        self.heap.barrier()
        return region.views[self.rank]

    def gather_home(self, rows_RX: torch.Tensor, route: PeerRoute) -> torch.Tensor:
        (region,) = self._regions((self.num_recv_rows, rows_RX.shape[1], rows_RX.dtype))
        put_rows(rows_RX.contiguous(), route.back_RW, region)
        self.heap.barrier()
        ones_TW = torch.ones(route.home_TW.shape, dtype=torch.float32, device=rows_RX.device)
        return weighted_reduce(region.views[self.rank], route.home_TW, ones_TW)

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        check_dispatch_args(x_TD, topk_idx_TK, topk_weights_TK)
        num_tokens, topk = topk_idx_TK.shape
        if num_tokens > self.max_tokens:
            raise ValueError(f"x_TD: rank {self.rank} of the EP group dispatches {num_tokens} tokens, more than the "
                             f"{self.max_tokens} its peers' receive buffers hold (model.moe.max_tokens_per_rank)")
        with torch.no_grad():
            route, x_RD, weights_RK = self.move_tokens(x_TD, topk_idx_TK, topk_weights_TK)
        x_PD, recv_weights_RK = DispatchFn.apply(x_TD, topk_weights_TK, x_RD, weights_RK, route, self)
        return x_PD, route.layout, DispatchHandle(route=route, recv_weights_RK=recv_weights_RK)

    def move_tokens(self, x_TD, topk_idx_TK, topk_weights_TK):
        """Moves tokens, routes and weights in one barrier; plans the way back. Returns the route
        (with the local experts' layout), the received rows ([R, D], x's dtype; a view of the
        heap, valid until the next transport call) and their weights to local experts ([R, K]).
        Not differentiable."""
        world, t_max, e_local, me = self.world, self.max_tokens, self.num_local_experts, self.rank
        idx_TK, weights_TK = topk_idx_TK.to(torch.int32), topk_weights_TK
        num_tokens, topk = idx_TK.shape
        d = x_TD.shape[1]

        # Where each token goes: its slot among this rank's tokens bound for rank w.
        dest_TK = torch.where(idx_TK >= 0, idx_TK // e_local, -1)
        goes_WT = (dest_TK[None] == self.ranks_W[:, None, None]).any(2)
        goes_TW = goes_WT.T
        # The scan runs along the contiguous axis: torch's scan down the outer one of [T, W] is
        # 50x slower (225 us at T = 4096 on an H200).
        slot_TW = (goes_WT.cumsum(1, dtype=torch.int32) - goes_WT.int()).T
        dest_TW = torch.where(goes_TW, me * t_max + slot_TW, -1).contiguous()
        count_W1 = goes_TW.sum(0, dtype=torch.int32)[:, None]

        meta_TM = torch.cat([idx_TK, weights_TK.view(torch.int32)], 1)
        if self.fp8:
            q_TD, sf_TG = per_token_cast(x_TD, group=FP8_GROUP)
            payload = [(q_TD.view(torch.uint8), torch.uint8), (sf_TG, torch.float32)]
        else:
            payload = [(x_TD, x_TD.dtype)]
        regions = self._regions((world, 1, torch.int32), (self.num_recv_rows, 2 * topk, torch.int32),
                                *((self.num_recv_rows, rows.shape[1], dtype) for rows, dtype in payload))
        counts, meta, *data = regions
        put_rows(count_W1, torch.where(torch.eye(world, dtype=torch.bool, device=x_TD.device), me, -1), counts)
        put_rows(meta_TM, dest_TW, meta)
        for (rows, _), region in zip(payload, data):
            put_rows(rows.contiguous(), dest_TW, region)
        self.heap.barrier()

        # What arrived: block w's first count[w] rows.
        row_R = torch.arange(t_max, dtype=torch.int32, device=x_TD.device).repeat(world)
        valid_R = row_R < counts.views[me][:, 0].repeat_interleave(t_max)
        meta_RM = meta.views[me]
        idx_RK, recv_weights_RK = meta_RM[:, :topk], meta_RM[:, topk:].view(torch.float32)
        local_RK = valid_R[:, None] & (idx_RK >= 0) & (idx_RK // e_local == me)
        local_idx_RK = torch.where(local_RK, idx_RK - me * e_local, -1)
        layout = expert_layout(local_idx_RK, e_local, alignment=self.alignment,
                               num_rows=max_rows(self.num_recv_rows, min(topk, e_local), e_local, self.alignment))
        if self.fp8:
            x_RD = cast_back(data[0].views[me].view(torch.float8_e4m3fn), data[1].views[me], block=(1, FP8_GROUP),
                             out_dtype=x_TD.dtype)
        else:
            x_RD = data[0].views[me]

        # The way back: received row (w, i) returns to row me * T_max + i of rank w's region, and
        # token t's row from rank w arrives at row w * T_max + slot.
        src_R = torch.arange(world, dtype=torch.int32, device=x_TD.device).repeat_interleave(t_max)
        back_RW = torch.where(valid_R[:, None] & (src_R[:, None] == self.ranks_W), me * t_max + row_R[:, None], -1)
        home_TW = torch.where(goes_TW, self.ranks_W * t_max + slot_TW, -1).contiguous()
        route = PeerRoute(dest_TW=dest_TW, back_RW=back_RW, home_TW=home_TW, layout=layout, num_tokens=num_tokens)
        return route, x_RD, torch.where(local_RK, recv_weights_RK, 0.0)

    def combine(self, y_PD, handle: DispatchHandle):
        check_combine_args(y_PD, handle)
        return CombineFn.apply(y_PD, handle.recv_weights_RK, handle.route, self)
