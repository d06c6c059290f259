"""Shared helpers for the engine tests: reference AR decoding and drafter construction."""

from __future__ import annotations

import pytest
import torch

from ddserve.drafter.testing import OracleDrafter, RandomDrafter
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.sampling import SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    [100, 101, 102],
    list(range(30, 60)),
    [200],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [77, 78],
    list(range(120, 140)),
    [250, 251, 252, 253],
]


@pytest.fixture(scope="module")
def single_thread():
    """The CI machine has 2 shared cores: one intra-op thread per test process is much faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_runner(model_dir, budget: int = 8, drafter=None, num_slots: int = 4096, **kw):
    """A CPU runner in the engine's CPU dtype (float32, `resolve_dtype`) unless `dtype` is given."""
    cfg = EngineConfig(num_slots=num_slots, budget=budget, **kw)
    return ModelRunner(model_dir, engine_cfg=cfg, drafter=drafter, device="cpu")


def run_all(
    runner: ModelRunner, prompts, params: SamplingParams, speculative: bool, budget=None
) -> list[list[int]]:
    """Decode every prompt to completion together; returns token lists in prompt order.
    `budget`: DDTree nodes per step (default: the runner's)."""
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        runner.add_stream(i, p, params)
    for sid, so in runner.prefill().items():
        out[sid] += so.tokens
    while runner.streams:
        sids = list(runner.streams)
        res = runner.ddtree_step(sids, budget) if speculative else runner.ar_step(sids)
        for sid, so in res.items():
            out[sid] += so.tokens
    return [out[i] for i in range(len(prompts))]


def greedy_reference(model_dir, prompts, max_tokens: int, **params) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return run_all(make_runner(model_dir), prompts, sp, speculative=False)


def drafter(kind: str, vocab: int, prompts, greedy, depth: int = 6):
    table = {tuple(p): g for p, g in zip(prompts, greedy, strict=True)}
    if kind == "oracle":
        return OracleDrafter(table, vocab, depth=depth)
    if kind == "corrupt":
        return OracleDrafter(table, vocab, depth=depth, corrupt=0.4, seed=1)
    return RandomDrafter(vocab, depth=4, seed=2)
