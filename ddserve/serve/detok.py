"""Incremental detokenization and stop strings for streamed output.

Two promises, each tested against a whole-sequence reference:
- `IncrementalDetokenizer`: the concatenation of what it emits equals `tokenizer.decode(all ids)`,
  and it never emits a prefix of a multi-byte character that later tokens complete (a trailing
  U+FFFD is held back until the next token decides it, or until `flush`).
- `StopChecker`: never emits any text at or past the first occurrence of a stop string; text that
  could be the start of a stop string is held back until it is decided.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Decodes a small window `ids[prefix:]` and compares it with `ids[prefix:read]` (the part already
    emitted), so each step costs the window, not the whole sequence. The window only advances past
    a point where the decoded text ends in a complete character, which is a clean byte boundary.
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids[: _read] are fully emitted

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly decided text (possibly empty)."""
        self._ids.extend(token_ids)
        window = self._tok.decode(self._ids[self._prefix :])
        if window.endswith(REPLACEMENT):
            return ""  # the last character may still be completed by the next token
        return self._advance(window)

    def flush(self) -> str:
        """The held-back tail (the sequence ended: undecodable bytes become U+FFFD)."""
        return self._advance(self._tok.decode(self._ids[self._prefix :]))

    def _advance(self, window: str) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read])
        delta = window[len(done) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta


class StopChecker:
    """Cuts streamed text at the first stop string, holding back a possible partial match."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add decoded text; return what is safe to emit. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        buf = self._held + text
        cut = self._first_match(buf)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The generation ended without a stop: release what was held back."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _first_match(self, buf: str) -> int | None:
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(self._longest - 1, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
