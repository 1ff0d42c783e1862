"""Generated training data that a model can learn: a sparse random Markov chain over the
vocabulary (each token has a few likely successors), so next-token loss falls from ln(V) towards
the chain's entropy rate instead of staying at noise level.
"""

from __future__ import annotations

import math

import torch

_MASK63 = 2**63 - 1


class MarkovText:
    def __init__(self, vocab_size: int, *, successors: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.next_VN = torch.randint(vocab_size, (vocab_size, successors), generator=g)
        self.probs_VN = torch.softmax(2.0 * torch.randn(vocab_size, successors, generator=g), -1)
        self.cumulative_VN = self.probs_VN.double().cumsum(-1)

    def loss_floor(self, seq_len: int) -> float:
        """The next-token loss (nats) of a model that knows the chain, on :meth:`batch`'s sequences:
        each token's successor entropy (repeated successors merged), averaged over the positions
        that are predicted, 1 .. seq_len - 1, with the state distribution each has (uniform at 0)."""
        next_VV = torch.zeros(self.vocab_size, self.vocab_size, dtype=torch.float64)
        next_VV.scatter_add_(1, self.next_VN, self.probs_VN.double())
        entropy_V = -(next_VV * next_VV.clamp(min=1e-300).log()).sum(-1)
        state_V = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        total = 0.0
        for _ in range(1, seq_len):
            total += float(state_V @ entropy_V)
            state_V = state_V @ next_VV
        return total / max(seq_len - 1, 1)

    def batch(self, batch_size: int, seq_len: int, *, seed: int, first: int = 0) -> torch.Tensor:
        """``[batch_size, seq_len]`` int64 token ids: sequences ``first .. first + batch_size - 1`` of
        the stream ``seed``. Each sequence is a pure function of ``(seed, its index)`` (its own
        generator), so a step's global batch is the same however many ranks read its slices: rank
        ``d`` of ``n`` data ranks reading ``first = d * batch_size`` gives, together, what one rank
        reading ``n * batch_size`` from 0 gets."""
        uniform_BS = torch.empty(batch_size, seq_len, dtype=torch.float64)
        for row in range(batch_size):
            g = torch.Generator().manual_seed((seed * 1_000_003 + first + row) & _MASK63)
            uniform_BS[row] = torch.rand(seq_len, generator=g, dtype=torch.float64)
        tokens = torch.empty(batch_size, seq_len, dtype=torch.long)
        tokens[:, 0] = (uniform_BS[:, 0] * self.vocab_size).long().clamp(max=self.vocab_size - 1)
        last = self.cumulative_VN.shape[1] - 1
        for s in range(1, seq_len):  # inverse CDF: the first successor whose cumulative probability passes u
            cumulative_BN = self.cumulative_VN[tokens[:, s - 1]]
            choice = (uniform_BS[:, s, None] > cumulative_BN).sum(-1).clamp(max=last)
            tokens[:, s] = self.next_VN[tokens[:, s - 1], choice]
        return tokens

    @property
    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)
