"""Tokenizers for serving: HF `tokenizers` files or a tiktoken BPE file, plus chat templates.

`Tokenizer.from_dir` picks the backend from what the checkpoint ships:
- `tokenizer.json` -> HF `tokenizers`;
- else `tiktoken.model` (Kimi K2 / K2.x: `base64(token_bytes) rank` per line) -> tiktoken, with
  Kimi's pre-tokenization regex and its special-token block: ids `n_base .. n_base + 257` (256
  reserved + 2), named by `tokenizer_config.json`'s `added_tokens_decoder`, else
  `<|reserved_token_{id}|>`.
`tokenizer_config.json` gives `bos_token`, `eos_token` and `chat_template` (a `chat_template.jinja`
beside it wins). `write_byte_tokenizer` writes the tiny model's tokenizer: the 256 bytes (id = byte
value, GPT-2 byte-to-unicode alphabet) followed by 8 special tokens.

Special tokens in text: `encode(text, allow_special=False)` encodes special-token strings as plain
text (user input must not inject control tokens); a rendered chat prompt, whose special tokens the
template inserted, is encoded with `allow_special=True`. `allow_special=None` keeps each backend's
historical default (HF: parsed; tiktoken: plain text).

Text must be valid Unicode: a lone surrogate (JSON can carry one as `"\\ud800"`) has no UTF-8
encoding, so `encode` refuses it with a `ValueError` naming the position (`check_unicode`).
Encoding releases the GIL (HF: `encode_batch`), so a long prompt tokenized on a worker thread
does not stall the event loop that serves other requests.
"""

from __future__ import annotations

import base64
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Protocol

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

SPECIALS = (
    "<|bos|>",
    "<|eos|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|mask|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_byte_tokenizer(out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json for a 264-token byte-level vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# Kimi's pre-tokenizer (tokenization_kimi.py `pat_str`): Han runs stand alone, letters split on case
# changes with English contractions attached, digits in groups of 1-3, then the cl100k tail.
_KIMI_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_KIMI_LETTERS_UPPER}*{_KIMI_LETTERS_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_KIMI_LETTERS_UPPER}+{_KIMI_LETTERS_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
KIMI_NUM_SPECIAL = 256 + 2  # num_reserved_special_tokens + 2, right after the BPE ranks
_MAX_CHUNK_CHARS = 400_000  # tiktoken's limit per call
_MAX_RUN_CHARS = 25_000  # longest whitespace / non-whitespace run per call (tiktoken issue 195)


def check_unicode(text: str) -> None:
    """Raise ValueError if `text` has a lone surrogate (no valid UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        raise ValueError(
            f"invalid Unicode: lone surrogate U+{bad:04X} at character {e.start} "
            "(text must be valid UTF-8; escape surrogate pairs together)"
        ) from None


def _token_str(tok: str | dict | None) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _chat_template(path: Path, config: dict) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


class Backend(Protocol):
    vocab_size: int

    def encode(self, text: str, allow_special: bool | None) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...


class HFBackend:
    """HF `tokenizers`. Two copies: one parses special-token strings, one encodes them as text."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _plain(self) -> HFTokenizer:
        plain = HFTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode(self, text: str, allow_special: bool | None) -> list[int]:
        tok = self._plain if allow_special is False else self._tok
        # encode_batch releases the GIL while the Rust side works; encode holds it throughout
        return tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token_bytes) rank` per line. (Read directly, not through
    `tiktoken.load`, which caches by path in the temp dir and would serve a stale copy.)"""
    ranks = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a `base64 rank` line: {line[:80]!r}") from e
    return ranks


def _split_long_runs(text: str) -> list[str]:
    """Cuts as Kimi's encode does: every 400k chars, then inside runs longer than 25k chars."""
    pieces, long_run = [], re.compile(rf"\s{{{_MAX_RUN_CHARS + 1},}}|\S{{{_MAX_RUN_CHARS + 1},}}")
    for start in range(0, len(text), _MAX_CHUNK_CHARS):
        chunk, cut = text[start : start + _MAX_CHUNK_CHARS], 0
        for run in long_run.finditer(chunk):
            for pos in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                pieces.append(chunk[cut:pos])
                cut = pos
        pieces.append(chunk[cut:])
    return pieces


class TiktokenBackend:
    """tiktoken BPE over a Kimi-style special-token block (see the module docstring)."""

    def __init__(self, ranks: dict[bytes, int], config: dict, pat_str: str = KIMI_PAT_STR) -> None:
        import tiktoken

        n_base = len(ranks)
        if sorted(ranks.values()) != list(range(n_base)):
            raise ValueError("tiktoken ranks must be 0 .. n-1: special tokens are numbered from n")
        listed = {int(i): t for i, t in config.get("added_tokens_decoder", {}).items()}
        if any(i < n_base for i in listed):
            raise ValueError(f"added_tokens_decoder ids must be >= {n_base} (the BPE ranks)")
        ids = sorted(set(range(n_base, n_base + KIMI_NUM_SPECIAL)) | set(listed))
        specials = {_token_str(listed.get(i)) or f"<|reserved_token_{i}|>": i for i in ids}
        if len(specials) != len(ids):
            raise ValueError("added_tokens_decoder names one token string twice")
        self._specials, self._special_ids, self._n_base = specials, set(ids), n_base
        text_like = {
            i for i, t in listed.items() if isinstance(t, dict) and t.get("special") is False
        }
        self._skip = set(ids) - text_like  # what skip_special_tokens drops
        self._enc = tiktoken.Encoding(
            "kimi", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials
        )
        self.vocab_size = self._enc.n_vocab

    def encode(self, text: str, allow_special: bool | None) -> list[int]:
        ids: list[int] = []
        for piece in _split_long_runs(text):
            if allow_special:
                ids += self._enc.encode(piece, allowed_special="all")
            else:
                ids += self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Undecodable bytes (a character cut by the end) become U+FFFD; unknown ids are dropped."""
        skip = self._skip if skip_special_tokens else set()
        known = [i for i in ids if 0 <= i < self._n_base or i in self._special_ids]
        keep = [i for i in known if i not in skip]
        return self._enc.decode(keep, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        try:
            return self._enc.encode_single_token(token.encode())
        except KeyError:
            return None


def has_tokenizer(path: str | Path) -> bool:
    """Whether `Tokenizer.from_dir(path)` finds a tokenizer file there."""
    return any((Path(path) / f).exists() for f in ("tokenizer.json", "tiktoken.model"))


class Tokenizer:
    def __init__(
        self, backend: Backend | HFTokenizer, config: dict, chat_template: str | None = None
    ) -> None:
        self._tok = HFBackend(backend) if isinstance(backend, HFTokenizer) else backend
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = chat_template or config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception  # as HF: templates reject bad input
        self._template = env.from_string(template) if isinstance(template, str) else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = _chat_template(path, config)
        if (path / "tokenizer.json").exists():
            return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), config, template)
        if (path / "tiktoken.model").exists():
            ranks = read_tiktoken_ranks(path / "tiktoken.model")
            return cls(TiktokenBackend(ranks, config), config, template)
        raise FileNotFoundError(
            f"No tokenizer in {path}: expected tokenizer.json (HF tokenizers) or tiktoken.model "
            "(tiktoken BPE ranks, as Kimi K2 ships)."
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    def encode(
        self, text: str, add_bos: bool = False, allow_special: bool | None = None
    ) -> list[int]:
        """`allow_special`: True turns special-token strings into their ids (rendered chat
        prompts); False encodes them as plain text (user text); None is the backend's default.
        Raises ValueError for invalid Unicode (`check_unicode`)."""
        check_unicode(text)
        ids = self._tok.encode(text, allow_special)
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("tokenizer has no bos_token")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("tokenizer_config.json has no chat_template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class PromptTokenizer(Protocol):
    bos_token_id: int | None

    def encode(
        self, text: str, add_bos: bool = False, allow_special: bool | None = None
    ) -> list[int]: ...


def encode_prompt(tok: PromptTokenizer, text: str) -> list[int]:
    """A raw text prompt's ids, the same offline (`LLM.generate`, `ddserve generate`) and over
    HTTP (`/v1/completions`): BOS first when the tokenizer has one (as HF's DeepSeek-V3 tokenizer
    does with `add_bos_token`), and special-token strings in the text parsed as their ids (a raw
    prompt may spell control tokens on purpose, in a hand-made template, as in vLLM)."""
    bos = getattr(tok, "bos_token_id", None) is not None
    return tok.encode(text, add_bos=bos, allow_special=True)
