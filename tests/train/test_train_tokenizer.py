"""The trained BPE (ddserve/train/tokenizer.py) is a ddserve tokenizer that keeps code cheap."""

from __future__ import annotations

import json.decoder
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ddserve.tokenizer import SPECIALS, Tokenizer
from ddserve.train import tokenizer as train_tok
from ddserve.train.data import encode_files

SOURCE = '''class Stack{i}:
    """A stack."""

    def __init__(self, items=None):
        self.items = list(items or [])

    def push(self, item):
        if item is not None:
            self.items.append(item)
        return len(self.items) + {i}
'''


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    stdlib = [Path(m.__file__).read_text() for m in (textwrap, json.decoder)]
    texts = stdlib + [SOURCE.format(i=i) for i in range(200)]
    tok = train_tok.train(texts, vocab_size=400, progress=False)
    return train_tok.write(tok, tmp_path_factory.mktemp("tok"))


def test_loads_in_ddserve_with_specials_first(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.vocab_size == 400
    assert [tok._tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)


def test_round_trips_code_and_renders_the_chat_template(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = SOURCE.format(i=7) + "\tx = 'caf\u00e9'  # \u2603\n"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt, allow_special=True)[0] == SPECIALS.index("<|im_start|>")


def test_a_line_break_and_its_indentation_are_one_token(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    for indent in (4, 8, 12):
        piece = "\n" + " " * indent
        assert len(tok.encode(piece + "self")) == 2, indent


def test_special_strings_in_source_are_plain_text(tok_dir):
    stream, starts = encode_files(["x = '<|eos|>'\n", "y = 1\n"], tok_dir)
    assert list(starts) == [0, int(np.flatnonzero(stream == 0)[1])]
    assert stream[0] == 0 and stream[-1] == 1
    assert (stream == 1).sum() == 2  # the two real file ends only
