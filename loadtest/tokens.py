"""Counting prompt lengths in the served model's tokens.

`--input-len` means what vLLM's and SGLang's benchmarks mean by it: tokens of the served model,
as the server's `usage.prompt_tokens` reports them (BOS and chat-template tokens included). A
`TokenCounter` predicts that number for a text, from one of three sources:

- `--tokenizer DIR`: the checkpoint's own tokenizer (`ddserve.tokenizer`) counts the text
  exactly; one probe request measures the tokens the server adds around it (BOS, chat template).
- default: three probe requests (`max_tokens` 1) of known word and byte counts; their
  `usage.prompt_tokens` fit `overhead + per_word * words + per_byte * utf8_bytes`, which is
  exact for a byte-level tokenizer and for a BPE that spends one token per common word.
- a server that reports no usage: an estimate of 4 UTF-8 bytes per token (`ESTIMATE`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class TokenCounter:
    """Prompt tokens the server counts for a text: `overhead` + the text's own tokens."""

    overhead: float = 0.0  # tokens the server adds per request (BOS, chat template)
    per_word: float = 0.0
    per_byte: float = 0.25
    encode: Encode | None = None  # exact text counts when given; the fit is unused then
    source: str = "estimate: 4 bytes per token (the server reported no usage)"

    def text_tokens(self, text: str) -> int:
        """Tokens of `text` alone (no BOS, no template)."""
        if self.encode is not None:
            return len(self.encode(text))
        fit = self.per_word * len(text.split()) + self.per_byte * len(text.encode("utf-8"))
        return max(1, round(fit))

    def __call__(self, text: str) -> int:
        """`usage.prompt_tokens` the server will report for a prompt of this text."""
        return max(1, round(self.overhead + self.text_tokens(text)))

    def describe(self) -> dict:
        return {
            "source": self.source,
            "overhead": round(self.overhead, 3),
            **({} if self.encode else {"per_word": self.per_word, "per_byte": self.per_byte}),
        }


ESTIMATE = TokenCounter()


def _features(text: str) -> tuple[int, int]:
    return len(text.split()), len(text.encode("utf-8"))


def fit_counter(probes: Sequence[tuple[str, int]]) -> TokenCounter:
    """The counter that reproduces three probes' (text, prompt_tokens): the first two differ in
    word count, the last two have equal word counts and different byte counts."""
    (t1, y1), (t2, y2), (t3, y3) = probes
    (w1, b1), (w2, b2), (w3, b3) = (_features(t) for t in (t1, t2, t3))
    if w2 != w3 or b2 == b3 or w1 == w2:
        raise ValueError("probes need word counts w1 != w2 == w3 and byte counts b2 != b3")
    per_byte = max(0.0, (y3 - y2) / (b3 - b2))
    per_word = max(0.0, ((y2 - y1) - per_byte * (b2 - b1)) / (w2 - w1))
    if per_byte == per_word == 0:
        raise ValueError(f"the server's prompt token counts {[y1, y2, y3]} do not grow with text")
    overhead = y1 - per_word * w1 - per_byte * b1
    source = "fit to 3 probe requests' usage.prompt_tokens"
    return TokenCounter(overhead, round(per_word, 4), round(per_byte, 4), None, source)


def with_tokenizer(encode: Encode, probe: tuple[str, int] | None, name: str) -> TokenCounter:
    """Exact counts from the model's tokenizer; the overhead from one probe (0 without one)."""
    if probe is None:
        return TokenCounter(0.0, encode=encode, source=f"tokenizer {name}; overhead unknown")
    text, prompt_tokens = probe
    overhead = float(prompt_tokens - len(encode(text)))
    return TokenCounter(overhead, encode=encode, source=f"tokenizer {name} + one probe request")


def fit_words(words: Sequence[str], target: int, count: Callable[[str], int]) -> str:
    """The prefix of `words` (at least one word) whose text `count`s closest to `target`.

    `count` must not decrease as words are appended (true of any tokenizer's counts). It is close
    to linear in the number of words, so interpolation finds the prefix in a few calls; a step
    that fails to halve the bracket is followed by a bisection step."""
    text = lambda k: " ".join(words[:k])
    lo, c_lo = 1, count(text(1))
    hi, c_hi = len(words), count(text(len(words)))
    if c_lo >= target or c_hi <= target:
        return text(1 if c_lo >= target else hi)
    bisect = False
    while hi - lo > 1:  # c_lo < target < c_hi
        width = hi - lo
        k = (lo + hi) // 2 if bisect else lo + round((target - c_lo) * width / (c_hi - c_lo))
        k = min(max(k, lo + 1), hi - 1)
        c = count(text(k))
        if c == target:
            return text(k)
        lo, c_lo, hi, c_hi = (k, c, hi, c_hi) if c < target else (lo, c_lo, k, c)
        bisect = not bisect and hi - lo > width // 2
    return text(lo if target - c_lo < c_hi - target else hi)
