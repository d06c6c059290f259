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
    Deterministic: a function of (seed, stream prompt, context length, depth), so every rank
    agrees, and streams at the same length draw different noise (their trees' off-path tokens
    differ) and different corruptions.
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
        self._key: dict[Hashable, int] = {}  # hash of the prompt: ints hash alike in every process

    def add_stream(self, sid: Hashable, prompt_ids: list[int], hidden: Tensor | None) -> None:
        super().add_stream(sid, prompt_ids, hidden)
        self._full[sid] = self._seq.get(tuple(prompt_ids), list(prompt_ids))
        self._key[sid] = hash(tuple(prompt_ids))

    def remove_stream(self, sid: Hashable) -> None:
        super().remove_stream(sid)
        self._full.pop(sid, None)
        self._key.pop(sid, None)

    def _seed(self, sid: Hashable, salt: int) -> int:
        """Seed of the stream's draw at its current context length (salt 0: noise, 1: guesses)."""
        return hash((self.seed, self._key[sid], len(self._ctx[sid]), salt)) & 0x7FFFFFFF

    def guesses(self, sid: Hashable) -> list[int]:
        """The proposed token at each depth: the continuation's, or a corrupted one."""
        n, seq = len(self._ctx[sid]), self._full[sid]
        rng = random.Random(self._seed(sid, 1))
        out = []
        for d in range(self.depth):
            guess = seq[n + d + 1] if n + d + 1 < len(seq) else 0
            if rng.random() < self.corrupt:
                guess = (guess + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
            out.append(guess)
        return out

    def draft(self, sids: list, bonus: Tensor) -> Tensor:
        out = torch.empty(len(sids), self.depth, self.vocab_size)
        for b, sid in enumerate(sids):
            gen = torch.Generator().manual_seed(self._seed(sid, 0))
            out[b] = torch.randn(self.depth, self.vocab_size, generator=gen) * self.noise
            for d, guess in enumerate(self.guesses(sid)):
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
