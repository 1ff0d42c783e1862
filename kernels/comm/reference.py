"""Row copies into other ranks' memory, in plain PyTorch: the specification of the comm kernels.

A *peer region* is one buffer of the same shape and dtype on every rank of a group, each rank's
copy reachable from every other (symmetric memory: NVLink peer mappings on GPUs, shared memory
files between CPU processes, see ``ep_runtime.dispatch.symmetric``). ``PeerRegion.views[w]`` is
rank w's copy, seen from this rank.

Shape suffixes: N source rows, W ranks, X row width (elements), M rows of the destination region.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.permute.reference import ExpertLayout, expert_layout, max_rows
from kernels.permute.reference import expand_cast_back
from kernels.quant.reference import per_token_cast
from kernels.reduce.reference import weighted_reduce
from kernels.validate import check_routes, check_tensor


@dataclass(frozen=True, eq=False)
class PeerRegion:
    """Rank w's copy of one symmetric buffer region at ``views[w]`` (all ``[M, X]``, one dtype).

    ``delta_W`` (int64, on the views' device) is each copy's address minus ``views[0]``'s, in
    units of ``unit`` bytes: how a kernel that takes only ``views[0]`` reaches the others (every
    copy lies at the same offset of its rank's heap, as in an NVSHMEM symmetric heap)."""

    views: tuple[torch.Tensor, ...]
    delta_W: torch.Tensor | None = field(default=None)
    unit: int = 16
    # what is made of the region once (``kept``): a region is made once per heap and given to every
    # transport call, whose host time is the eager limit
    _kept: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def world(self) -> int:
        return len(self.views)

    def kept(self, key, make):
        """``make()``, made on the first call with ``key`` and kept with the region (its views as a
        kernel takes them, checked: ``put_rows_kernel.peer_copy``; a rank's own copy)."""
        found = self._kept.get(key)
        if found is None:
            found = self._kept[key] = make()
        return found


def put_rows(src_NX: torch.Tensor, dest_NW: torch.Tensor, region: PeerRegion) -> None:
    """Copies row n of ``src_NX`` to row ``dest_NW[n, w]`` of rank w's copy of ``region``, for
    every w where that entry is not -1 (each source row is read once and written to up to W ranks).

    Args:
        src_NX: [N, X] rows, the region's dtype and width, on its device.
        dest_NW: [N, W] int32 or int64 destination rows in ``[0, M)``, -1 for none.
        region: where the rows go. Rows no entry names are left as they were.
    """
    check_put_rows_args(src_NX, dest_NW, region)
    for w, view in enumerate(region.views):
        rows = (dest_NW[:, w] >= 0).nonzero().squeeze(1)
        view[dest_NW[rows, w].long()] = src_NX[rows]


@dataclass(frozen=True, eq=False)
class RouteRegions:
    """Where a dispatch's sender writes its routes, per rank: metadata rows ``meta`` [R, M] int32
    and each sender's token count ``counts`` [W, 1] int32 (R = W * T_max: block w of R is rank w's)."""

    meta: PeerRegion
    counts: PeerRegion


@dataclass(frozen=True, eq=False)
class TokenRegions:
    """Where FP8 rows go, per rank (a dispatch's tokens, or an FP8 combine's rows home): e4m3 rows
    ``q`` [R, D] (uint8 bits) and their float32 scales ``sf`` [R, ceil(D / group)]."""

    q: PeerRegion
    sf: PeerRegion


def put_routes(topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, regions: RouteRegions, *,
               num_local_experts: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`plan_send`, then token t's metadata row into row ``rank * T_max + t`` of every rank's
    ``meta`` and the token count T into row ``rank`` of every rank's ``counts``: what a receiver
    reads to know which rows of block ``rank`` this call wrote and what each one is (rows a token
    was not sent to are told apart by their routes). The routes go ahead of the rows
    (:func:`put_tokens`, or :func:`put_rows` of ``dest_TW``), so a receiver can lay them out while
    the rows travel.

    Args:
        topk_idx_TK, topk_weights_TK: the routes, as :func:`plan_send` takes them.
        regions: ``meta`` [W * T_max, 2K] and ``counts`` [W, 1] int32 copies (T <= T_max).
        num_local_experts, rank: as :func:`plan_send`'s.

    Returns:
        ``(dest_TW, home_TW)`` of :func:`plan_send`: the way there and back.
    """
    world = regions.counts.world
    max_tokens = regions.meta.views[0].shape[0] // world
    plan = plan_send(topk_idx_TK, topk_weights_TK, num_local_experts=num_local_experts, world=world, rank=rank,
                     max_tokens=max_tokens)
    num_tokens, device = topk_idx_TK.shape[0], topk_idx_TK.device
    rows_T = torch.arange(num_tokens, dtype=torch.int32, device=device) + rank * max_tokens
    put_rows(plan.meta_TM, rows_T[:, None].expand(num_tokens, world), regions.meta)
    count_rows_WW = torch.full((world, world), -1, dtype=torch.int32, device=device).fill_diagonal_(rank)
    put_rows(torch.full((world, 1), num_tokens, dtype=torch.int32, device=device), count_rows_WW, regions.counts)
    return plan.dest_TW, plan.home_TW


def put_tokens(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, regions: TokenRegions, *, num_local_experts: int,
               rank: int, group: int = 128) -> None:
    """Dispatch's rows in one pass: each token cast to e4m3 with per-token scales
    (:func:`kernels.quant.reference.per_token_cast`, 1 x ``group``) and put into row
    ``rank * T_max + t`` of every rank it goes to (``dest_TW`` of :func:`plan_send`).

    Args:
        x_TD: [T, D] float32, bfloat16 or float16 tokens.
        topk_idx_TK: [T, K] expert ids, as :func:`plan_send` takes them.
        regions: the two regions written (``R = W * T_max`` rows; T <= T_max).
        num_local_experts, rank: as :func:`plan_send`'s.
    """
    world = regions.q.world
    max_tokens = regions.q.views[0].shape[0] // world
    dest_TW, _ = token_rows(topk_idx_TK, num_local_experts=num_local_experts, world=world, rank=rank,
                            max_tokens=max_tokens)
    q_TD, sf_TG = per_token_cast(x_TD, group=group)
    put_rows(q_TD.view(torch.uint8), dest_TW, regions.q)
    put_rows(sf_TG, dest_TW, regions.sf)


def put_tokens_and_routes(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                          tokens: TokenRegions, routes: RouteRegions, *, num_local_experts: int, rank: int,
                          group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A small batch's send in one pass: :func:`put_routes` into ``routes`` and :func:`put_tokens`
    into ``tokens`` (regions of one heap). Returns ``put_routes``' ``(dest_TW, home_TW)``."""
    dest_TW, home_TW = put_routes(topk_idx_TK, topk_weights_TK, routes, num_local_experts=num_local_experts, rank=rank)
    put_tokens(x_TD, topk_idx_TK, tokens, num_local_experts=num_local_experts, rank=rank, group=group)
    return dest_TW, home_TW


def reduce_put(y_PD: torch.Tensor, pos_RK: torch.Tensor, weights_RK: torch.Tensor, dest_RW: torch.Tensor,
               region: PeerRegion | TokenRegions, *, skip_rank: int = -1, group: int = 128) -> None:
    """Combine's reduce and its transport in one pass: row r's routes reduced
    (:func:`kernels.reduce.reference.weighted_reduce`: float32 sums, in the region's dtype) and put
    into row ``dest_RW[r, w]`` of rank w's copy of ``region`` (:func:`put_rows`). With
    :class:`TokenRegions` (combine's FP8 transport) the rows are reduced in ``y_PD``'s dtype, then
    cast to e4m3 with per-token scales (:func:`kernels.quant.reference.per_token_cast`, 1 x
    ``group``): the bytes go to ``q``, the scales to ``sf``.

    Args:
        y_PD: [P, D] expert outputs, float32, bfloat16 or float16, on the region's device.
        pos_RK: [R, K] int32 or int64 rows of ``y_PD`` (-1: none); weights_RK: [R, K] float32.
        dest_RW: [R, W] int32 or int64 destination rows, -1 for none.
        region: ``[M, D]`` copies, one per rank; or ``TokenRegions`` of ``[M, D]`` uint8 and
            ``[M, ceil(D / group)]`` float32 copies.
        skip_rank: a rank whose rows are left out (as if its column of ``dest_RW`` were -1; the
            combine's home rank, which sums its own rows in with
            :func:`kernels.reduce.reference.reduce_sum_home`), -1 for none.
        group: columns per scale (``TokenRegions`` only).
    """
    rows = region.q if isinstance(region, TokenRegions) else region
    check_region(rows)
    check_tensor("dest_RW", dest_RW, dtype=(torch.int32, torch.int64), shape=(None, rows.world))
    check_skip_rank(skip_rank, rows.world)
    if skip_rank >= 0:
        dest_RW = dest_RW.clone()
        dest_RW[:, skip_rank] = -1
    if rows is region:
        put_rows(weighted_reduce(y_PD, pos_RK, weights_RK, out_dtype=region.views[0].dtype), dest_RW, region)
        return
    q_RD, sf_RG = per_token_cast(weighted_reduce(y_PD, pos_RK, weights_RK, out_dtype=y_PD.dtype), group=group)
    put_rows(q_RD.view(torch.uint8), dest_RW, region.q)
    put_rows(sf_RG, dest_RW, region.sf)


def check_skip_rank(skip_rank: int, world: int) -> None:
    if type(skip_rank) is not int or not -1 <= skip_rank < world:
        raise ValueError(f"skip_rank: expected -1 (none) or a rank below {world}, got {skip_rank}")


def check_region(region: PeerRegion) -> None:
    if not isinstance(region, PeerRegion) or not region.views:
        raise TypeError(f"region: expected a PeerRegion with one view per rank, got {region!r}")


def check_put_rows_args(src_NX: torch.Tensor, dest_NW: torch.Tensor, region: PeerRegion) -> None:
    check_region(region)
    first = region.views[0]
    check_tensor("src_NX", src_NX, ndim=2, dtype=first.dtype, device=first.device)
    if src_NX.shape[1] != first.shape[1]:
        raise ValueError(f"src_NX: expected rows of the region's width {first.shape[1]}, got shape {tuple(src_NX.shape)}")
    check_tensor("dest_NW", dest_NW, dtype=(torch.int32, torch.int64), shape=(src_NX.shape[0], region.world),
                 device=first.device)


@dataclass(frozen=True, eq=False)
class SendPlan:
    """Where a rank's tokens go in its peers' receive regions (block ``me`` of every region holds
    this rank's rows, token t at row ``me * T_max + t``; all int32).

    Attributes:
        dest_TW: row of rank w's region that token t goes to (``me * T_max + t``), -1 if none.
        home_TW: row of this rank's region where token t's row from rank w comes back
            (``w * T_max + t``), -1 if none.
        meta_TM: ``[T, 2K]``, each token's expert ids then its weights' float32 bits: what travels
            to every rank (:func:`put_routes`).
    """

    dest_TW: torch.Tensor
    home_TW: torch.Tensor
    meta_TM: torch.Tensor


@dataclass(frozen=True, eq=False)
class ReceivePlan:
    """What a rank received, from ``meta_RM`` (row ``w * T_max + t`` is token t of rank w, for t
    below ``count_W[w]``; rows past it are left from earlier calls).

    Attributes:
        local_idx_RK: int32, each row's routes to this rank's experts (local ids), -1 elsewhere and
            for unused rows.
        weights_RK: float32, their router weights, 0 where ``local_idx_RK`` is -1.
        back_RW: int32, row ``(w, t)`` with a route to this rank returns to row ``me * T_max + t``
            of rank w's region; -1 in the other columns and for rows without such a route (their
            token was not sent here, or the row is unused).
    """

    local_idx_RK: torch.Tensor
    weights_RK: torch.Tensor
    back_RW: torch.Tensor


def plan_send(topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *, num_local_experts: int, world: int,
              rank: int, max_tokens: int) -> SendPlan:
    """A token goes once to every rank holding one of its experts (expert e on rank
    ``e // num_local_experts``), always into the same row: its index t in block ``rank`` (no
    prefix sum, so a sender needs no pass over its batch before it stores).

    Args:
        topk_idx_TK: [T, K] int32 or int64 expert ids in ``[0, W * E_local)``, -1 for none, a
            token's experts distinct (checked: :func:`kernels.validate.check_routes`; they travel
            as int32).
        topk_weights_TK: [T, K] float32.
        num_local_experts, world, rank, max_tokens: E_local, W, this rank, T_max (>= T).
    """
    dest_TW, home_TW = token_rows(topk_idx_TK, num_local_experts=num_local_experts, world=world, rank=rank,
                                  max_tokens=max_tokens)
    check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=tuple(topk_idx_TK.shape),
                 device=topk_idx_TK.device)
    meta_TM = torch.cat([topk_idx_TK.to(torch.int32), topk_weights_TK.view(torch.int32)], 1)
    return SendPlan(dest_TW=dest_TW, home_TW=home_TW, meta_TM=meta_TM)


def token_rows(topk_idx_TK: torch.Tensor, *, num_local_experts: int, world: int, rank: int,
               max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`plan_send`'s ``(dest_TW, home_TW)``, from the ids alone."""
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int32, torch.int64), ndim=2)
    if topk_idx_TK.shape[0] > max_tokens:
        raise ValueError(f"topk_idx_TK: expected at most max_tokens={max_tokens} tokens, got {topk_idx_TK.shape[0]}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world} (the regions' ranks), got {rank}")
    check_routes(topk_idx_TK, world * num_local_experts)
    device, idx_TK = topk_idx_TK.device, topk_idx_TK.to(torch.int32)  # ids as they travel (receivers read these)
    ranks_W = torch.arange(world, dtype=torch.int32, device=device)
    token_T = torch.arange(idx_TK.shape[0], dtype=torch.int32, device=device)
    dest_TK = torch.where(idx_TK >= 0, idx_TK // num_local_experts, -1)
    goes_TW = (dest_TK[:, None, :] == ranks_W[None, :, None]).any(2)
    return (torch.where(goes_TW, rank * max_tokens + token_T[:, None], -1).int(),
            torch.where(goes_TW, ranks_W * max_tokens + token_T[:, None], -1).int())


def plan_receive(meta_RM: torch.Tensor, count_W: torch.Tensor, *, num_local_experts: int, rank: int,
                 max_tokens: int) -> ReceivePlan:
    """The receiving side of :func:`put_routes`: ``meta_RM`` [W * T_max, 2K] int32 as it arrived
    (unused rows hold anything), ``count_W`` [W] int32 each rank's T."""
    check_tensor("meta_RM", meta_RM, dtype=torch.int32, ndim=2)
    check_tensor("count_W", count_W, dtype=torch.int32, ndim=1, device=meta_RM.device)
    world, topk = count_W.shape[0], meta_RM.shape[1] // 2
    if meta_RM.shape[0] != world * max_tokens or meta_RM.shape[1] % 2:
        raise ValueError(f"meta_RM: expected shape ({world * max_tokens}, 2 * K), got {tuple(meta_RM.shape)}")
    device = meta_RM.device
    row_R = torch.arange(max_tokens, dtype=torch.int32, device=device).repeat(world)
    src_R = torch.arange(world, dtype=torch.int32, device=device).repeat_interleave(max_tokens)
    valid_R = row_R < count_W.repeat_interleave(max_tokens)
    idx_RK, weights_RK = meta_RM[:, :topk], meta_RM[:, topk:].view(torch.float32)
    local_RK = valid_R[:, None] & (idx_RK >= 0) & (idx_RK // num_local_experts == rank)
    ranks_W = torch.arange(world, dtype=torch.int32, device=device)
    return ReceivePlan(local_idx_RK=torch.where(local_RK, idx_RK - rank * num_local_experts, -1),
                       weights_RK=torch.where(local_RK, weights_RK, 0.0),
                       back_RW=torch.where(local_RK.any(1, keepdim=True) & (src_R[:, None] == ranks_W),
                                           rank * max_tokens + row_R[:, None], -1))


def receive_layout(meta_RM: torch.Tensor, count_W: torch.Tensor, *, num_local_experts: int, rank: int,
                   max_tokens: int, alignment: int, num_rows: int) -> tuple[ReceivePlan, ExpertLayout]:
    """A dispatch's receiving side: :func:`plan_receive`, then the local experts' layout of its
    routes (:func:`kernels.permute.reference.expert_layout` of ``local_idx_RK`` over
    ``num_local_experts`` experts, segments aligned to ``alignment``, ``num_rows`` rows)."""
    plan = plan_receive(meta_RM, count_W, num_local_experts=num_local_experts, rank=rank, max_tokens=max_tokens)
    return plan, expert_layout(plan.local_idx_RK, num_local_experts, alignment=alignment, num_rows=num_rows,
                               routes_per_token=min(plan.local_idx_RK.shape[1], num_local_experts))


def receive_rows(world: int, max_tokens: int, topk: int, num_local_experts: int, alignment: int) -> int:
    """P, a receiver's layout capacity: every one of the ``W * T_max`` received rows routed to
    ``min(K, E)`` local experts, plus each expert's padding (:func:`kernels.permute.max_rows`)."""
    return max_rows(world * max_tokens, min(topk, num_local_experts), num_local_experts, alignment)


def receive_expand(meta_RM: torch.Tensor, count_W: torch.Tensor, q_RD: torch.Tensor, sf_RG: torch.Tensor, *,
                   num_local_experts: int, rank: int, max_tokens: int, alignment: int, group: int = 128,
                   out_dtype: torch.dtype = torch.bfloat16) -> tuple[ReceivePlan, ExpertLayout, torch.Tensor]:
    """A dispatch's receiving side when its rows travelled as FP8: :func:`receive_layout` over
    :func:`receive_rows` rows, then the received rows (``q_RD`` [R, D] e4m3, ``sf_RG`` [R, ceil(D /
    group)] float32 per-token scales; unused rows hold anything) dequantized into that layout
    (:func:`kernels.permute.reference.expand_cast_back`). Returns ``(plan, layout, x_PD)``, ``x_PD``
    [P, D] in ``out_dtype``, unspecified past ``offsets_E[-1]``."""
    world, topk = count_W.shape[0], meta_RM.shape[1] // 2
    plan, layout = receive_layout(meta_RM, count_W, num_local_experts=num_local_experts, rank=rank,
                                  max_tokens=max_tokens, alignment=alignment,
                                  num_rows=receive_rows(world, max_tokens, topk, num_local_experts, alignment))
    return plan, layout, expand_cast_back(q_RD, sf_RG, layout, group=group, out_dtype=out_dtype)
