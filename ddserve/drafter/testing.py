"""Test drafters: they need no target hidden states, and every rank drafts the same logits."""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor

from ddserve.drafter.base import Drafter


class _ContextDrafter(Drafter):
    """Keeps each stream's token context (prompt + committed) on the host."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, depth: int) -> None:
        self.vocab_size, self.depth = vocab_size, depth
        self._ctx: dict[Hashable, list[int]] = {}

    def add_stream(self, sid: Hashable, prompt_ids: list[int], hidden: Tensor | None) -> None:
        self._ctx[sid] = list(prompt_ids)

    def commit(self, sid: Hashable, token_ids: list[int], hidden: Tensor | None) -> None:
        self._ctx[sid].extend(token_ids)

    def remove_stream(self, sid: Hashable) -> None:
        self._ctx.pop(sid, None)


class OracleDrafter(_ContextDrafter):
    """Knows each prompt's greedy continuation and proposes it with high confidence.

    continuations maps a prompt (tuple of ids) to its greedy output. At each depth the guessed
    token gets `margin` over seeded N(0, noise) logits of the others; with probability `corrupt`
    the guess is replaced by another token (the true one then only has its noise logit).
    Deterministic: a function of (seed, stream context length, depth), so every rank agrees.
    """

    def __init__(
        self,
        continuations: Mapping[tuple[int, ...], Sequence[int]],
        vocab_size: int,
        depth: int = 8,
        corrupt: float = 0.0,
        margin: float = 8.0,
        noise: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__(vocab_size, depth)
        self.corrupt, self.margin, self.noise, self.seed = corrupt, margin, noise, seed
        self._seq = {tuple(p): list(p) + list(c) for p, c in continuations.items()}
        self._full: dict[Hashable, list[int]] = {}

    def add_stream(self, sid: Hashable, prompt_ids: list[int], hidden: Tensor | None) -> None:
        super().add_stream(sid, prompt_ids, hidden)
        self._full[sid] = self._seq.get(tuple(prompt_ids), list(prompt_ids))

    def remove_stream(self, sid: Hashable) -> None:
        super().remove_stream(sid)
        self._full.pop(sid, None)

    def draft(self, sids: list, bonus: Tensor) -> Tensor:
        out = torch.empty(len(sids), self.depth, self.vocab_size)
        for b, sid in enumerate(sids):
            n, seq = len(self._ctx[sid]), self._full[sid]
            gen = torch.Generator().manual_seed(hash((self.seed, n)) & 0x7FFFFFFF)
            out[b] = torch.randn(self.depth, self.vocab_size, generator=gen) * self.noise
            rng = random.Random(hash((self.seed, n, 1)))
            for d in range(self.depth):
                guess = seq[n + d + 1] if n + d + 1 < len(seq) else 0
                if rng.random() < self.corrupt:
                    guess = (guess + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
                out[b, d, guess] += self.margin
        return out.to(bonus.device)


class RandomDrafter(_ContextDrafter):
    """Seeded random logits, a function of (seed, context length): identical on every rank."""

    def __init__(self, vocab_size: int, depth: int = 4, scale: float = 3.0, seed: int = 0) -> None:
        super().__init__(vocab_size, depth)
        self.scale, self.seed = scale, seed

    def draft(self, sids: list, bonus: Tensor) -> Tensor:
        out = torch.empty(len(sids), self.depth, self.vocab_size)
        for b, sid in enumerate(sids):
            gen = torch.Generator().manual_seed(hash((self.seed, len(self._ctx[sid]))) & 0x7FFFFFFF)
            out[b] = torch.randn(self.depth, self.vocab_size, generator=gen) * self.scale
        return out.to(bonus.device)
