"""DeepEP's ``deep_ep.Buffer`` API (intranode) on ep-runtime, so code written for DeepEP runs here.
Normal mode: ``get_dispatch_layout``, ``dispatch`` (fresh, cached with a handle, worst-case padded,
bf16 or FP8 ``(data, scales)``), ``combine`` (an unweighted sum of each token's rows, weights
summed per slot), ``EventOverlap``, ``Config``. Low-latency mode: ``low_latency_dispatch`` (packed
per local expert, bf16 or FP8 with float32, power-of-two or UE8M0 scales), ``low_latency_combine``
(weighted, zero-copy, into ``out``), receive hooks, ``get_next_low_latency_combine_buffer``,
``clean_low_latency_buffer``; its transport is :mod:`ep_runtime.compat.low_latency`.

Normal mode's semantics follow DeepEP's: rank r owns experts ``[r * L, (r + 1) * L)``; a token travels once to
each rank holding one of its experts; received rows are grouped by source rank in rank order, by
token index within a rank; ``recv_topk_idx`` holds local expert indices (-1 for experts
elsewhere, whose weights are 0); ``handle[0]`` is the inclusive prefix over source ranks of the
tokens each rank receives. The transport is ``all_to_all_single`` over the buffer's group (NCCL on
GPUs, gloo on CPU), with one host sync per fresh dispatch for the counts, as DeepEP's normal mode
has. Everything runs on the current stream: ``async_finish`` records an event there and
``previous_event`` is waited on first; ``Config`` (SMs, chunk sizes) is validated and otherwise
has nothing to tune. Internode (RDMA) buffers and rank masking (``enable_shrink``) are not provided;
the RDMA-only knobs (``num_rdma_bytes``, ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``,
``allow_mnnvl``) change no result and are accepted and ignored.

Shape letters: T tokens, H hidden, K routes per token, E experts, L local experts, W ranks, N
received rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from kernels.validate import check_index_range, check_positive, check_routes, check_tensor

from ..dispatch.all_to_all import home_rows, sum_home
from . import low_latency

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]

topk_idx_t = torch.int64

_DISPATCH_CHUNKS = {2: 24, 4: 6, 8: 6}  # DeepEP's tuned NVLink send chunks per rank count
_COMBINE_CHUNKS = {2: 10, 4: 9, 8: 4}


class Config:
    """DeepEP's kernel configuration; checked as DeepEP checks it, then only recorded (the
    all_to_all transport has no chunk sizes to tune)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        if num_sms < 0:
            raise ValueError(f"num_sms: expected >= 0, got {num_sms}")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError("num_max_nvl_chunked_send_tokens: expected in (0, num_max_nvl_chunked_recv_tokens), got "
                             f"{num_max_nvl_chunked_send_tokens} and {num_max_nvl_chunked_recv_tokens}")
        if not 0 < num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens:
            raise ValueError("num_max_rdma_chunked_send_tokens: expected in (0, num_max_rdma_chunked_recv_tokens), "
                             f"got {num_max_rdma_chunked_send_tokens} and {num_max_rdma_chunked_recv_tokens}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # no NVLink buffer of its own

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class EventHandle:
    """A CUDA event recorded on the current stream (nothing on CPU)."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()``, or ``with event:`` (the current stream
    waits on exit)."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None):
        self.event, self.extra_tensors = event, extra_tensors
        self._release = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is None:
            raise RuntimeError("event: expected an event to wait on (async_finish=True), got None")
        self.event.current_stream_wait()
        if release_handle:
            self.event = None

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait(self._release)


class Handle(NamedTuple):
    """What a cached dispatch and combine reuse. DeepEP's first element (``rank_prefix_matrix``)
    and ``is_token_in_rank`` (its fifth) mean the same here; the channel entries are None (no
    channels), ``recv_src_idx`` is each received row's token index at its source (-1 on the padding
    rows of a ``num_worst_tokens`` dispatch)."""

    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: None
    recv_channel_prefix_matrix: None
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: None
    send_token_S: torch.Tensor  # the token of each row sent, grouped by destination rank
    home_TW: torch.Tensor  # the sent row of token t bound for rank w, -1 if none
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]


class Buffer:
    """DeepEP's ``Buffer`` over ``group`` (intranode, both modes whatever ``low_latency_mode`` says).
    Byte sizes and queue pairs are accepted and ignored: the transport sizes its own messages."""

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None):
        if enable_shrink:
            raise NotImplementedError("enable_shrink: masking failed ranks is not provided by ep-runtime's DeepEP facade")
        self.group = group
        self.rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.runtime = True
        self._combine_buffer: torch.Tensor | None = None  # get_next_low_latency_combine_buffer's rows

    # Static helpers of DeepEP's API.
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms: expected an even number, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True  # FP8 payloads work on every device here

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, _chunks(_DISPATCH_CHUNKS, num_ranks), 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, _chunks(_COMBINE_CHUNKS, num_ranks), 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return 0  # no RDMA buffer: the transport allocates its messages per call

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: expected a Buffer made with explicitly_destroy=True")
        self.runtime = None

    # The API.
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, W] bool, event)``."""
        check_tensor("topk_idx", topk_idx, ndim=2, dtype=(torch.int64, torch.int32))
        check_index_range("topk_idx", topk_idx, num_experts)  # the bincount below syncs anyway
        _wait(previous_event)
        local = self._num_local_experts(num_experts)
        device = topk_idx.device
        ranks_W = torch.arange(self.group_size, device=device)
        is_token_in_rank = ((topk_idx[:, :, None] >= 0) & (topk_idx[:, :, None] // local == ranks_W)).any(1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0].long(), minlength=num_experts)
        return (is_token_in_rank.sum(0, dtype=torch.int32), None, per_expert.to(torch.int32), is_token_in_rank,
                _event(async_finish))

    def dispatch(self, x, handle: Handle | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)``; with a ``handle`` (cached: the same rows as the dispatch that made it) only
        ``recv_x`` and the event. ``x`` is bf16 ``[T, H]`` or ``(e4m3 [T, H], float32 scales
        [T, H / 128])``, and ``recv_x`` comes back in the same form."""
        data, scales = x if isinstance(x, tuple) else (x, None)
        check_tensor("x", data, ndim=2)
        if scales is not None:
            check_tensor("x", scales, dtype=torch.float32, shape=(data.shape[0], -(-data.shape[1] // 128)),
                         device=data.device)
        if handle is not None and data.shape[0] != handle.is_token_in_rank.shape[0]:
            raise ValueError(f"x: expected the {handle.is_token_in_rank.shape[0]} tokens of the handle's dispatch, "
                             f"got {data.shape[0]}")
        _wait(previous_event)
        cached = handle is not None
        if handle is None:
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                ("num_tokens_per_expert", num_tokens_per_expert)):
                if value is None:
                    raise ValueError(f"{name}: expected the tensor from get_dispatch_layout (or a handle), got None")
            check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool,
                         shape=(data.shape[0], self.group_size))
            check_tensor("num_tokens_per_expert", num_tokens_per_expert, ndim=1)
            check_positive("expert_alignment", expert_alignment)
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError("topk_idx, topk_weights: expected both or neither")
            if topk_idx is not None:
                self._check_routes(topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert.numel())
            handle = self._plan(is_token_in_rank, num_tokens_per_rank)
        elif topk_idx is not None or topk_weights is not None:
            raise ValueError("topk_idx, topk_weights: expected None with a handle (a cached dispatch)")
        recv = self._send(data, handle)
        recv_x = recv if scales is None else (recv, self._send(scales.contiguous(), handle))
        if cached:  # padded as the handle's dispatch was
            return _pad(recv_x, handle.recv_src_idx.shape[0], 0), None, None, None, None, _event(async_finish)

        recv_topk_idx = recv_topk_weights = None
        local = self._num_local_experts(num_tokens_per_expert.numel())
        if topk_idx is not None:
            dest_S = torch.repeat_interleave(torch.arange(self.group_size, device=data.device),
                                             torch.tensor(handle.send_splits, device=data.device))
            idx_SK = topk_idx[handle.send_token_S]
            mine_SK = (idx_SK >= 0) & (idx_SK // local == dest_S[:, None])
            recv_topk_idx = self._send_rows(torch.where(mine_SK, idx_SK - dest_S[:, None] * local, -1), handle)
            recv_topk_weights = self._send_rows(torch.where(mine_SK, topk_weights[handle.send_token_S], 0.0), handle)
        per_expert = self._exchange(num_tokens_per_expert.to(torch.int64), [local] * self.group_size,
                                    [local] * self.group_size).view(self.group_size, local).sum(0)
        counts = ((per_expert + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
        if num_worst_tokens:
            counts = []
            recv_x = _pad(recv_x, num_worst_tokens, 0)
            recv_topk_idx = _pad(recv_topk_idx, num_worst_tokens, -1)
            recv_topk_weights = _pad(recv_topk_weights, num_worst_tokens, 0)
            handle = handle._replace(recv_src_idx=_pad(handle.recv_src_idx, num_worst_tokens, -1))
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _event(async_finish)

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """``(combined_x [T, H], combined_topk_weights [T, K] or None, event)``: each token's rows
        from the ranks it went to and ``bias`` (``[T, H]``, a tensor or a pair) summed in float32,
        then cast to x's dtype once. ``x`` has the dispatch's received rows, or as many as
        ``recv_src_idx`` (a dispatch with ``num_worst_tokens``: the padding rows are not read)."""
        received, padded = sum(handle.recv_splits), handle.recv_src_idx.shape[0]
        check_tensor("x", x, ndim=2)
        if x.shape[0] not in (received, padded):
            raise ValueError(f"x: expected the dispatch's {received} received rows (or {padded} with its "
                             f"num_worst_tokens), got {x.shape[0]}")
        biases = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]
        for b in biases:
            check_tensor("bias", b, shape=(handle.home_TW.shape[0], x.shape[1]), device=x.device)
        _wait(previous_event)
        combined = self._sum_home(x[:received], handle, out_dtype=torch.float32 if biases else None)
        if biases:
            combined = sum((b.float() for b in biases), combined).to(x.dtype)
        weights = None
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2)
            if topk_weights.shape[0] not in (received, padded):
                raise ValueError(f"topk_weights: expected the dispatch's {received} received rows (or {padded} with "
                                 f"its num_worst_tokens), got {topk_weights.shape[0]}")
            weights = self._sum_home(topk_weights[:received], handle)
        return combined, weights, _event(async_finish)

    # The low-latency API (any Buffer serves it; ``low_latency_mode`` changes nothing).
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """``(recv_x, recv_count, handle, event, hook)`` as DeepEP's: ``x`` bf16 ``[T, H]`` (T at most
        ``num_max_dispatch_tokens_per_rank``, the same on every rank, as top-k is) goes once per
        route to the rank of its expert; ``recv_x`` is packed ``[L, W * M, H]`` (see
        :class:`~ep_runtime.compat.low_latency.LowLatencyDispatch`): an expert's rows at the front,
        by source rank in rank order, by token within one. FP8 casts per 1x128 as DeepEP's kernel
        (``round_scale``: power-of-two scales; ``use_ue8m0``: as packed exponents). ``handle`` is
        DeepEP's ``(src_info, layout_range, M, H, num_experts)``. ``cumulative_local_expert_recv_stats``
        (``[L]`` int32) gets ``recv_count`` added. The rows have arrived when the call returns (no
        host sync: one ``all_to_all_single`` of fixed size), so the hook of ``return_recv_hook`` is a
        callable with nothing left to do. Refused: ``dispatch_wait_recv_cost_stats`` (no per-rank wait
        to time)."""
        _refuse_wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        _check_hook(async_finish, return_recv_hook)
        low_latency.check_dispatch_args(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, self.group_size,
                                        use_fp8, round_scale, use_ue8m0)
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, dtype=torch.int32,
                         shape=(num_experts // self.group_size,), device=x.device)
        got = low_latency.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, self.group,
                                   use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(got.recv_count)
        handle = (got.src_info, got.layout_range, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        return got.recv_x, got.recv_count, handle, _event(async_finish), _hook(return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """``(combined_x [T, H] bf16, event, hook)`` as DeepEP's: ``x`` ``[L, W * M, H]`` bf16, the
        experts' rows in the dispatch's packed layout (with ``zero_copy``, the rows written into
        :meth:`get_next_low_latency_combine_buffer` instead), goes home, where each token's rows are
        summed in float32 with ``topk_weights`` (``topk_idx`` and ``topk_weights`` are the
        dispatch's ``[T, K]``), cast once, into ``out`` when given. The hook as dispatch's. Refused:
        ``use_logfmt`` (DeepEP's lossy 10-bit LogFMT rows would give other values) and
        ``combine_wait_recv_cost_stats``."""
        if use_logfmt:
            raise NotImplementedError("use_logfmt: the LogFMT combine format is not provided; rows travel as bf16")
        _refuse_wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        _check_hook(async_finish, return_recv_hook)
        src_info, layout_range, max_tokens, hidden, num_experts = handle
        low_latency.check_combine_args(x, topk_idx, topk_weights, layout_range, max_tokens, hidden, num_experts,
                                       self.group_size)
        if out is not None:
            check_tensor("out", out, dtype=torch.bfloat16, shape=(topk_idx.shape[0], hidden), device=x.device)
        if zero_copy:
            if self._combine_buffer is None or self._combine_buffer.shape != x.shape:
                raise ValueError("zero_copy: expected rows written into get_next_low_latency_combine_buffer(handle) "
                                 f"of shape {tuple(x.shape)}, got {_shape(self._combine_buffer)}")
            x = self._combine_buffer
        combined = low_latency.combine(x, topk_idx, topk_weights, layout_range, max_tokens, num_experts, self.group)
        if out is not None:
            combined = out.copy_(combined)
        return combined, _event(async_finish), _hook(return_recv_hook)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The ``[L, W * M, H]`` bf16 rows a ``zero_copy`` combine of ``handle``'s dispatch sends."""
        src_info, _, max_tokens, hidden, num_experts = handle
        shape = (num_experts // self.group_size, self.group_size * max_tokens, hidden)
        if self._combine_buffer is None or self._combine_buffer.shape != shape:
            self._combine_buffer = torch.empty(shape, dtype=torch.bfloat16, device=src_info.device)
        return self._combine_buffer

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: no state outlives a low-latency call."""

    def _check_routes(self, topk_idx, topk_weights, is_token_in_rank, num_experts: int) -> None:
        """Routes that would be lost otherwise: ids outside the experts that ``num_tokens_per_expert``
        counts, or to a rank ``is_token_in_rank`` does not send the token to (the host syncs are
        paid anyway: the counts go to the host next)."""
        check_tensor("topk_idx", topk_idx, dtype=(torch.int64, torch.int32), shape=(is_token_in_rank.shape[0], None),
                     device=is_token_in_rank.device)
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape),
                     device=topk_idx.device)
        check_routes(topk_idx, num_experts, name="topk_idx")
        rank_TK = topk_idx.clamp(min=0) // self._num_local_experts(num_experts)
        lost_TK = (topk_idx >= 0) & ~is_token_in_rank.gather(1, rank_TK)
        if bool(lost_TK.any()):
            t, k = (int(i) for i in lost_TK.nonzero()[0])
            raise ValueError(f"is_token_in_rank: token {t} routes to expert {int(topk_idx[t, k])} on rank "
                             f"{int(rank_TK[t, k])}, which is_token_in_rank does not send it to")

    # The transport.
    def _num_local_experts(self, num_experts: int) -> int:
        if num_experts % self.group_size:
            raise ValueError(f"num_experts: expected a multiple of the group size {self.group_size}, got {num_experts}")
        return num_experts // self.group_size

    def _plan(self, is_token_in_rank: torch.Tensor, num_tokens_per_rank: torch.Tensor) -> Handle:
        """Rows to send (by destination rank, then token), the counts each way (one host sync),
        and DeepEP's rank prefix matrix."""
        dest_S, send_token_S = is_token_in_rank.T.nonzero(as_tuple=True)
        per_rank = is_token_in_rank.sum(0, dtype=torch.int64)
        matrix = [torch.empty_like(per_rank) for _ in range(self.group_size)]
        dist.all_gather(matrix, per_rank, group=self.group)  # row i: what rank i sends to each rank
        matrix_WW = torch.stack(matrix)
        send, recv = per_rank.tolist(), matrix_WW[:, self.rank].tolist()
        handle = Handle(rank_prefix_matrix=matrix_WW.cumsum(0).to(torch.int32), channel_prefix_matrix=None,
                        recv_channel_prefix_matrix=None, recv_src_idx=torch.empty(0), is_token_in_rank=is_token_in_rank,
                        send_head=None, send_token_S=send_token_S,
                        home_TW=home_rows(dest_S, send_token_S, is_token_in_rank.shape[0], self.group_size),
                        send_splits=tuple(send), recv_splits=tuple(recv))
        return handle._replace(recv_src_idx=self._send_rows(send_token_S.to(torch.int32), handle))

    def _exchange(self, rows: torch.Tensor, send_splits, recv_splits) -> torch.Tensor:
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), list(recv_splits), list(send_splits), group=self.group)
        return out

    def _send_rows(self, rows_SX: torch.Tensor, handle: Handle) -> torch.Tensor:
        return self._exchange(rows_SX, handle.send_splits, handle.recv_splits)

    def _send(self, x_TX: torch.Tensor, handle: Handle) -> torch.Tensor:
        rows = x_TX[handle.send_token_S]
        if rows.element_size() == 1:  # float8: moved as bytes
            return self._send_rows(rows.view(torch.uint8), handle).view(rows.dtype)
        return self._send_rows(rows, handle)

    def _sum_home(self, rows_NX: torch.Tensor, handle: Handle, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return sum_home(self._exchange(rows_NX, handle.recv_splits, handle.send_splits), handle.home_TW, out_dtype)


def _chunks(table: dict[int, int], num_ranks: int) -> int:
    if num_ranks not in table:
        raise ValueError(f"num_ranks: expected one of {sorted(table)}, got {num_ranks}")
    return table[num_ranks]


def _check_hook(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError("async_finish, return_recv_hook: expected at most one of them, got both")


def _received() -> None:
    """A receive hook: the rows arrived at the call, nothing is left to receive."""


def _hook(return_recv_hook: bool):
    return _received if return_recv_hook else None


def _refuse_wait_stats(name: str, stats: torch.Tensor | None) -> None:
    if stats is not None:
        raise NotImplementedError(f"{name}: per-rank receive wait times are not measured; pass None")


def _shape(t: torch.Tensor | None):
    return None if t is None else tuple(t.shape)


def _wait(previous_event: EventOverlap | None) -> None:
    if previous_event is not None and previous_event.event is not None:
        previous_event.current_stream_wait()


def _event(async_finish: bool) -> EventOverlap:
    return EventOverlap(EventHandle() if async_finish else None)


def _pad(x, rows: int, value):
    """Rows appended up to ``rows`` (DeepEP's worst-case output size), filled with ``value``."""
    if isinstance(x, tuple):
        return tuple(_pad(t, rows, value) for t in x)
    if x is None or x.shape[0] == rows:  # nothing to append (a cached dispatch of unpadded rows): no copy
        return x
    if x.shape[0] > rows:
        raise ValueError(f"num_worst_tokens: expected >= the {x.shape[0]} rows received, got {rows}")
    pad = torch.full((rows - x.shape[0], *x.shape[1:]), value, dtype=x.dtype if x.element_size() > 1 else torch.uint8,
                     device=x.device)
    return torch.cat([x, pad.view(x.dtype)])
