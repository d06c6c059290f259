"""The drafter seam (docs/architecture.md): what the engine asks of a drafter.

A drafter proposes per-depth logits for the D tokens after each stream's bonus token. The tree
builder turns them into a tree; the target decides. `DFlashDrafter` (model.py) is the real one;
testing.py holds drafters that need no target hidden states.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable

from torch import Tensor


class Drafter(ABC):
    depth: int  # D: draft depths per step (block size - 1)
    capture_layers: tuple[int, ...]  # target layers whose outputs it consumes (() for tests)
    max_streams: int | None = None  # streams its per-stream device state can hold (None: any)
    # the state row a verify graph's padding blocks draft from (`draft_rows`) and, where the graph
    # commits, commit nothing into: a row no stream owns, where the drafter has one
    pad_row: int = 0
    # whether a verify graph that drafts inside it (`state_rows`) also commits each stream's
    # accepted rows inside it (`commit_state`), the host then only `advance`-ing its lengths
    step_commits: bool = False

    @abstractmethod
    def add_stream(self, sid: Hashable, prompt_ids: list[int], hidden: Tensor | None) -> None: ...

    @abstractmethod
    def commit(self, sid: Hashable, token_ids: list[int], hidden: Tensor | None) -> None:
        """Tokens whose target hidden states now exist (root + accepted nodes each step)."""

    def commit_many(self, items: list[tuple[Hashable, list[int], Tensor | None]]) -> None:
        """`commit` for several streams at once (sid, token_ids, hidden); the engine calls this
        once per step. Drafters that can batch the work override it."""
        for sid, token_ids, hidden in items:
            self.commit(sid, token_ids, hidden)

    def commit_block(self, sids: list, token_ids: list[list[int]], hidden: Tensor) -> None:
        """`commit_many` with the hidden states as one block [B, W, C]: stream i's committed
        tokens are token_ids[i], their hidden states hidden[i, :len(token_ids[i])] (rows past
        that are ignored); the engine's call when the target captures hidden states. Drafters
        that can commit a fixed-shape block faster (DFlash: one CUDA graph) override it."""
        self.commit_many([
            (sid, toks, hidden[i, : len(toks)])
            for i, (sid, toks) in enumerate(zip(sids, token_ids, strict=True))
        ])  # fmt: skip

    @abstractmethod
    def draft(self, sids: list, bonus: Tensor) -> Tensor:
        """bonus [B] (each stream's last committed token) -> [B, D, V] per-depth logits."""

    @abstractmethod
    def remove_stream(self, sid: Hashable) -> None: ...

    def close(self) -> None:
        """Free what must go before the engine's communicator does (DFlash: its commit graphs,
        which captured all-reduces); the default holds nothing such."""
        return None

    def state_rows(self, sids: list) -> list[int] | None:
        """Indices of the streams' drafting state (host ints) when `draft_rows` computes `draft`
        from them as pure tensor code (the engine then captures the draft in its verify-step
        graph); None, the default: the engine calls `draft` eagerly."""
        return None

    def draft_rows(self, rows: Tensor, bonus: Tensor) -> Tensor:
        """`draft` from `state_rows(sids)` as a [B] device tensor: the same logits, no host
        work."""
        raise NotImplementedError(f"{type(self).__name__} drafts only through draft()")

    def commit_state(self, rows: Tensor, hidden: Tensor, counts: Tensor) -> None:
        """`commit_block` as pure tensor code inside the verify graph (`step_commits`): stream
        i (state row rows[i]) commits the first counts[i] rows of hidden [B, W, C] at its
        device length; a count of 0 commits nothing. The host's lengths stay behind until
        `advance`."""
        raise NotImplementedError(f"{type(self).__name__} commits only through commit_block()")

    def advance(self, sids: list, token_ids: list[list[int]]) -> None:
        """The host's side of a `commit_state` that committed token_ids[i] for stream sids[i]."""
        raise NotImplementedError(f"{type(self).__name__} commits only through commit_block()")

    def rewind(self, sids: list) -> None:
        """Undo a `commit_state` that was not `advance`d (a step that failed after its graph
        ran): the streams' device lengths back to the host's."""
        raise NotImplementedError(f"{type(self).__name__} commits only through commit_block()")
