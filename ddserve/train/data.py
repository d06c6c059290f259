"""The tokenized corpus: token streams of the train and eval splits, and batches from them.

`corpus.tar.xz` (written by `ddserve.train.corpus`) holds each source file at
`<split>/<source>/<path>` in manifest order. A split's stream is every file of it in that order as
`<|bos|> tokens <|eos|>`; `<split>_starts` are the offsets of the files' `<|bos|>`. Special-token
strings that occur in source text are encoded as plain text, never as control tokens.
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import numpy as np
import torch

SPLITS = ("train", "eval")


def read_corpus(corpus_tar: str | Path) -> dict[str, list[str]]:
    """split -> file texts in manifest (archive) order."""
    texts: dict[str, list[str]] = {s: [] for s in SPLITS}
    with tarfile.open(corpus_tar, "r:*") as tar:
        for member in tar:
            split = member.name.split("/", 1)[0]
            if member.isfile() and split in texts:
                texts[split].append(tar.extractfile(member).read().decode("utf-8"))
    return texts


def _tokenizer(tokenizer_dir: str | Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.encode_special_tokens = True  # "<|eos|>" inside a source file is text, not a control
    return tok


def encode_files(texts: list[str], tokenizer_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(stream [N] int32 of `<|bos|> ids <|eos|>` per file, starts [F] int64)."""
    tok = _tokenizer(tokenizer_dir)
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    encoded = tok.encode_batch_fast(texts, add_special_tokens=False) if texts else []
    pieces = [np.array([bos, *e.ids, eos], dtype=np.int32) for e in encoded]
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(pieces) else lengths
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return stream, starts.astype(np.int64)


def _cache_key(corpus_tar: Path, tokenizer_dir: Path) -> str:
    h = hashlib.sha256()
    for f in (corpus_tar, tokenizer_dir / "tokenizer.json"):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def load_token_splits(
    corpus_tar: str | Path, tokenizer_dir: str | Path, cache_dir: str | Path | None = None
) -> dict[str, np.ndarray]:
    """{"train", "eval"}: int32 token streams; {"train_starts", "eval_starts"}: int64 offsets of
    each file's `<|bos|>`. With `cache_dir`, reuses an `.npz` keyed by the two inputs' bytes."""
    corpus_tar, tokenizer_dir = Path(corpus_tar), Path(tokenizer_dir)
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"tokens-{_cache_key(corpus_tar, tokenizer_dir)}.npz"
        if cache.exists():
            with np.load(cache) as z:
                return {k: z[k] for k in z.files}
    out: dict[str, np.ndarray] = {}
    for split, texts in read_corpus(corpus_tar).items():
        out[split], out[f"{split}_starts"] = encode_files(texts, tokenizer_dir)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache, **out)
    return out


def windows(stream: torch.Tensor, seq_len: int, offset: int = 0) -> torch.Tensor:
    """Non-overlapping [W, seq_len + 1] windows from `offset` (inputs = w[:, :-1], targets =
    w[:, 1:]); consecutive windows share one token so every position is a target once."""
    n = (stream.numel() - offset - 1) // seq_len
    if n < 1:
        raise ValueError(f"a stream of {stream.numel()} tokens has no window of {seq_len + 1}")
    idx = offset + torch.arange(n, device=stream.device).unsqueeze(1) * seq_len
    return stream[idx + torch.arange(seq_len + 1, device=stream.device)]  # [W, seq_len + 1]


class Batches:
    """Endless shuffled batches of train windows: each epoch a new random offset and order."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> None:
        self.stream, self.seq_len, self.batch = stream, seq_len, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch, self._queue = 0, torch.zeros(0, dtype=torch.int64)

    def _refill(self) -> None:
        offset = int(torch.randint(self.seq_len, (1,), generator=self.gen))
        n = (self.stream.numel() - offset - 1) // self.seq_len
        starts = offset + torch.randperm(n, generator=self.gen) * self.seq_len
        self._queue = torch.cat([self._queue, starts])
        self.epoch += 1

    def next(self) -> torch.Tensor:  # [batch, seq_len + 1] on the stream's device
        while self._queue.numel() < self.batch:
            self._refill()
        starts, self._queue = self._queue[: self.batch], self._queue[self.batch :]
        idx = starts.to(self.stream.device).unsqueeze(1)
        return self.stream[idx + torch.arange(self.seq_len + 1, device=self.stream.device)]
