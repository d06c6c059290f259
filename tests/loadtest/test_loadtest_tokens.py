"""Prompt lengths in the served model's tokens, and flags whose dependencies are checked up front.

The fake server here counts prompt tokens as ddserve's byte-level default tokenizer does (BOS +
one token per UTF-8 byte), where one random word is ~5 tokens: `--input-len 256` must still send
prompts of ~256 tokens, measured from the server's own usage.prompt_tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddserve.tokenizer import write_byte_tokenizer
from loadtest import datasets
from loadtest.calibrate import load_encoder
from loadtest.run import main
from loadtest.tokens import ESTIMATE, fit_counter, with_tokenizer

try:
    from fake_openai_server import FakeOpenAIServer
except ImportError:  # tests/ imported as a package
    from tests.fake_openai_server import FakeOpenAIServer

pytestmark = pytest.mark.timeout(120)

# Server-side prompt token counts of two tokenizer families, for a completions prompt.
BYTE_LEVEL = lambda text: 1 + len(text.encode("utf-8"))  # BOS + bytes (ddserve's default)
WORD_BPE = lambda text: 1 + len(text.split())  # BOS + one token per common word


@pytest.fixture(scope="module")
def byte_server():
    with FakeOpenAIServer(tokens="bytes") as fake:
        yield fake


@pytest.fixture(scope="module")
def byte_tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("byte_tok")
    write_byte_tokenizer(path)
    return path


def _run(url: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = main(["--url", url, "--no-progress", "--out", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize("rule", [BYTE_LEVEL, WORD_BPE], ids=["byte_level", "word_bpe"])
def test_probe_fit_reproduces_the_server_count(rule):
    counter = fit_counter([(t, rule(t)) for t in datasets.probe_texts()])
    for p in datasets.random_prompts(50, 100, 8, range_ratio=0.5, seed=1, counter=counter):
        assert counter(p.text) == rule(p.text) == p.prompt_len


def test_probe_counts_that_do_not_grow_are_refused():
    with pytest.raises(ValueError, match="do not grow"):
        fit_counter([(t, 5) for t in datasets.probe_texts()])


@pytest.mark.parametrize("target", [1, 7, 256, 1000])
def test_random_prompts_land_within_half_a_word_of_the_length(target):
    counter = fit_counter([(t, BYTE_LEVEL(t)) for t in datasets.probe_texts()])
    word_cost = 1 + max(len(w) for w in datasets._WORDS)  # the longest word and its space
    for p in datasets.random_prompts(20, target, 4, seed=2, counter=counter):
        one_word = " " not in p.text  # the shortest prompt may overshoot a tiny target
        assert abs(p.prompt_len - target) <= word_cost / 2 or one_word, (p, target)


def test_tokenizer_counts_exactly_plus_the_measured_overhead(byte_tokenizer_dir):
    encode = load_encoder(str(byte_tokenizer_dir))
    probe = datasets.probe_texts()[1]
    counter = with_tokenizer(encode, (probe, BYTE_LEVEL(probe)), "byte")
    assert counter.overhead == 1
    text = "naïve words, with punctuation!"
    assert counter.text_tokens(text) == len(text.encode("utf-8"))
    assert counter(text) == BYTE_LEVEL(text)


def test_estimate_is_four_bytes_per_token():
    assert ESTIMATE("x" * 40) == 10 and ESTIMATE.text_tokens("y" * 80) == 20


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_input_len_counts_server_tokens_by_default(byte_server, tmp_path, endpoint):
    args = ["--endpoint", endpoint, "--num-prompts", "8", "--concurrency", "4"]
    rc, result = _run(byte_server.url, tmp_path, *args, "--input-len", "256", "--output-len", "4")
    assert rc == 0
    [run] = result["runs"]
    sent = [r["prompt_tokens"] for r in run["requests"]]  # usage.prompt_tokens, per request
    assert all(abs(n - 256) <= 4 for n in sent), sent
    assert abs(run["total_input_tokens"] - 8 * 256) <= 8 * 2
    assert "probe" in result["config"]["prompt_tokens"]["source"]


def test_input_len_with_the_model_tokenizer(byte_server, byte_tokenizer_dir, tmp_path):
    args = ["--tokenizer", str(byte_tokenizer_dir), "--num-prompts", "6", "--output-len", "4"]
    rc, result = _run(byte_server.url, tmp_path, *args, "--input-len", "300", "--seed", "5")
    assert rc == 0
    [run] = result["runs"]
    assert all(abs(r["prompt_tokens"] - 300) <= 4 for r in run["requests"]), run["requests"]
    counted = result["config"]["prompt_tokens"]
    assert counted["source"].startswith("tokenizer") and counted["overhead"] == 1


def test_server_without_usage_falls_back_to_an_estimate(tmp_path):
    with FakeOpenAIServer(tokens="bytes", report_usage=False) as fake:
        rc, result = _run(fake.url, tmp_path, "--num-prompts", "2", "--input-len", "40")
    assert rc == 0
    assert result["config"]["prompt_tokens"]["source"] == ESTIMATE.source
    [run] = result["runs"]
    assert all(abs(r["prompt_tokens"] - 40) <= 2 for r in run["requests"])  # the estimate's


def test_plot_without_matplotlib_fails_before_any_request(
    byte_server, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    seen = byte_server.http_requests
    rc, result = _run(byte_server.url, tmp_path, "--sweep", "1,2", "--plot", str(tmp_path / "p"))
    assert rc == 2 and result == {}
    assert byte_server.http_requests == seen
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        'loadtest: --plot needs matplotlib, which is not installed: pip install -e ".[loadtest]"'
    ]


def test_unreadable_tokenizer_fails_before_any_request(byte_server, tmp_path, capsys):
    seen = byte_server.http_requests
    rc, _ = _run(byte_server.url, tmp_path, "--tokenizer", str(tmp_path / "nowhere"))
    assert rc == 2 and byte_server.http_requests == seen
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"loadtest: --tokenizer {tmp_path / 'nowhere'}: No tokenizer in")
