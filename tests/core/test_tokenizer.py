"""The byte-level tokenizer: a standard tokenizer.json, chat template, streaming detokenization."""

from __future__ import annotations

import json

import pytest

from ddserve.serve.detok import IncrementalDetokenizer
from ddserve.tokenizer import SPECIALS, Tokenizer, write_byte_tokenizer

TEXTS = ["hello world", "  spaces\tand\nnewlines ", "héllo wörld", "日本語 😀 mixed ✓", ""]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_vocab_is_bytes_then_specials(tok):
    assert tok.vocab_size == 264
    assert tok.encode("A") == [65]
    assert tok.encode("é") == list("é".encode())
    for i, s in enumerate(SPECIALS):
        assert tok.encode(s) == [256 + i]
    assert tok.eos_token_id == 257 and tok.bos_token_id == 256


def test_model_config_uses_the_same_eos(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert Tokenizer.from_dir(tiny_model_dir).eos_token_id == cfg["eos_token_id"]


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_and_byte_ids(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text


def test_specials_in_text_and_bos(tok):
    ids = tok.encode("a<|im_end|>b", add_bos=True)
    assert ids == [256, 97, 259, 98]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>a<|im_end|>b"


def test_standard_files_load_in_transformers(tok, tok_dir):
    """tokenizer.json and the chat template are read the same way by HF transformers."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 😀"}]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == want
    assert want.endswith("<|im_start|>assistant\n")


def test_incremental_detokenizer_never_splits_characters(tok):
    text = "añ😀b日本 ✓"
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([i]) for i in tok.encode(text)] + [det.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_incremental_detokenizer_holds_then_flushes_a_broken_tail(tok):
    emoji = list("😀".encode())
    det = IncrementalDetokenizer(tok)
    assert det.push(list(b"ok") + emoji[:2]) == ""  # held back until the character completes
    assert det.push(emoji[2:]) == "ok😀"
    assert det.push(emoji[:1]) == ""
    assert det.flush() == "\ufffd"


@pytest.mark.parametrize("text", ["\ud800", "ok \udfff", "a\ud83d"])
def test_lone_surrogates_are_refused_with_their_position(tok, text):
    with pytest.raises(ValueError, match=f"U\\+{ord(text[-1]):04X} at character {len(text) - 1}"):
        tok.encode(text)


def test_surrogate_pairs_decoded_from_json_are_ordinary_text(tok):
    text = json.loads('"\\ud83d\\ude00"')
    assert text == "😀" and tok.encode(text) == list("😀".encode())


@pytest.mark.parametrize("allow_special", [True, False, None])
def test_encode_matches_hf_single_encode(tok_dir, tok, allow_special):
    """encode() goes through encode_batch (it releases the GIL): same ids as HF's encode."""
    from tokenizers import Tokenizer as HF

    hf = HF.from_file(str(tok_dir / "tokenizer.json"))
    hf.encode_special_tokens = allow_special is False
    for text in [*TEXTS, "a<|im_end|>b"]:
        want = hf.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, allow_special=allow_special) == want
