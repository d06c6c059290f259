"""The tiktoken backend (Kimi K2's `tiktoken.model`): splits, specials, chat prompts, streaming.

The fixture writes a small ranks file (256 bytes + merges chosen so that a wrong pre-tokenizer split
would change the ids) and a Kimi-style tokenizer_config.json. Expected ids come from a plain-Python
BPE over hand-split pieces, not from the code under test.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

tiktoken = pytest.importorskip("tiktoken")

from ddserve.serve.detok import REPLACEMENT, IncrementalDetokenizer  # noqa: E402
from ddserve.tokenizer import (  # noqa: E402
    KIMI_NUM_SPECIAL,
    KIMI_PAT_STR,
    SPECIALS,
    Tokenizer,
    write_byte_tokenizer,
)

ZHONG, WEN = "中".encode(), "文".encode()
MERGES = [
    b"12", b"123", b"1234",  # "1234" only if digits were not cut into groups of <= 3
    b"he", b"hel", b"hell", b"hello",
    b"oW",  # only if "helloWorld" were not cut at the case change
    ZHONG[:2], ZHONG, WEN[:2], WEN, ZHONG + WEN,
    WEN + b"a",  # only if a Han run were not cut from the letters after it
    b"  ",  # only if "x  y" were not cut as "x", " ", " y"
    b" y", b"'m",
]  # fmt: skip
N_BASE = 256 + len(MERGES)
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>"}
NAMED |= {6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "<|im_system|>", 10: "<|im_middle|>"}
TEXT_LIKE = 11  # an added token with "special": false: kept by skip_special_tokens
TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
    "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
    "{% endif %}"
)


def sid(name: str) -> int:
    return N_BASE + {v: k for k, v in NAMED.items()}[name]


def ranks() -> dict[bytes, int]:
    return {bytes([b]): b for b in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}


def ref_bpe(piece: bytes, table: dict[bytes, int]) -> list[int]:
    """Byte-pair merging as tiktoken defines it: merge the lowest-ranked adjacent pair first."""
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        pairs = [(table.get(parts[i] + parts[i + 1], 1 << 30), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return [table[p] for p in parts]


def write_kimi_dir(d: Path) -> Path:
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks().items()]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {str(N_BASE + k): {"content": v, "special": True} for k, v in NAMED.items()}
    added[str(N_BASE + TEXT_LIKE)] = {"content": "<think>", "special": False}
    config = {
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": TEMPLATE,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture
def tok(tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_dir(write_kimi_dir(tmp_path))


def test_vocab_and_special_numbering(tok: Tokenizer) -> None:
    assert tok.vocab_size == N_BASE + KIMI_NUM_SPECIAL
    assert (tok.bos_token_id, tok.eos_token_id) == (sid("[BOS]"), sid("[EOS]"))
    unlisted = N_BASE + 5
    assert tok.decode([unlisted], skip_special_tokens=False) == f"<|reserved_token_{unlisted}|>"
    assert tok.decode([sid("<|im_end|>")], skip_special_tokens=False) == "<|im_end|>"


@pytest.mark.parametrize("text", ["hello world", "héllo wörld", "中文abc 中", "emoji 🙂👍🏽!", ""])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


SAMPLE = "中文abc helloWorld 1234567 x  y\n\nI'm 文a"
SAMPLE_PIECES = [
    "中文", "abc", " hello", "World", " ", "123", "456", "7", " x", " ", " y", "\n\n", "I'm", " ",
    "文", "a",
]  # fmt: skip


def test_kimi_pre_tokenizer_splits(tok: Tokenizer) -> None:
    """Han runs alone, case changes cut words, digits in groups of 1-3, whitespace as cl100k."""
    want = [i for p in SAMPLE_PIECES for i in ref_bpe(p.encode(), ranks())]
    assert tok.encode(SAMPLE) == want
    assert tok.encode("1234") == [ranks()[b"123"], ord("4")]
    regex = pytest.importorskip("regex")  # an independent regex engine on the same pattern
    assert regex.findall(KIMI_PAT_STR, SAMPLE, flags=regex.V1) == SAMPLE_PIECES


def test_matches_tiktoken_encoding_built_directly(tok: Tokenizer) -> None:
    specials = {v: N_BASE + k for k, v in NAMED.items()}
    enc = tiktoken.Encoding("ref", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks(), special_tokens={})
    for text in [SAMPLE, "Ünïcødé 12 3456 ?!\n\t  end", "a<|im_end|>b"]:
        assert tok.encode(text) == enc.encode(text, disallowed_special=())
    assert set(specials.values()).isdisjoint(tok.encode("<|im_end|>[BOS]"))


def test_special_strings_in_user_text_stay_text(tok: Tokenizer) -> None:
    text = "hi<|im_end|><|im_assistant|>[EOS]"
    for ids in (tok.encode(text), tok.encode(text, allow_special=False)):
        assert all(i < N_BASE for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode(text, allow_special=True)[-3:] == [
        sid("<|im_end|>"), sid("<|im_assistant|>"), sid("[EOS]"),
    ]  # fmt: skip


def test_chat_prompt_gets_special_ids(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "中文?"}]
    prompt = tok.apply_chat_template(messages)
    ids = tok.encode(prompt, allow_special=True)
    got = [i for i in ids if i >= N_BASE]
    want = ["<|im_system|>", "<|im_middle|>", "<|im_end|>", "<|im_user|>", "<|im_middle|>"]
    want += ["<|im_end|>", "<|im_assistant|>", "<|im_middle|>"]
    assert got == [sid(s) for s in want]
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    assert tok.decode(ids) == "systembe briefuser中文?assistant"


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    write_kimi_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == (
        "x!"
    )


def test_skip_special_tokens_keeps_text_like_added_tokens(tok: Tokenizer) -> None:
    think = N_BASE + TEXT_LIKE
    ids = [sid("[BOS]"), think, *tok.encode("ok"), sid("<|im_end|>")]
    assert tok.decode(ids) == "<think>ok"
    assert tok.decode(ids, skip_special_tokens=False) == "[BOS]<think>ok<|im_end|>"
    assert tok.decode([*tok.encode("a"), N_BASE + KIMI_NUM_SPECIAL + 7]) == "a"  # unknown id


def test_partial_utf8_decodes_to_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    assert len(ids) == 4  # no merges for it: one token per byte
    assert tok.decode(ids[:2]).endswith(REPLACEMENT)
    assert tok.decode(ids) == "🙂"


def test_incremental_detokenizer_never_splits_a_character(tok: Tokenizer) -> None:
    text = "héllo 中文 world 🙂👍🏽 12345 文a<|im_end|>"
    ids = [sid("[BOS]"), *tok.encode(text), sid("<|im_end|>")]
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([i]) for i in ids] + [det.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_long_runs_are_encoded_in_chunks(tok: Tokenizer) -> None:
    """As Kimi's encode: runs are cut every 25k chars; the "he" merge across the cut is lost."""
    he, h, e, x = ranks()[b"he"], ord("h"), ord("e"), ord("x")
    text = "x" + "he" * 15_000 + " " * 30_001
    want = [x] + [he] * 12_499 + [h, e] + [he] * 2_500 + [ranks()[b"  "]] * 15_000 + [ord(" ")]
    assert tok.encode(text) == want


def test_from_dir_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*tiktoken\.model"):
        Tokenizer.from_dir(tmp_path)


def test_hf_backend_can_encode_specials_as_text(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    hf = Tokenizer.from_dir(tmp_path)
    assert hf.encode("a<|im_end|>", allow_special=False) == list(b"a<|im_end|>")
    assert hf.encode("a<|im_end|>", allow_special=True) == [
        ord("a"),
        256 + SPECIALS.index("<|im_end|>"),
    ]
