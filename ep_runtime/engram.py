"""Engram layers: conditional memory by hashed n-gram lookup, with tables sharded over the EP group.

Before the attention of each configured block:

    idx   = ngram_hash(token ids)                    every order 2..G, every hash head: one table row
    e     = table[idx], concatenated over the C = (G - 1) * heads columns      (the memory vector)
    k_h   = W_k,h e  (one key per residual stream h),   v = W_v e
    g_h   = gate(x_h, k_h) * v                       (kernels.engram.gate, per stream)
    x_h  += g_h + short_conv(g_h)                    (depthwise causal conv, kernel 4, dilation G, SiLU)

Sharding: the concatenated table of ``R`` rows is split by rows over the ``W`` ranks of the EP
group: rank ``r`` holds rows ``[r * L, (r + 1) * L)`` with ``L = ceil(R / W)`` (the last shard, or the
last few, padded with rows nobody asks for). A forward sends each owner the distinct rows this rank needs (indices
made unique first, so a row travels once per rank however many tokens use it), then gets the rows
back; the backward sums each distinct row's gradient locally and sends it to the owner, which adds
what every rank sent into its shard's gradient. Each direction is one autograd node
(:class:`ShardedLookupFn`), so every rank issues its collectives in the same order.

The shard is an ordinary parameter of its owner, updated there; its gradient already holds every
rank's contribution, so it must not be all-reduced over the EP group (``TinyDeepSeek
.sharded_parameters()`` lists such parameters; they are reduced like the experts, over the ``dp``
replicas only). Every row's initial value depends only on the seed and the row (blocks of
:data:`INIT_BLOCK` rows, each from its own generator), so a shard equals the same rows of the
unsharded table.

Shape letters: B sequences, S positions, T = B*S tokens, N mHC streams (1 without mHC), G the
largest n-gram order, D hidden of one stream, C hash columns, E = head_dim, I looked-up indices (T*C), U distinct indices, Q rows
this rank serves to others, L rows of this rank's shard, W EP ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from kernels import engram
from kernels.validate import check_index_range, check_tensor

from .config import EngramConfig
from .lanes import PerLane, resolve

__all__ = ["CONV_TAPS", "INIT_BLOCK", "Engram", "ShardedLookupFn", "ShardedTable"]

CONV_TAPS = 4  # the short conv's kernel size
INIT_BLOCK = 1024  # rows initialised by one generator
_SALT = 0x9E3779B97F4A7C15  # keeps the tables' generator seeds apart from the experts'
_MASK63 = 2**63 - 1


class _Exchange:
    """``all_to_all_single`` over ``group`` with split lists; the identity without a group."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def __call__(self, rows: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        if self.group is None:
            return rows
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=self.group)
        return out


class ShardedLookupFn(torch.autograd.Function):
    """``(shard_LE, idx_I) -> rows_IE``: rows of the table sharded over ``group``.

    Forward (one node): unique the indices, send them to their owners (counts, then indices),
    owners answer with their rows. Backward (one node): sum the gradient per distinct row, send it
    to the owner, which adds it into its shard's gradient.
    """

    @staticmethod
    def forward(ctx, shard_LE, idx_I, group, rank: int, world: int):
        exchange = _Exchange(group)
        rows_per_rank = shard_LE.shape[0]
        uniq_U, inverse_I = torch.unique(idx_I, sorted=True, return_inverse=True)  # sorted: grouped by owner
        send_W = torch.bincount(uniq_U // rows_per_rank, minlength=world)
        recv_W = exchange(send_W, [1] * world, [1] * world)
        send, recv = torch.stack([send_W, recv_W]).tolist()  # the one host sync
        local_Q = exchange(uniq_U, send, recv) - rank * rows_per_rank
        rows_UE = exchange(shard_LE.index_select(0, local_Q), recv, send)
        ctx.save_for_backward(inverse_I, local_Q)
        ctx.exchange, ctx.send, ctx.recv, ctx.num_uniq = exchange, send, recv, uniq_U.shape[0]
        ctx.shard_shape, ctx.shard_dtype = shard_LE.shape, shard_LE.dtype
        return rows_UE.index_select(0, inverse_I)

    @staticmethod
    def backward(ctx, grad_IE):
        inverse_I, local_Q = ctx.saved_tensors
        grad_IE = grad_IE.float()
        grad_UE = grad_IE.new_zeros((ctx.num_uniq, grad_IE.shape[1])).index_add_(0, inverse_I, grad_IE)
        grad_QE = ctx.exchange(grad_UE, ctx.send, ctx.recv)
        grad_LE = grad_QE.new_zeros(ctx.shard_shape).index_add_(0, local_Q, grad_QE)
        return grad_LE.to(ctx.shard_dtype), None, None, None, None


class ShardedTable(nn.Module):
    """An embedding table of ``num_rows`` rows of width ``dim``, split by rows over ``group``.

    This rank holds ``weight_LE`` ``[L, dim]``, rows ``[rank * L, (rank + 1) * L)`` with
    ``L = ceil(num_rows / W)``; rows past ``num_rows`` (padding, in the last shard or the last few)
    are zero and never looked up. ``group=None``: one process holding the whole table. Initial rows ~ N(0, 1), a pure
    function of ``(seed, row)``.
    """

    def __init__(self, num_rows: int, dim: int, *, group: dist.ProcessGroup | PerLane | None, seed: int):
        super().__init__()
        self.group = group  # or one per lane (``ep_runtime.lanes``): the same ranks, its own group
        group = resolve(group)
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.num_rows = num_rows
        self.rows_per_rank = -(-num_rows // self.world)
        self.first_row = self.rank * self.rows_per_rank
        self.weight_LE = nn.Parameter(self._initial_rows(dim, seed))

    def _initial_rows(self, dim: int, seed: int) -> torch.Tensor:
        out_LE = torch.zeros(self.rows_per_rank, dim)
        start, end = self.first_row, min(self.first_row + self.rows_per_rank, self.num_rows)
        if start >= end:  # a shard wholly past the table: padding only
            return out_LE
        for block in range(start // INIT_BLOCK, -(-end // INIT_BLOCK)):
            g = torch.Generator().manual_seed(((seed * 1_000_003 + block) ^ _SALT) & _MASK63)
            rows = torch.randn(INIT_BLOCK, dim, generator=g)
            lo, hi = max(start, block * INIT_BLOCK), min(end, (block + 1) * INIT_BLOCK)
            out_LE[lo - start : hi - start] = rows[lo - block * INIT_BLOCK : hi - block * INIT_BLOCK]
        return out_LE

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` int64 of any shape, entries in ``[0, num_rows)`` -> ``[*idx.shape, dim]``."""
        check_tensor("idx", idx, dtype=torch.int64)
        check_index_range("idx", idx, self.num_rows, allow_masked=False)
        rows_IE = ShardedLookupFn.apply(self.weight_LE, idx.reshape(-1), resolve(self.group), self.rank, self.world)
        return rows_IE.view(*idx.shape, self.weight_LE.shape[1])


class Engram(nn.Module):
    """One Engram layer: ``x_h += g_h + short_conv(g_h)``, ``g_h = gate(x_h, W_k,h e) * W_v e``
    with ``e`` the hashed n-gram memory of the token ids (see the module docstring).

    Parameters: ``table`` (sharded over ``group``), ``key`` ``[N*D, C*E]``, ``value`` ``[D, C*E]``,
    the gate's RMS-norm weights ``query_norm_ND``/``key_norm_ND``, the short conv's
    ``conv_norm_ND`` and taps ``conv_NDW``.
    """

    def __init__(self, cfg: EngramConfig, *, layer_id: int, vocab_size: int, hidden: int, streams: int,
                 group: dist.ProcessGroup | None, seed: int):
        super().__init__()
        self.cfg = cfg
        self.hash = engram.make_hash_config(layer_id, layer_ids=list(cfg.layers), vocab_size=vocab_size,
                                            max_ngram=cfg.max_ngram, num_heads=cfg.num_heads,
                                            table_size=cfg.table_size)
        self.streams, self.hidden = streams, hidden
        memory = self.hash.num_columns * cfg.head_dim
        self.table = ShardedTable(self.hash.num_rows, cfg.head_dim, group=group, seed=seed)
        self.key = nn.Linear(memory, streams * hidden, bias=False)
        self.value = nn.Linear(memory, hidden, bias=False)
        self.query_norm_ND = nn.Parameter(torch.ones(streams, hidden))
        self.key_norm_ND = nn.Parameter(torch.ones(streams, hidden))
        self.conv_norm_ND = nn.Parameter(torch.ones(streams, hidden))
        self.conv_NDW = nn.Parameter(torch.randn(streams, hidden, CONV_TAPS) * (0.1 / math.sqrt(CONV_TAPS)))

    def forward(self, x_BSND: torch.Tensor, ids_BS: torch.Tensor) -> torch.Tensor:
        """Args:
            x_BSND: ``[B, S, N, D]`` the residual streams (N = 1 without mHC).
            ids_BS: ``[B, S]`` int32/int64 token ids in ``[0, vocab_size)``.
        Returns:
            ``[B, S, N, D]``: the streams with the memory added, ``x_BSND``'s dtype.
        """
        check_tensor("x_BSND", x_BSND, ndim=4)
        b, s, n, d = x_BSND.shape
        if (n, d) != (self.streams, self.hidden):
            raise ValueError(f"x_BSND: expected [B, S, {self.streams}, {self.hidden}], got {tuple(x_BSND.shape)}")
        check_tensor("ids_BS", ids_BS, shape=(b, s), device=x_BSND.device)
        idx_BSC = engram.ngram_hash(ids_BS, self.hash)
        e_TM = self.table(idx_BSC).reshape(b * s, self.key.in_features)  # M = C * E, the memory vector
        k_TND = self.key(e_TM).view(b * s, n, d)
        v_TD = self.value(e_TM)
        gated_TND = engram.gate(x_BSND.reshape(b * s, n, d), k_TND, v_TD, self.query_norm_ND, self.key_norm_ND,
                                add_residual=False)
        gated_BSND = gated_TND.view(b, s, n, d)
        conv_BSND = engram.short_conv(gated_BSND, self.conv_NDW, dilation=self.cfg.max_ngram,
                                      norm_weight_ND=self.conv_norm_ND)
        return x_BSND + (gated_BSND + conv_BSND).to(x_BSND.dtype)
