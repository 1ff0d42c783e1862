"""The ``nvlink`` backend: tokens stored straight into peers' receive buffers in a symmetric heap,
with no host synchronization.

Every rank's heap holds, per transport call, one receive region of ``W * T_max`` rows: block ``w``
(rows ``[w * T_max, (w + 1) * T_max)``) is written only by rank w, token t at row ``w * T_max + t``.
A sender therefore knows where each of its tokens lands without asking anyone or scanning its
batch, writes it there once per destination rank (``kernels.comm.put_rows``: one read, up to W
stores), writes every token's routes and its token count to every rank (how a receiver tells the
rows this call wrote from older ones), and a barrier on the stream makes everything visible.
Sizes are static (``T_max``, the worst case of a layout over ``W * T_max`` rows), so nothing waits
on the host and a CUDA graph can capture the steady state. The experts' work stops at the rows in
use (``offsets_E[-1]``: expand, the SwiGLU, combine's backward), so a generous ``T_max`` costs
memory, not time, there; the passes over the ``W * T_max`` received rows (the FP8 cast back, the
weighted reduces, ``receive_layout``) still cost in proportion to it. Calls alternate between two
halves of the heap: a rank may write call n + 1's rows while a peer still reads call n's, never
call n - 1's (every rank read those before it entered call n's barriers).

Dispatch sends the routes beside the rows, on a stream of its own (``SideStream``):
``kernels.comm.put_routes`` (the way there and back, every token's routes and the count stored into
every rank, one launch), a barrier of its own channel (``ROUTES``) and the receiver's bookkeeping:
``kernels.comm.receive_layout`` (what each received row is, where it returns, and the local experts'
layout of the routes in the blocks' first ``count`` rows; a row whose routes name none of its
experts holds no data of this call), one launch for a small batch (``plan_receive`` and the layout's
four launches past 4096 received routes). Meanwhile the rows go: FP8 cast and stored in one kernel
(``kernels.comm.put_tokens``) when ``fp8``, ``put_rows`` otherwise (once ``put_routes`` wrote
``dest_TW``), then the rows' barrier (``ROWS``); the receiver dequantizes the FP8 rows straight into
the layout (``expand_cast_back``). FP8 rows into small receive buffers (``small_buffers``: up to
4096 routes, ``W * max_tokens_per_rank * topk``) skip the bookkeeping beside: one launch stores the
routes with the rows (``kernels.comm.put_tokens_and_routes``; FP8 rows a two-stage route forwards
still send their routes beside, and the side stream joins first), one barrier publishes both, then
one launch
(``kernels.comm.receive_expand``) lays the routes out in every CTA and dequantizes the rows into
place, so the layout's one-CTA latency chain no longer runs between the barrier and the rows.
Kernels on one stream may launch while the one before them finishes (programmatic dependent launch,
``kernels.pdl``). Combine reduces each row received from a peer over its local experts and stores it
straight into block ``me`` of its home rank at the row it came from (``kernels.comm.reduce_put``);
then the home rank reduces its own rows and sums each token's rows in rank order, float32, in one
pass (``kernels.reduce.reduce_sum_home``: the bits of storing its own row home too and summing with
``weighted_reduce``'s unit weights). Between them is the heap's barrier, which ``reduce_sum_home``
passes itself for small buffers where the kernels take one (``SymmetricHeap.signal``): it signals
every peer as it starts and waits for their signals only after reducing its own rows, which hides
the signals' flight. With ``fp8_combine`` the rows bound for the peers travel as e4m3 with per-token
1x128 scales, cast in the same pass as their reduce, and are dequantized in the home sum (half the
link's bytes).

On GPUs a process's heaps go over one set of ranks only (``symmetric.CudaHeap``: torch 2.11's
symmetric memory breaks on a second), so a process runs nvlink over one EP group (and its lanes),
or reserves its groups' heaps up front in one pool (``reserve_heaps``).

Overflow is never silent: a rank that dispatches more than ``max_tokens_per_rank`` tokens raises
before anything moves (a shape check, no sync), naming itself and the limit.

Shape letters: T tokens (<= T_max), K routes, D hidden, W EP ranks, R = W * T_max received rows,
P layout rows, G FP8 scale groups, M metadata words per row (K expert ids, K weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.comm import (PeerRegion, RouteRegions, TokenRegions, put_routes, put_rows, put_tokens,
                          put_tokens_and_routes, receive_expand, receive_expand_fits, receive_layout, receive_rows,
                          reduce_put)
from kernels.permute import ExpertLayout
from kernels.reduce import reduce_sum_home
from kernels.validate import check_positive

from .all_to_all import sum_home
from .autograd import FP8_GROUP, CombineFn, DispatchFn, Fp8Rows, expand_rows
from .protocol import Dispatcher, DispatchHandle, check_combine_args, check_dispatch_args, local_experts
from ..streams import SideStream
from .symmetric import PooledHeap, SymmetricHeap, aligned, make_heap, reserve_pool

ROWS, ROUTES = 0, 1  # barrier channels: the rows' (every transport call's), and the routes' beside them


@dataclass(frozen=True)
class PeerRoute:
    """Where ``NVLinkDispatcher.dispatch`` put each row; read-only.

    Attributes:
        dest_TW: int32, the row of rank w's receive region that token t went to, -1 if none.
        back_RW: int32, for received row r (from rank w, with a route to this rank): the row of rank
            w's region it returns to, -1 in the other columns and for other rows.
        home_TW: int32, where token t's row from rank w comes back in this rank's region, or -1.
        layout: the local experts' layout over the R received rows (``pos_TK`` is [R, K]).
        num_tokens: T.
    """

    dest_TW: torch.Tensor
    back_RW: torch.Tensor
    home_TW: torch.Tensor
    layout: ExpertLayout
    num_tokens: int


def node_sizes(cfg, ctx) -> dict:
    """The ``nvlink`` backends' constructor settings from ``model.moe`` and the rank's device."""
    return dict(num_experts=cfg.num_experts, device=ctx.device, max_tokens_per_rank=cfg.max_tokens_per_rank,
                alignment=cfg.alignment, fp8=cfg.dispatch_format == "e4m3", fp8_combine=cfg.fp8_combine)


def reserve_heaps(dispatchers, *, hidden: int, topk: int, dtype: torch.dtype, over: dist.ProcessGroup,
                  device: torch.device) -> None:
    """Heaps for ``dispatchers`` (``NVLinkDispatcher`` s, over groups of different ranks: EP groups
    of several sizes in one process; a two-stage one's is its ``node``) reserved in one pool over
    ``over``, a group holding all their ranks (``symmetric.reserve_pool``), each heap sized for
    its dispatcher's largest call. Collective over ``over``: every rank of it calls this, with the
    same dispatchers in the same order as its groups' other ranks (possibly none), before any of
    them moves a token."""
    needs, seen = [], {}
    for d in dispatchers:
        if d.heap is not None:
            raise ValueError(f"dispatchers: expected dispatchers that have not moved tokens yet; one over ranks "
                             f"{dist.get_process_group_ranks(d.group)} already holds a heap")
        place = seen[d.group.group_name] = seen.get(d.group.group_name, -1) + 1
        needs.append((f"{d.group.group_name}/{place}", d.group, d.heap_bytes(hidden, topk, dtype)))
    heaps = reserve_pool(needs, over, device)
    for d, (key, _, _) in zip(dispatchers, needs):
        d.heap = heaps.get(key)


class NVLinkDispatcher(Dispatcher, name="nvlink"):
    """Dispatch/combine through a symmetric heap over ``group`` (GPUs of one NVLink domain, or CPU
    processes of one host). Experts are placed contiguously, as in ``AllToAllDispatcher``."""

    fp8_combine_capable = True

    @classmethod
    def from_config(cls, cfg, ctx):
        """Over the EP group; two-stage (``HierarchicalDispatcher``) when the group spans nodes."""
        if ctx.ep_rail_group is not None:  # registered by hierarchical.py, which builds on this class
            return Dispatcher.backends["hierarchical"].from_config(cfg, ctx)
        return cls(group=ctx.ep_group, **node_sizes(cfg, ctx))

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup, device: torch.device, max_tokens_per_rank: int,
                 alignment: int = 128, fp8: bool = False, fp8_combine: bool = False):
        self.group, self.device = group, device
        self.world, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.num_local_experts = num_experts, local_experts(num_experts, self.world)
        self.max_tokens = check_positive("max_tokens_per_rank", max_tokens_per_rank)
        self.alignment = check_positive("alignment", alignment)
        self.fp8, self.fp8_combine = fp8, fp8_combine
        self.heap: SymmetricHeap | None = None
        self._made: dict[tuple, list[PeerRegion]] = {}  # _regions' of the current heap
        self.calls = 0  # transport calls so far: which half of the heap the next one uses
        self.beside = SideStream(device, priority=-1)

    @property
    def num_recv_rows(self) -> int:
        return self.world * self.max_tokens

    def small_buffers(self, topk: int) -> bool:
        """Receive buffers whose routes one launch lays out (``kernels.comm.receive_expand_fits``:
        ``W * max_tokens_per_rank * topk`` up to 4096), where a dispatch and a combine take the
        small batch's path. Decided by the buffers' capacity, not by the tokens a call sends: a
        generous ``max_tokens_per_rank`` takes the large batch's path."""
        return receive_expand_fits(self.world, self.max_tokens, topk, self.num_local_experts)

    # The transport: regions of one half of the heap, filled by peer stores, then the barriers.
    def _regions(self, *widths: tuple[int, int, torch.dtype]) -> list[PeerRegion]:
        """One region per ``(rows, width, dtype)`` in the half of the heap this call uses (made
        once per heap, half and widths: a call's views of every rank's copy cost host time)."""
        half_index = self.calls % 2
        self.calls += 1
        key = (half_index, widths)
        if key in self._made:
            return self._made[key]
        sizes = [aligned(rows * width * dtype.itemsize) for rows, width, dtype in widths]
        if self.heap is None or self.heap.nbytes < 2 * sum(sizes):
            if isinstance(self.heap, PooledHeap):  # reserve_heaps': sized for the largest call, never made again
                raise RuntimeError(f"a transport call needs {2 * sum(sizes)} bytes of heap, more than the "
                                   f"{self.heap.nbytes} reserve_heaps reserved (heap_bytes: hidden, topk or dtype "
                                   "larger than the calls')")
            # Every rank asks for the same size at the same call (it depends on shapes all ranks
            # share), so this collective allocation stays in step.
            self.heap, self._made = make_heap(2 * sum(sizes), self.group, self.device), {}
        offset = half_index * (self.heap.nbytes // 2)
        regions = []
        for (rows, width, dtype), size in zip(widths, sizes):
            regions.append(self.heap.region(offset, (rows, width), dtype))
            offset += size
        self._made[key] = regions
        return regions

    def heap_bytes(self, hidden: int, topk: int, dtype: torch.dtype) -> int:
        """The heap this dispatcher's largest transport call takes, for rows of ``hidden``
        values of ``dtype`` (activations and their gradients) and ``topk`` routes a token: both
        halves of dispatch's counts, routes and rows (FP8 or not), combine's rows, or the
        backward's rows and weights."""
        rows = self.num_recv_rows
        fp8 = [(rows, hidden, torch.uint8), (rows, -(-hidden // FP8_GROUP), torch.float32)]
        plain = [(rows, hidden, dtype)]
        routes = [(self.world, 1, torch.int32), (rows, 2 * topk, torch.int32)]
        calls = [routes + fp8, routes + plain, fp8, plain, [(rows, topk, torch.float32)]]
        return max(2 * sum(aligned(r * w * t.itemsize) for r, w, t in call) for call in calls)

    def _mine(self, region: PeerRegion, *view) -> torch.Tensor:
        """This rank's copy of ``region`` (``.view(*view)`` of it), made once per region: a call's
        views cost host time, and a region's tensors never change."""
        own = region.views[self.ep_rank]
        return region.kept(("mine", self.ep_rank, view), lambda: own.view(*view) if view else own)

    @staticmethod
    def _pair(kind: type, first: PeerRegion, second: PeerRegion):
        """``kind(first, second)`` (``TokenRegions``, ``RouteRegions``), made once per pair of regions:
        the kernel ops prepare their launches once per region they are given."""
        return first.kept((kind, second), lambda: kind(first, second))

    def scatter(self, rows_TX: torch.Tensor, route: PeerRoute) -> torch.Tensor:
        (region,) = self._regions((self.num_recv_rows, rows_TX.shape[1], rows_TX.dtype))
        put_rows(rows_TX.contiguous(), route.dest_TW, region)
        self.heap.barrier(ROWS)
        return region.views[self.ep_rank]

    def gather_home(self, rows_RX: torch.Tensor, route: PeerRoute) -> torch.Tensor:
        (region,) = self._regions((self.num_recv_rows, rows_RX.shape[1], rows_RX.dtype))
        put_rows(rows_RX.contiguous(), route.back_RW, region)
        self.heap.barrier(ROWS)
        return sum_home(region.views[self.ep_rank], route.home_TW)

    def reduce_home(self, y_PD: torch.Tensor, weights_RK: torch.Tensor, route: PeerRoute, *,
                    fp8: bool = False) -> torch.Tensor:
        """Each peer's row reduced over the local experts and stored straight into its home rank's
        region (``kernels.comm.reduce_put``; as e4m3 rows and scales when ``fp8``); then this
        rank's own rows reduced into the sum of those that came back, behind the barrier
        (``kernels.reduce.reduce_sum_home``): the own rows cost one pass, not a store and a re-read.
        With small receive buffers the home sum passes the barrier itself, its own rows reduced
        before it waits for the peers."""
        rows, hidden = self.num_recv_rows, y_PD.shape[1]
        if fp8:
            q, sf = self._regions((rows, hidden, torch.uint8), (rows, -(-hidden // FP8_GROUP), torch.float32))
            region = self._pair(TokenRegions, q, sf)
            returned, scales = self._mine(q, torch.float8_e4m3fn), self._mine(sf)
        else:
            (region,) = self._regions((rows, hidden, y_PD.dtype))
            returned, scales = self._mine(region), None
        pos_RK = route.layout.pos_TK
        # With small buffers reduce_sum_home passes the barrier itself where the kernels take one: it
        # signals as it starts and waits for the peers only after reducing its own rows (with large
        # ones it would load the returned rows only after its own, and lose more than the barrier).
        signal = self.heap.signal() if self.small_buffers(pos_RK.shape[1]) else None
        reduce_put(y_PD, pos_RK, weights_RK, route.back_RW, region, skip_rank=self.ep_rank, group=FP8_GROUP)
        if signal is None:
            self.heap.barrier(ROWS)
        own = slice(self.ep_rank * self.max_tokens, self.ep_rank * self.max_tokens + route.num_tokens)
        return reduce_sum_home(y_PD, pos_RK[own], weights_RK[own], returned, route.home_TW, rank=self.ep_rank,
                               sf_SG=scales, group=FP8_GROUP, signal=signal)

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        check_dispatch_args(x_TD, topk_idx_TK, topk_weights_TK)  # the routes' values: put_routes checks them
        num_tokens, topk = topk_idx_TK.shape
        if num_tokens > self.max_tokens:
            raise ValueError(f"x_TD: rank {self.ep_rank} of the EP group dispatches {num_tokens} tokens, more than the "
                             f"{self.max_tokens} its peers' receive buffers hold (model.moe.max_tokens_per_rank)")
        with torch.no_grad():
            route, x_PD, weights_RK = self.move_tokens(x_TD, topk_idx_TK, topk_weights_TK, expand=True)
        x_PD, recv_weights_RK = DispatchFn.apply(x_TD, topk_weights_TK, x_PD, weights_RK, route, self)
        return x_PD, route.layout, DispatchHandle(route=route, recv_weights_RK=recv_weights_RK)

    def move_tokens(self, x_TD, topk_idx_TK, topk_weights_TK, *, expand: bool = False):
        """Moves tokens, routes and weights (the routes beside the rows, on two streams, each behind
        a barrier of its own, or both behind one for a small FP8 batch laid out in one launch);
        plans the way back. ``x_TD`` is [T, D],
        or ``Fp8Rows`` (sent as they are: the rows a two-stage route's rail received). Returns the
        route (with the local experts' layout), the received rows ([R, D] in x's dtype, or
        ``Fp8Rows`` when they travelled as FP8; views of the heap, valid until the next transport
        call), or with ``expand`` the rows in the local experts' layout ([P, D] in the tokens'
        dtype), and their weights to local experts ([R, K]). Not differentiable."""
        world, t_max, e_local, me = self.world, self.max_tokens, self.num_local_experts, self.ep_rank
        num_tokens, topk = topk_idx_TK.shape
        if not topk:
            raise ValueError(f"topk_idx_TK: expected at least one route a token (the receive buffers hold rows by "
                             f"routes), got shape {tuple(topk_idx_TK.shape)}")
        fp8 = self.fp8 or isinstance(x_TD, Fp8Rows)
        hidden = (x_TD.q_RD if isinstance(x_TD, Fp8Rows) else x_TD).shape[1]
        widths = [(hidden, torch.uint8), (-(-hidden // FP8_GROUP), torch.float32)] if fp8 else [(hidden, x_TD.dtype)]
        regions = self._regions((world, 1, torch.int32), (self.num_recv_rows, 2 * topk, torch.int32),
                                *((self.num_recv_rows, width, dtype) for width, dtype in widths))
        counts, meta, *data = regions
        # The routes go beside the rows (their stores need nothing of the rows'). A small batch's FP8
        # rows are laid out and dequantized in one launch once both have arrived, behind one
        # barrier on this stream (kernels.comm.receive_expand: the layout costs no launch, and no
        # wait across streams, of its own there). Otherwise the routes go ahead, behind a barrier of
        # their own, and the receivers lay them out while the rows travel: what arrived is rank w's
        # routes in block w's first count[w] rows (data where they name our experts).
        fused = expand and fp8 and self.small_buffers(topk)
        route_regions = self._pair(RouteRegions, meta, counts)
        one_launch = fused and not isinstance(x_TD, Fp8Rows)
        if one_launch:  # tokens and routes in one launch, one stream
            dest_TW, home_TW = put_tokens_and_routes(x_TD, topk_idx_TK, topk_weights_TK,
                                                     self._pair(TokenRegions, *data), route_regions,
                                                     num_local_experts=e_local, rank=me, group=FP8_GROUP)
        else:
            rows_by_routes = not fp8 or isinstance(x_TD, Fp8Rows)  # put_rows goes by put_routes' dest_TW
            with self.beside:
                dest_TW, home_TW = put_routes(topk_idx_TK, topk_weights_TK, route_regions, num_local_experts=e_local,
                                              rank=me)
                planned = self.beside.mark() if rows_by_routes else None
                if not fused:
                    self.heap.barrier(ROUTES)
                    recv, layout = receive_layout(self._mine(meta), self._mine(counts, -1), num_local_experts=e_local,
                                                  rank=me, max_tokens=t_max, alignment=self.alignment,
                                                  num_rows=receive_rows(world, t_max, topk, e_local, self.alignment))
            if rows_by_routes:
                self.beside.wait(planned)
                rows = [x_TD.q_RD.view(torch.uint8), x_TD.sf_RG] if fp8 else [x_TD]
                for rows_TX, region in zip(rows, data):
                    put_rows(rows_TX.contiguous(), dest_TW, region)
            else:  # cast and stored in one pass (kernels.comm.put_tokens)
                put_tokens(x_TD, topk_idx_TK, self._pair(TokenRegions, *data), num_local_experts=e_local,
                           rank=me, group=FP8_GROUP)
        if fused and not one_launch:  # one barrier publishes the routes and the rows
            self.beside.join()
        self.heap.barrier(ROWS)
        if not fused:
            self.beside.join()

        if fp8:
            x_RD = Fp8Rows(q_RD=self._mine(data[0], torch.float8_e4m3fn), sf_RG=self._mine(data[1]), dtype=x_TD.dtype)
        else:
            x_RD = self._mine(data[0])
        if fused:
            recv, layout, x_PD = receive_expand(self._mine(meta), self._mine(counts, -1), x_RD.q_RD, x_RD.sf_RG,
                                                num_local_experts=e_local, rank=me, max_tokens=t_max,
                                                alignment=self.alignment, group=FP8_GROUP, out_dtype=x_RD.dtype)
        elif expand:
            x_PD = expand_rows(x_RD, layout)

        route = PeerRoute(dest_TW=dest_TW, back_RW=recv.back_RW, home_TW=home_TW, layout=layout,
                          num_tokens=num_tokens)
        return route, x_PD if expand else x_RD, recv.weights_RK

    def combine(self, y_PD, handle: DispatchHandle):
        check_combine_args(y_PD, handle)
        return CombineFn.apply(y_PD, handle.recv_weights_RK, handle.route, self, self.fp8_combine)
