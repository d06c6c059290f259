"""IncrementalDetokenizer and StopChecker against whole-sequence references, on random splits."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ddserve.serve.detok import IncrementalDetokenizer, StopChecker
from ddserve.tokenizer import bytes_to_unicode


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    """One token per byte (id == byte value) plus merged tokens that split characters."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    # Tokens that end or start inside a UTF-8 character: "é" = C3 A9, "€" = E2 82 AC.
    for a, b in [(0xC3, 0xA9), (0x61, 0xE2), (0x82, 0xAC)]:
        merges.append((b2u[a], b2u[b]))
        vocab[b2u[a] + b2u[b]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class _Decode:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _random_text(rng: random.Random) -> str:
    pieces = ["a", "b", " ", "é", "€", "漢字", "🙂", "\n", "aé", "x€y"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


def _stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.push(c) for c in chunks] + [detok.flush()]


def test_multibyte_tokens_really_split_characters(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("a€").ids
    assert len(ids) == 2 and byte_tok.decode(ids[:1]).endswith("\ufffd")


def test_streamed_text_equals_whole_decode(byte_tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng)
        ids = byte_tok.encode(text).ids
        out = _stream(IncrementalDetokenizer(_Decode(byte_tok)), _chunks(ids, rng))
        assert "".join(out) == byte_tok.decode(ids) == text


def test_never_emits_a_partial_character(byte_tok: Tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(200):
        text = _random_text(rng)
        ids = byte_tok.encode(text).ids
        detok, emitted = IncrementalDetokenizer(_Decode(byte_tok)), ""
        for chunk in _chunks(ids, rng):
            emitted += detok.push(chunk)
            assert "\ufffd" not in emitted and text.startswith(emitted)


def test_invalid_bytes_are_released_as_replacement_chars(byte_tok: Tokenizer) -> None:
    rng = random.Random(2)
    for _ in range(100):
        ids = [rng.choice([0x61, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xFF, 0x80]) for _ in range(10)]
        ref = bytes(ids).decode("utf-8", errors="replace")
        out = _stream(IncrementalDetokenizer(_Decode(byte_tok)), _chunks(ids, rng))
        assert "".join(out) == byte_tok.decode(ids)
        assert "".join(out).replace("\ufffd", "") == ref.replace("\ufffd", "")


def _stop_reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def _stream_stops(text: str, stops: list[str], rng: random.Random) -> tuple[str, bool]:
    sc, emitted, i = StopChecker(stops), "", 0
    ref, _ = _stop_reference(text, stops)
    while i < len(text) and not sc.stopped:
        n = rng.randint(1, 3)
        emitted += sc.push(text[i : i + n])
        assert ref.startswith(emitted), "emitted text past (or instead of) the stop string"
        i += n
    emitted += sc.flush()
    return emitted, sc.stopped


def test_stop_strings_cut_exactly_at_the_first_match() -> None:
    rng = random.Random(3)
    stops = ["ab", "bba", "c\n", "€x"]
    for _ in range(500):
        text = "".join(rng.choice("abc\n€x") for _ in range(rng.randint(0, 15)))
        assert _stream_stops(text, stops, rng) == _stop_reference(text, stops)


def test_partial_match_is_held_then_released() -> None:
    sc = StopChecker(["STOP"])
    assert sc.push("hello ST") == "hello "
    assert sc.push("O") == ""
    assert sc.push("P!") == "" and sc.stopped
    sc = StopChecker(["STOP"])
    assert sc.push("hello STO") == "hello "
    assert sc.push("RM") == "STORM"
    assert sc.push("ST") == ""
    assert sc.flush() == "ST" and not sc.stopped


def test_no_stop_strings_passes_text_through() -> None:
    sc = StopChecker([])
    assert sc.push("abc") == "abc" and sc.flush() == ""
