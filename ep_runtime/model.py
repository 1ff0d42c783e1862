"""A tiny DeepSeek-style decoder: token + position embeddings, blocks of causal self-attention and
an MoE (the first ``dense_layers`` blocks use a dense SwiGLU MLP), a final norm and the LM head.

Options (``ModelConfig``):

* ``mhc``: the residual stream is ``n`` streams ``[B, S, N, D]``: widened after the embedding
  (``mhc.expand``), mixed around every attention and FFN sublayer (``mhc.HyperConnection``), merged
  before the final norm (``mhc.MHCHead``). Without it one stream ``[B, S, D]`` with plain residuals.
* ``engram``: an Engram layer before the attention of the configured blocks adds hashed n-gram
  memory of the token ids to the streams; its tables are sharded by rows over the EP group.

Shape letters: B sequences, S sequence length, D hidden, N mHC streams, H heads, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.validate import check_index_range, check_tensor

from . import lanes, mhc
from .config import ModelConfig
from .dispatch import Dispatcher
from .engram import Engram
from .experts import SwiGLUMLP
from .moe import MoELayer
from .placement import ExpertPlacement


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x_BSD).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        o_BHSd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o_BHSd.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """[Engram] -> attention -> FFN, each sublayer a plain residual or, with mHC, wrapped in its
    own ``HyperConnection``. The residual is ``[B, S, D]``, or ``[B, S, N, D]`` with mHC."""

    def __init__(self, cfg: ModelConfig, ffn: nn.Module, engram: Engram | None = None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.num_heads)
        self.ffn_norm = nn.RMSNorm(cfg.hidden)
        self.ffn = ffn
        self.engram = engram
        self.attn_hc = mhc.HyperConnection(cfg.mhc, cfg.hidden) if cfg.mhc else None
        self.ffn_hc = mhc.HyperConnection(cfg.mhc, cfg.hidden) if cfg.mhc else None

    def _attention(self, y_BSD: torch.Tensor) -> torch.Tensor:
        return self.attn(self.attn_norm(y_BSD))

    def _feed_forward(self, y_BSD: torch.Tensor) -> torch.Tensor:
        h_BSD = self.ffn_norm(y_BSD)
        if isinstance(self.ffn, MoELayer):
            return self.ffn(h_BSD)
        return self.ffn(h_BSD.flatten(0, 1)).view_as(h_BSD)  # the dense MLP takes [T, D]

    def forward(self, x: torch.Tensor, tokens_BS: torch.Tensor) -> torch.Tensor:
        if self.attn_hc is None:  # x_BSD, one stream
            if self.engram is not None:
                x = self.engram(x[:, :, None], tokens_BS)[:, :, 0]
            x = x + self._attention(x)
            return x + self._feed_forward(x)
        if self.engram is not None:  # x_BSND
            x = self.engram(x, tokens_BS)
        return mhc.two_sublayers(x, self.attn_hc, self._attention, self.ffn_hc, self._feed_forward)


class TinyDeepSeek(nn.Module):
    """Build under the same ``torch.manual_seed`` on every rank: dense parameters then agree, and
    each expert's weights depend only on ``(seed, layer, expert)`` (see ``GroupedExperts``), each
    Engram table row's only on ``(seed, layer, row)``.

    Engram tables are sharded over ``ep_group``, by default the group ``dispatcher`` moves tokens
    over (``dispatcher.group``; None: one process, whole tables).

    ``placement``: one ``ExpertPlacement`` per MoE layer (in order; e.g.
    ``placement.placements_from_plan(plan)``), the dispatcher then working over their ``P``
    physical experts; None: expert ``e`` in slot ``e``.
    """

    def __init__(self, cfg: ModelConfig, dispatcher: Dispatcher, *, ep_rank: int = 0, seed: int = 0,
                 ep_group: dist.ProcessGroup | None = None, placement: Sequence[ExpertPlacement] | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        if cfg.engram is not None and ep_group is None:
            ep_group = lanes.attribute(dispatcher, "group")  # one per lane with a PerLane dispatcher
        ep_size = dispatcher.num_experts // dispatcher.num_local_experts
        group_size = dist.get_world_size(lanes.resolve(ep_group)) if ep_group is not None else 1
        if cfg.engram is not None and group_size != ep_size:
            raise ValueError(f"ep_group: expected the dispatcher's EP group of {ep_size} ranks for the Engram "
                             f"tables, got {'none' if ep_group is None else group_size}")
        num_moe = cfg.num_layers - cfg.dense_layers
        if placement is not None and len(placement) != num_moe:
            raise ValueError(f"placement: expected one per MoE layer ({num_moe}), got {len(placement)}")
        streams = cfg.mhc.n if cfg.mhc else 1
        blocks = []
        for layer in range(cfg.num_layers):
            if layer < cfg.dense_layers:
                ffn = SwiGLUMLP(cfg.hidden, cfg.dense_hidden)
            else:
                ffn = MoELayer(cfg.moe, cfg.hidden, dispatcher, ep_rank=ep_rank, seed=seed * 1000 + layer,
                               placement=None if placement is None else placement[layer - cfg.dense_layers])
            memory = None
            if cfg.engram is not None and layer in cfg.engram.layers:
                memory = Engram(cfg.engram, layer_id=layer, vocab_size=cfg.vocab_size, hidden=cfg.hidden,
                                streams=streams, group=ep_group, seed=seed * 1000 + layer)
            blocks.append(Block(cfg, ffn, memory))
        self.blocks = nn.ModuleList(blocks)
        self.mhc_head = mhc.MHCHead(cfg.mhc, cfg.hidden) if cfg.mhc else None
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoELayer)]

    @property
    def engram_layers(self) -> list[Engram]:
        return [b.engram for b in self.blocks if b.engram is not None]

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for moe in self.moe_layers for p in moe.experts.parameters()]

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters split by rows over the EP group (the Engram table shards). Like the experts',
        their gradient already sums every EP rank's contribution (the lookup's backward sends it to
        the owner): reduce them over the ``dp`` replicas only, never over the EP group."""
        return [e.table.weight_LE for e in self.engram_layers]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds in full (all but the experts and the sharded tables)."""
        skip = {id(p) for p in (*self.expert_parameters(), *self.sharded_parameters())}
        return [p for p in self.parameters() if id(p) not in skip]

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """``tokens_BS`` int64 ``[B, S]`` in ``[0, V)``, ``S <= max_seq_len`` -> logits ``[B, S, V]``."""
        x = self.embed_tokens(tokens_BS)
        for block in self.blocks:
            x = block(x, tokens_BS)
        return self.logits(x)

    def embed_tokens(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The stream the first block takes (``[B, S, D]``, with mHC ``[B, S, N, D]``); the tokens
        checked."""
        check_tensor("tokens_BS", tokens_BS, dtype=(torch.int64, torch.int32), ndim=2)
        check_index_range("tokens_BS", tokens_BS, self.cfg.vocab_size, allow_masked=False)
        if tokens_BS.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"tokens_BS: expected at most model.max_seq_len={self.cfg.max_seq_len} positions, "
                             f"got shape {tuple(tokens_BS.shape)}")
        pos_S = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
        x = self.embed(tokens_BS) + self.pos_embed(pos_S)
        return mhc.expand(x, self.cfg.mhc.n) if self.cfg.mhc else x  # not mhc_head: a pipeline stage drops it

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's stream -> logits ``[B, S, V]``."""
        if self.mhc_head is not None:
            x = self.mhc_head(x)
        return self.head(self.norm(x))

    def next_token_loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the logits against the next tokens (+ the balance losses when enabled)."""
        loss = F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())
        if self.cfg.moe.router.aux_loss_coef > 0:
            loss = loss + sum(moe.aux_loss for moe in self.moe_layers)
        return loss

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (+ balance losses when enabled)."""
        return self.next_token_loss(self(tokens_BS[:, :-1]), tokens_BS[:, 1:])
