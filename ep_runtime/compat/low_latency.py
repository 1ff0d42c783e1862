"""The transport under the DeepEP facade's low-latency mode (``Buffer.low_latency_dispatch`` and
``low_latency_combine``): fixed-size messages, one ``all_to_all_single`` of equal splits each way,
so no count goes to the host and every shape follows from the arguments (no host sync).

Each route (token t to expert e) is one message: t's payload (bf16, or e4m3 and its 1x128 scales),
t, and e's local index. A rank sends every peer C = M * min(K, L) message slots (a token names at
most min(K, L) of one rank's experts): its routes to that peer first, by expert, then token, and
empty slots after them, marked by local expert -1. The receiver packs the rows by local expert,
source rank, token; DeepEP's layout, with its rank blocks in rank order where DeepEP's come in
arrival order. Combine sends each packed row back into the slot it came in by, and the home rank
sums the slots of a token's routes with the router weights. The fixed size is the price of no
host sync: every call moves W * C messages a rank each way, where DeepEP's kernels move the routes
only (W times DeepEP's bytes when every rank dispatches M tokens, K <= L).

Shape letters: T tokens, H hidden, K routes per token, E experts, L local experts, W ranks, M the
most tokens a rank dispatches, P = W * M packed rows per local expert, C message slots per peer,
G scale groups (H / 128), R routes (T * K), B message bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.quant import per_token_cast
from kernels.reduce import weighted_reduce
from kernels.validate import check_routes, check_tensor

FP8_GROUP = 128  # hidden columns per scale, as DeepEP's low-latency cast
_META_BYTES = 8  # the token index and the local expert, int32 each
_COUNT_BITS = 32  # layout_range holds (begin << 32) | count


@dataclass(frozen=True)
class LowLatencyDispatch:
    """What ``low_latency_dispatch`` returns, DeepEP's tensors by their names: ``recv_x``
    (``[L, P, H]`` bf16, or ``(e4m3 [L, P, H], scales [L, P, G] float32 or [L, P, G / 4] int32
    UE8M0 exponents packed 4 a word, the low byte first)``, the scales column-major in the last
    two dims), ``recv_count`` (``[L]`` int32: the valid rows of each expert, at the front),
    ``src_info`` (``[L, P]`` int32: each valid row's token index at its source, -1 past them) and
    ``layout_range`` (``[L, W]`` int64: ``begin << 32 | count`` of each source rank's rows)."""

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_count: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor


def check_dispatch_args(x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                        num_experts: int, world: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> None:
    """DeepEP's checks of a low-latency dispatch's arguments, each naming the argument."""
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0: expected round_scale=True with it (UE8M0 scales are powers of two), got False")
    check_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    tokens, hidden = x.shape
    if hidden % (4 * FP8_GROUP if use_fp8 else FP8_GROUP):
        raise ValueError(f"x: expected hidden a multiple of {4 * FP8_GROUP if use_fp8 else FP8_GROUP}"
                         f"{' with use_fp8' if use_fp8 else ''}, got {hidden}")
    if tokens > num_max_dispatch_tokens_per_rank:
        raise ValueError(f"x: expected at most num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank} "
                         f"tokens, got {tokens}")
    check_tensor("topk_idx", topk_idx, dtype=(torch.int64, torch.int32), shape=(tokens, None), device=x.device)
    if num_experts < 1 or num_experts % world:
        raise ValueError(f"num_experts: expected a positive multiple of the group size {world}, got {num_experts}")
    check_device_routes(topk_idx, num_experts)


def routes_ok(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A bool scalar tensor: every route in ``[-1, num_experts)`` and a token's experts distinct."""
    sorted_TK = topk_idx_TK.sort(dim=1).values
    repeated = (sorted_TK[:, 1:] == sorted_TK[:, :-1]) & (sorted_TK[:, 1:] >= 0)
    return ((topk_idx_TK >= -1) & (topk_idx_TK < num_experts)).all() & ~repeated.any()


def check_device_routes(topk_idx_TK: torch.Tensor, num_experts: int) -> None:
    """The routes a message slot needs (an id past the experts has no rank; a repeated expert
    overflows its slots): checked at the call on the CPU, by a device-side assert elsewhere, so a
    GPU dispatch stays free of host syncs (and capturable in a CUDA graph)."""
    if topk_idx_TK.device.type == "cpu":
        check_routes(topk_idx_TK, num_experts, name="topk_idx")
    else:
        torch._assert_async(routes_ok(topk_idx_TK, num_experts),
                            f"topk_idx: expected entries in [-1, {num_experts}) and distinct experts per token")


def slots_per_peer(num_max_dispatch_tokens_per_rank: int, num_topk: int, num_local_experts: int) -> int:
    return num_max_dispatch_tokens_per_rank * min(num_topk, num_local_experts)


def route_slots(topk_idx_TK: torch.Tensor, num_experts: int, world: int, capacity: int) -> torch.Tensor:
    """``slot_TK`` int64: each route's message slot among the ``world * capacity`` this rank
    sends (its rank's block, then its place there by expert and token), -1 for masked routes."""
    tokens, topk = topk_idx_TK.shape
    local = num_experts // world
    idx_TK = topk_idx_TK.long()
    valid_TK = idx_TK >= 0
    token_TK = torch.arange(tokens, device=idx_TK.device)[:, None]
    order = torch.where(valid_TK, idx_TK * tokens + token_TK, num_experts * tokens).flatten().argsort()
    place_TK = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    dest_TK = idx_TK.clamp(min=0) // local
    per_dest = torch.zeros(world + 1, dtype=torch.int64, device=idx_TK.device)
    per_dest.scatter_add_(0, torch.where(valid_TK, dest_TK, world).flatten(), torch.ones_like(order))
    first_W = per_dest[:world].cumsum(0) - per_dest[:world]  # a rank's first route in sorted order
    slot_TK = dest_TK * capacity + place_TK.view(tokens, topk) - first_W[dest_TK]
    return torch.where(valid_TK, slot_TK, -1)


def packed_rows(counts_WL: torch.Tensor, capacity: int, rows_per_expert: int) -> torch.Tensor:
    """``row_WC`` int64: the packed row (``l * P + begin[l, w] + s``) of slot c of source w, whose
    routes fill its first slots by local expert; ``L * P`` for an empty slot."""
    world, local = counts_WL.shape
    end_WL = counts_WL.cumsum(1).contiguous()  # where each expert's run ends in a source's slots
    slot_WC = torch.arange(capacity, device=counts_WL.device).expand(world, capacity).contiguous()
    expert_WC = torch.searchsorted(end_WL, slot_WC, right=True)
    full_WC = expert_WC < local
    expert_WC = expert_WC.clamp(max=local - 1)
    counts_LW = counts_WL.T
    begin_WL = (counts_LW.cumsum(1) - counts_LW).T  # sources in rank order within an expert
    within_WC = slot_WC - (end_WL - counts_WL).gather(1, expert_WC)
    row_WC = expert_WC * rows_per_expert + begin_WL.gather(1, expert_WC) + within_WC
    return torch.where(full_WC, row_WC, local * rows_per_expert)


def _exchange(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows, group=group)  # equal splits: no counts needed on the host
    return out


def dispatch(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int,
             group: dist.ProcessGroup, *, use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> LowLatencyDispatch:
    """Every route's message to the rank of its expert, packed there (arguments checked by
    :func:`check_dispatch_args`)."""
    world = dist.get_world_size(group)
    tokens, hidden = x_TH.shape
    local, topk = num_experts // world, topk_idx_TK.shape[1]
    capacity = slots_per_peer(num_max_dispatch_tokens_per_rank, topk, local)
    rows_per_expert = world * num_max_dispatch_tokens_per_rank
    if use_fp8:
        q_TH, sf_TG = per_token_cast(x_TH, group=FP8_GROUP, round_sf=round_scale, pack_sf=use_ue8m0)
        parts = (q_TH.view(torch.uint8), sf_TG.view(torch.uint8))
    else:
        parts = (x_TH.contiguous().view(torch.uint8),)
    body_bytes = sum(p.shape[1] for p in parts)
    device = x_TH.device

    token_TK = torch.arange(tokens, device=device)[:, None].expand(tokens, topk)
    meta_TK2 = torch.stack([token_TK, topk_idx_TK.long() % local], -1).to(torch.int32)
    message_RB = torch.cat([torch.cat(parts, 1).repeat_interleave(topk, 0),
                            meta_TK2.view(torch.uint8).view(tokens * topk, _META_BYTES)], 1)
    send = torch.empty(world * capacity + 1, body_bytes + _META_BYTES, dtype=torch.uint8, device=device)
    send[:, body_bytes:] = 255  # meta -1: an empty slot
    slot_TK = route_slots(topk_idx_TK, num_experts, world, capacity)
    masked_to_last = torch.where(slot_TK >= 0, slot_TK, world * capacity).flatten()  # the last row is not sent
    send.index_copy_(0, masked_to_last, message_RB)
    recv = _exchange(send[:-1], group)

    meta_WC2 = recv[:, body_bytes:].contiguous().view(torch.int32).view(world, capacity, 2)
    expert_WC = meta_WC2[..., 1].long()
    source_W1 = torch.arange(world, device=device)[:, None]
    counts_WL = torch.zeros(world * local + 1, dtype=torch.int64, device=device)
    counts_WL.scatter_add_(0, torch.where(expert_WC >= 0, source_W1 * local + expert_WC, world * local).flatten(),
                           torch.ones(world * capacity, dtype=torch.int64, device=device))
    counts_WL = counts_WL[:-1].view(world, local)
    row = packed_rows(counts_WL, capacity, rows_per_expert).flatten()

    def pack(columns: torch.Tensor, fill: int | None = None) -> torch.Tensor:
        """Received columns into their packed rows, past the last one for the empty slots."""
        shape = (local * rows_per_expert + 1, *columns.shape[1:])
        out = columns.new_empty(shape) if fill is None else columns.new_full(shape, fill)
        return out.index_copy_(0, row, columns)[:-1]

    data_bytes = parts[0].shape[1]
    recv_x = pack(recv[:, :data_bytes]).view(torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    recv_x = recv_x.view(local, rows_per_expert, hidden)
    if use_fp8:
        scales = pack(recv[:, data_bytes:body_bytes]).view(torch.int32 if use_ue8m0 else torch.float32)
        scales_LGP = scales.view(local, rows_per_expert, -1).transpose(1, 2).contiguous()
        recv_x = (recv_x, scales_LGP.transpose(1, 2))  # column-major, as DeepEP's (TMA) layout
    counts_LW = counts_WL.T.contiguous()
    begin_LW = counts_LW.cumsum(1) - counts_LW
    return LowLatencyDispatch(recv_x, counts_LW.sum(1).to(torch.int32),
                              pack(meta_WC2[..., 0].flatten(), -1).view(local, rows_per_expert),
                              (begin_LW << _COUNT_BITS) | counts_LW)


def check_combine_args(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, layout_range: torch.Tensor,
                       num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, world: int) -> None:
    """DeepEP's checks of a low-latency combine's arguments against the dispatch's handle."""
    local = num_experts // world
    check_tensor("x", x, dtype=torch.bfloat16, shape=(local, world * num_max_dispatch_tokens_per_rank, hidden))
    check_tensor("topk_idx", topk_idx, dtype=(torch.int64, torch.int32), ndim=2, device=x.device)
    if topk_idx.shape[0] > num_max_dispatch_tokens_per_rank:
        raise ValueError(f"topk_idx: expected at most num_max_dispatch_tokens_per_rank = "
                         f"{num_max_dispatch_tokens_per_rank} tokens, got {topk_idx.shape[0]}")
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape), device=x.device)
    check_tensor("handle", layout_range, dtype=torch.int64, shape=(local, world), device=x.device)
    check_device_routes(topk_idx, num_experts)


def combine(y_LPH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
            layout_range_LW: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int,
            group: dist.ProcessGroup) -> torch.Tensor:
    """``[T, H]`` bf16: each token's rows back from its experts, summed in float32 with
    ``topk_weights`` in route order (masked routes add nothing), cast once."""
    world = dist.get_world_size(group)
    local, hidden = y_LPH.shape[0], y_LPH.shape[2]
    capacity = slots_per_peer(num_max_dispatch_tokens_per_rank, topk_idx_TK.shape[1], local)
    counts_WL = (layout_range_LW & ((1 << _COUNT_BITS) - 1)).T
    row = packed_rows(counts_WL, capacity, y_LPH.shape[1]).flatten()
    y_rows = y_LPH.reshape(-1, hidden)
    rows = y_rows.index_select(0, row.clamp(max=y_rows.shape[0] - 1))  # an empty slot sends any row; nobody reads it
    back = _exchange(rows, group)
    slot_TK = route_slots(topk_idx_TK, num_experts, world, capacity)
    return weighted_reduce(back, slot_TK, topk_weights_TK, out_dtype=torch.bfloat16)
