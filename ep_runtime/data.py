"""Generated training data that a model can learn: a sparse random Markov chain over the
vocabulary (each token has a few likely successors), so next-token loss falls from ln(V) towards
the chain's entropy rate instead of staying at noise level.
"""

from __future__ import annotations

import math

import torch


class MarkovText:
    def __init__(self, vocab_size: int, *, successors: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.next_VN = torch.randint(vocab_size, (vocab_size, successors), generator=g)
        self.probs_VN = torch.softmax(2.0 * torch.randn(vocab_size, successors, generator=g), -1)

    def mean_successor_entropy(self) -> float:
        """Entropy of the next token given the current one, averaged uniformly over tokens (nats):
        about the loss a model that learned the chain reaches."""
        p = self.probs_VN
        return float(-(p * p.log()).sum(-1).mean())

    def batch(self, batch_size: int, seq_len: int, *, seed: int) -> torch.Tensor:
        """``[batch_size, seq_len]`` int64 token ids, a pure function of ``seed``."""
        g = torch.Generator().manual_seed(seed)
        tokens = torch.empty(batch_size, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        for s in range(1, seq_len):
            choice = torch.multinomial(self.probs_VN[tokens[:, s - 1]], 1, generator=g).squeeze(1)
            tokens[:, s] = self.next_VN[tokens[:, s - 1], choice]
        return tokens

    @property
    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)
