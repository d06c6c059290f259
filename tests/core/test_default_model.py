"""The embedded default: the trained code model and its DFlash drafter, shipped as package data,
and the held-out prompts it is evaluated on (bench/heldout_prompts.json).

On CPU in float32: DDTree equals autoregressive greedy decoding on held-out function headers and
commits well over one token per step there (a property of the trained pair: a random drafter
commits ~1); the default shards at tp = 1, 2, 4, 8, and tp = 2 and 8 over gloo give tp = 1's
logits.
"""

from __future__ import annotations

import ast
import csv
import fnmatch
import json
from pathlib import Path

import pytest
import torch
from model_utils import rel_err
from ports import free_port
from ranks import spawn
from test_tp_gloo import run_model, worker

from ddserve import LLM, SamplingParams
from ddserve.config import ModelConfig
from ddserve.model.loader import load_model
from ddserve.model.tiny import DEFAULT_NAME, default_model_dir
from ddserve.serve import preflight
from ddserve.tokenizer import Tokenizer
from ddserve.train.prompts import MANIFEST, header_prompt

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def held_out() -> list[str]:
    """The first two held-out prompts that carry a docstring line (bench/heldout_prompts.json)."""
    doc = json.loads((ROOT / "bench" / "heldout_prompts.json").read_text())
    return [p["prompt"] for p in doc["prompts"] if p["has_docstring"]][:2]


@pytest.fixture(scope="module")
def decoded(held_out):
    """(AR outputs, DDTree outputs) of the default pair at budget 16, float32 on the CPU."""
    path = default_model_dir()
    with LLM(path, drafter=path / "drafter", budget=16, device="cpu", dtype="float32",
             num_slots=1024, max_streams=2, seed=0) as llm:  # fmt: skip
        sp = SamplingParams(max_tokens=MAX_TOKENS)
        return llm.generate(held_out, sp, speculative=False), llm.generate(held_out, sp)


def test_held_out_prompts_are_headers_of_distinct_eval_modules() -> None:
    doc = json.loads((ROOT / "bench" / "heldout_prompts.json").read_text())
    with MANIFEST.open(newline="") as f:
        split = {(r["source"], r["path"]): r["split"] for r in csv.DictReader(f, delimiter="\t")}
    prompts = doc["prompts"]
    assert len(prompts) == 64 and len({(p["source"], p["path"]) for p in prompts}) == 64
    for p in prompts:
        assert split[(p["source"], p["path"])] == "eval"
        assert p["prompt"].startswith(("def ", "async def ")) and not p["prompt"][-1].isspace()


def test_header_prompt_keeps_the_signature_and_the_first_docstring_line() -> None:
    src = (
        "class A:\n"
        "    @property\n"
        "    def f(self, a,\n"
        "          b=1):\n"
        "        # a comment before the body\n"
        '        """\n'
        "        First line.\n"
        "\n"
        "        More.\n"
        '        """\n'
        "        return a\n"
    )
    method = ast.parse(src).body[0].body[0]
    want = 'def f(self, a,\n      b=1):\n    """\n    First line.'
    assert header_prompt(src.splitlines(), method) == want


def test_default_model_dir_is_the_packaged_trained_pair() -> None:
    path = default_model_dir()
    assert path == ROOT / "ddserve" / "default_model" and DEFAULT_NAME == "ddserve-code-21m"
    cfg = ModelConfig.from_hf(path)
    assert cfg.quant is not None and cfg.vocab_size == 4096  # INT4 experts, the trained BPE
    assert (path / "drafter" / "config.json").is_file()
    tok = Tokenizer.from_dir(path)
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"


def test_every_default_model_file_is_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["ddserve"]
    pkg = ROOT / "ddserve"
    files = [p.relative_to(pkg).as_posix() for p in (pkg / "default_model").rglob("*")
             if p.is_file()]  # fmt: skip
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), files


def test_ddtree_equals_ar_on_held_out_prompts(decoded) -> None:
    ar, dd = decoded
    for a, d in zip(ar, dd, strict=True):
        assert d.token_ids == a.token_ids and len(a.token_ids) == MAX_TOKENS
        assert d.text.strip()


def test_trained_drafter_commits_well_over_one_token_per_step(decoded) -> None:
    _, dd = decoded
    steps = sum(o.stats["steps"] for o in dd)
    committed = sum(len(o.token_ids) - 1 for o in dd)  # the prefill's token is not a step
    assert committed / steps > 1.5, (committed, steps)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_default_shards_at_tp(tp: int) -> None:
    preflight.check_sharding(default_model_dir(), tp)


@pytest.mark.parametrize("world", [2, pytest.param(8, marks=pytest.mark.slow)])  # 8: ~20 s
def test_default_over_gloo_equals_tp1(world: int, tmp_path) -> None:
    path = str(default_model_dir())
    ref = run_model(load_model(path, dtype=torch.float32, progress=False)[0])
    out = str(tmp_path / "logits")
    spawn(worker, (world, free_port(), [path], out), world)
    for rank in range(world):
        [got] = torch.load(f"{out}.{rank}")
        assert rel_err(got, ref) <= 1e-5, (rank, rel_err(got, ref))


def test_llm_with_no_arguments_runs_the_embedded_pair_with_its_drafter() -> None:
    from ddserve.drafter.model import DFlashDrafter

    with LLM(device="cpu", num_slots=256, max_streams=1) as llm:
        assert isinstance(llm.runner.drafter, DFlashDrafter)
