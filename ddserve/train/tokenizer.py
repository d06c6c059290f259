"""Stage 2: a byte-level BPE tokenizer for Python, trained on the corpus's train split.

4096 tokens: ddserve's specials first (`ddserve.tokenizer.SPECIALS`: `<|bos|>` = 0, `<|eos|>` = 1,
`<|im_start|>`, `<|im_end|>`, `<|mask|>` (the drafter's mask), reserved), then the 256 byte
symbols, then merges. Pre-tokenization keeps code cheap: a line break together with the next
line's indentation is one piece (`"\\n        "`), so BPE merges it into a single token and
indentation costs one token per line; other whitespace runs are pieces of their own. Written as
`tokenizer.json` + `tokenizer_config.json` (bos, eos, `CHAT_TEMPLATE`) for
`ddserve.tokenizer.Tokenizer.from_dir` and `transformers`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ddserve.tokenizer import CHAT_TEMPLATE, SPECIALS

VOCAB_SIZE = 4096
# cl100k's split, except that trailing blanks + line breaks + the next indentation are one piece,
# punctuation runs do not swallow the line break, and numbers keep a leading space (" 1").
PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"|[ \t]*[\r\n]+[ \t]*|\s+(?!\S)|\s+"
)
MODEL_MAX_LENGTH = 4096


def empty_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train(texts: list[str], vocab_size: int = VOCAB_SIZE, progress: bool = True) -> HFTokenizer:
    """BPE over `texts`; exactly `vocab_size` tokens including the specials."""
    tok = empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def write(tok: HFTokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def bytes_per_token(tok: HFTokenizer, texts: list[str]) -> tuple[float, int]:
    """(UTF-8 bytes per token, tokens) over `texts`, special-token strings encoded as text."""
    plain = HFTokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    n_tokens = sum(len(e.ids) for e in plain.encode_batch_fast(texts, add_special_tokens=False))
    n_bytes = sum(len(t.encode()) for t in texts)
    return n_bytes / max(n_tokens, 1), n_tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddserve.train.tokenizer",
        description="Train the byte-level BPE (ddserve's specials + chat template) on the train "
        "split of corpus.tar.xz and report bytes/token on both splits.",
    )
    p.add_argument("--corpus", default=".train/corpus.tar.xz", help="from ddserve.train.corpus")
    p.add_argument("--out", default=".train/tokenizer", help="directory to write")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="total, specials included")
    args = p.parse_args(argv)
    from ddserve.train.data import read_corpus

    texts = read_corpus(args.corpus)
    tok = train(texts["train"], args.vocab_size)
    out = write(tok, args.out)
    stats = {"vocab_size": tok.get_vocab_size(with_added_tokens=True)}
    for split, split_texts in texts.items():
        bpt, n = bytes_per_token(tok, split_texts)
        stats[split] = {"files": len(split_texts), "tokens": n, "bytes_per_token": round(bpt, 3)}
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(f"wrote {out}: {json.dumps(stats)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
