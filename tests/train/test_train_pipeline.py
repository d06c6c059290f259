"""End to end at toy scale: corpus -> tokenizer -> `python -m ddserve.train.target --tiny` ->
the exported INT4 checkpoint serves in ddserve's LLM, greedy tokens equal TrainTarget's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ddserve.engine.llm import LLM
from ddserve.sampling import SamplingParams
from ddserve.train import corpus, target
from ddserve.train import tokenizer as train_tok
from ddserve.train.target_model import TrainTarget

# Small stdlib modules; tarfile, enum and colorsys are held out by the hash rule.
UNITS = {"json", "textwrap", "heapq", "bisect", "tarfile", "enum", "colorsys"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    std = corpus.stdlib_source()
    files = tuple(f for f in std.files if f.relative_to(std.root).parts[0].split(".")[0] in UNITS)
    src = dataclasses.replace(std, files=files)
    entries, _ = corpus.collect([src])
    meta = {"MANIFEST.tsv": corpus.manifest_tsv(entries).encode()}
    corpus.write_tar(root / "corpus.tar.xz", entries, meta, [src])
    train_tok.main(["--corpus", str(root / "corpus.tar.xz"), "--out", str(root / "tok")])
    target.main(
        [
            "--corpus", str(root / "corpus.tar.xz"), "--tokenizer", str(root / "tok"),
            "--out", str(root / "out"), "--tiny", "--device", "cpu", "--tokens", "12000",
            "--seq-len", "64", "--batch", "8", "--warmup", "3", "--log-every", "5",
            "--val-every", "10", "--val-seqs", "4", "--eval-seqs", "8", "--replan-at", "8",
        ]
    )  # fmt: skip
    return root


def test_run_writes_an_int4_checkpoint_and_a_log(run_dir):
    log = json.loads((run_dir / "out" / "train_log.json").read_text())
    assert log["final"]["steps"] == 24
    held = log["final"]["held_out"]
    assert abs(held["int4_experts"] - held["bf16_experts"]) < 0.05
    assert log["progress"][-1]["loss"] < log["progress"][0]["loss"]
    config = json.loads((run_dir / "out" / "target" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert config["vocab_size"] % 8 == 0 and config["bos_token_id"] == 0
    assert abs(log["final"]["reloaded_int4_subset"] - log["val"][-1]["loss"]) < 0.05


def test_llm_serves_the_checkpoint_with_traintarget_greedy_tokens(run_dir):
    ckpt = run_dir / "out" / "target"
    prompt = "def parse(text):\n    "
    with LLM(ckpt, device="cpu", dtype="float32", seed=0) as llm:
        ids = llm.tokenizer.encode(prompt, add_bos=True)
        out = llm.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    model = TrainTarget.from_checkpoint(ckpt)
    seq = list(ids)
    for _ in range(12):
        logits, _ = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    assert out.token_ids == seq[len(ids) :]
