"""A synthetic corpus the demo makes itself: deterministic, seeded, learnable.

Token ids follow a sparse random bigram chain over the real vocabulary (Zipf-distributed
starts, each token with a handful of likely successors), so a small model's loss falls well
below ln(vocab) within tens of steps, as on real text.
"""

from __future__ import annotations

import torch

__all__ = ["Corpus"]


class Corpus:
    """Bigram chain over `vocab` ids; `batch(step)` is the same for every arm."""

    def __init__(self, vocab: int, *, seed: int, successors: int = 4, hot: int = 2048) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.seed = seed
        # Most mass on a `hot` subset, Zipf-like, like the head of a real token distribution.
        ranks = torch.arange(1, hot + 1, dtype=torch.float64)
        self.start_p = (1.0 / ranks) / (1.0 / ranks).sum()
        self.hot = torch.randperm(vocab, generator=g)[:hot]
        self.next = self.hot[torch.randint(0, hot, (vocab, successors), generator=g)]
        self.next_p = torch.softmax(torch.randn(vocab, successors, generator=g, dtype=torch.float64)
                                    * 2.0, dim=-1)

    def batch(self, step: int, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (b, t), for training step `step`."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        seq = torch.empty(b, t + 1, dtype=torch.long)
        seq[:, 0] = self.hot[torch.multinomial(self.start_p, b, replacement=True, generator=g)]
        for i in range(t):
            prev = seq[:, i]
            choice = torch.multinomial(self.next_p[prev], 1, generator=g).squeeze(1)
            seq[:, i + 1] = self.next[prev, choice]
        return seq[:, :-1], seq[:, 1:]
