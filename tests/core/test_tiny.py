"""make-tiny: deterministic from the seed, not degenerate, the CLI. (The embedded default is a
trained model: tests/core/test_default_model.py.)"""

from __future__ import annotations

import hashlib

import torch
from model_utils import greedy

from ddserve.cli import main as cli_main
from ddserve.model.loader import load_model
from ddserve.model.tiny import write_tiny


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_deterministic_from_seed(tiny_model_dir, tmp_path):
    assert digest(write_tiny(tmp_path / "a", seed=0)) == digest(tiny_model_dir)
    assert digest(write_tiny(tmp_path / "b", seed=1)) != digest(tiny_model_dir)


def test_greedy_output_is_not_degenerate(tiny_int4_model_dir):
    model, _ = load_model(tiny_int4_model_dir, dtype=torch.float32, progress=False)
    out = greedy(model, [list(b"Hello"), list(b"The quick brown fox")], steps=24)
    for tokens in out:
        assert len(set(tokens)) >= 6, tokens


def test_cli_make_tiny(tmp_path):
    assert cli_main(["make-tiny", str(tmp_path / "out"), "--int4", "--seed", "3"]) == 0
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert digest(tmp_path / "out") == digest(write_tiny(tmp_path / "ref", int4=True, seed=3))
