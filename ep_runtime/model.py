"""A tiny DeepSeek-style decoder: token + position embeddings, blocks of causal self-attention and
an MoE (the first ``dense_layers`` blocks use a dense SwiGLU MLP), a final norm and the LM head.

Shape letters: B sequences, S sequence length, D hidden, H heads, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .dispatch import Dispatcher
from .experts import SwiGLUMLP
from .moe import MoELayer


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
    def __init__(self, cfg: ModelConfig, ffn: nn.Module):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.num_heads)
        self.ffn_norm = nn.RMSNorm(cfg.hidden)
        self.ffn = ffn

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class TinyDeepSeek(nn.Module):
    """Build under the same ``torch.manual_seed`` on every rank: dense parameters then agree, and
    each expert's weights depend only on ``(seed, layer, expert)`` (see ``GroupedExperts``)."""

    def __init__(self, cfg: ModelConfig, dispatcher: Dispatcher, *, ep_rank: int = 0, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        blocks = []
        for layer in range(cfg.num_layers):
            if layer < cfg.dense_layers:
                ffn = SwiGLUMLP(cfg.hidden, cfg.dense_hidden)
            else:
                ffn = MoELayer(cfg.moe, cfg.hidden, dispatcher, ep_rank=ep_rank, seed=seed * 1000 + layer)
            blocks.append(Block(cfg, ffn))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoELayer)]

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for moe in self.moe_layers for p in moe.experts.parameters()]

    def dense_parameters(self) -> list[nn.Parameter]:
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """``tokens_BS`` int64 -> logits ``[B, S, V]``."""
        pos_S = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
        x_BSD = self.embed(tokens_BS) + self.pos_embed(pos_S)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.head(self.norm(x_BSD))

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (+ balance losses when enabled)."""
        logits = self(tokens_BS[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens_BS[:, 1:].flatten())
        if self.cfg.moe.router.aux_loss_coef > 0:
            loss = loss + sum(moe.aux_loss for moe in self.moe_layers)
        return loss
