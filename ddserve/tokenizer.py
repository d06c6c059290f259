"""Tokenizer over HF `tokenizers` files, chat templates, and streaming detokenization.

`Tokenizer.from_dir` reads `tokenizer.json` and `tokenizer_config.json` (`chat_template`,
`bos_token`, `eos_token`). `write_byte_tokenizer` writes the tiny model's tokenizer: the 256
bytes (id = byte value, GPT-2 byte-to-unicode alphabet) followed by 8 special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _bytes_to_unicode() -> dict[int, str]:
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
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
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


def _token_str(tok: str | dict | None) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict) -> None:
        self._tok = tok
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception  # as HF: templates reject bad input
        self._template = env.from_string(template) if template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("tokenizer has no bos_token")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("tokenizer_config.json has no chat_template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
