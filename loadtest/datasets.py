"""Prompt sources: random prompts, a JSONL file, or a ShareGPT-style JSON file.

Lengths are in the served model's tokens as a `TokenCounter` (loadtest/tokens.py) predicts them:
a random prompt is the prefix of a random word sequence whose predicted `usage.prompt_tokens` is
closest to its drawn length; a file's prompt gets its predicted count. The server's `usage` gives
the real prompt and output token counts, and the metrics use those. `--output-len` sets
`max_tokens`; with `--ignore-eos` the server generates exactly that many tokens.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from loadtest.tokens import ESTIMATE, TokenCounter, fit_words

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have which one "
    "you were all we when there can been more if will no out so up said what its about than into "
    "them only other new some time could these two may first then do any like my now over such "
    "our man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right "
    "used take three small large city water house light river stone green north market music"
).split()


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_len: int  # predicted usage.prompt_tokens (the server's usage replaces it)
    output_len: int  # max_tokens to request


def sample_lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length drawn uniformly from [mean*(1-r), mean*(1+r)] (vLLM's --random-range-ratio)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(mean * (1.0 - range_ratio)))
    hi = max(lo, int(mean * (1.0 + range_ratio)))
    return rng.randint(lo, hi)


def random_prompts(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    counter: TokenCounter = ESTIMATE,
) -> list[Prompt]:
    """`num` prompts of random words, each as close to its drawn length in `counter`'s tokens as
    whole words allow; deterministic in `seed`."""
    rng = random.Random(seed)
    per_word = counter.text_tokens(" ".join(_WORDS)) / len(_WORDS)  # mean tokens per word
    prompts = []
    for _ in range(num):
        n_in = sample_lengths(rng, input_len, range_ratio)
        n_out = sample_lengths(rng, output_len, range_ratio)
        n_words = math.ceil(1.25 * n_in / per_word) + 8  # a margin of many standard deviations
        words = [rng.choice(_WORDS) for _ in range(n_words)]
        text = fit_words(words, n_in, counter)
        prompts.append(Prompt(text=text, prompt_len=counter(text), output_len=n_out))
    return prompts


def probe_texts() -> list[str]:
    """Three texts for `tokens.fit_counter`: 16 and 64 short words, then 64 long words."""
    short = [w for w in _WORDS if len(w) <= 3]
    long = [w for w in _WORDS if len(w) >= 5]
    pick = lambda pool, n: " ".join(pool[i % len(pool)] for i in range(n))
    return [pick(short, 16), pick(short, 64), pick(long, 64)]


def jsonl_prompts(
    path: str | Path, default_output_len: int, counter: TokenCounter = ESTIMATE
) -> list[Prompt]:
    """One JSON object per line: {"prompt": str, "output_len"|"max_tokens": int (optional)}."""
    prompts = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: each line needs a string 'prompt'")
        out = int(row.get("output_len", row.get("max_tokens", default_output_len)))
        prompts.append(Prompt(row["prompt"], counter(row["prompt"]), out))
    return prompts


def sharegpt_prompts(
    path: str | Path, output_len: int | None = None, counter: TokenCounter = ESTIMATE
) -> list[Prompt]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human"|"gpt", "value": str}, ...]}.

    Uses the first human turn as the prompt and the reply's token count as `output_len` (or
    `output_len` when given); skips conversations with fewer than two turns or very short
    prompts/replies (under 4 tokens of text), as vLLM's sampler does.
    """
    prompts = []
    for conv in json.loads(Path(path).read_text()):
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        text, reply = turns[0].get("value", ""), turns[1].get("value", "")
        n_in, n_reply = counter.text_tokens(text), counter.text_tokens(reply)
        if n_in < 4 or (output_len is None and n_reply < 4):
            continue
        prompts.append(Prompt(text, counter(text), output_len or n_reply))
    return prompts


def take(prompts: list[Prompt], num: int, seed: int = 0) -> list[Prompt]:
    """`num` prompts: a seeded shuffle of the file's prompts, cycled if there are fewer."""
    if not prompts:
        raise ValueError("the dataset holds no usable prompt")
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(num)]
