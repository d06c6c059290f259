"""Programmatic dependent launch on the GPU: it changes when kernels start, never what they compute.
A forward replayed from a CUDA graph (and run eagerly) with PDL gives the same logits, bit for
bit, as with DDSERVE_PDL=0; a race (a kernel reading its predecessor's output early) would not.
Skipped without CUDA; the PDL runs are plain launches before sm_90."""

from __future__ import annotations

import pytest
import torch
from _forwards import PROMPTS, forward_logits, prefilled_runner

from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels import pdl
from ddserve.model.tiny import make_tiny
from ddserve.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "m", int4=True, seed=0)


def _runner(model_dir, graphs: bool, on: bool, monkeypatch) -> ModelRunner:
    monkeypatch.setenv("DDSERVE_PDL", "1" if on else "0")
    runner = prefilled_runner(model_dir, graphs)
    assert runner.kernels.pdl == on
    return runner


@pytest.mark.parametrize("graphs", [False, True])
def test_forwards_with_pdl_equal_forwards_without_bit_for_bit(model_dir, graphs, monkeypatch):
    on = _runner(model_dir, graphs, True, monkeypatch)
    off = _runner(model_dir, graphs, False, monkeypatch)
    for q, seed in [(1, 0), (9, 1), (1, 2), (9, 3), (9, 4)]:  # AR steps and verify-sized blocks
        assert torch.equal(forward_logits(on, q, seed), forward_logits(off, q, seed)), (q, seed)
    if graphs:
        assert on._graphs is not None and off._graphs is not None
    on.close()
    off.close()


@pytest.mark.parametrize("graphs", [False, True])
def test_ddtree_with_pdl_equals_ddtree_without_and_plain_decoding(model_dir, graphs, monkeypatch):
    """Whole DDTree steps (with graphs: the draft and verify in one captured graph), PDL on and
    off, against plain decoding: the same greedy tokens on every stream."""
    from engine_helpers import run_all

    params = SamplingParams(max_tokens=20)
    outs = {}
    for on in (True, False):
        monkeypatch.setenv("DDSERVE_PDL", "1" if on else "0")
        cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=graphs)
        runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=model_dir / "drafter",
                             device="cuda")  # fmt: skip
        outs[on] = run_all(runner, PROMPTS, params, speculative=True)
        if on:
            outs["ar"] = run_all(runner, PROMPTS, params, speculative=False)
        runner.close()
    assert outs[True] == outs[False] == outs["ar"]


def test_pdl_is_used_on_sm90_and_later() -> None:
    major = torch.cuda.get_device_capability()[0]
    assert pdl.enabled(torch.device("cuda")) == (major >= 9)
