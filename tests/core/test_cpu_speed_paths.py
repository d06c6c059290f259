"""The CPU fast paths keep outputs exact: the dequantized-expert cache, the thread setting, plain
steps as budget 0, smaller trees read off a bigger one, and the tuner's fallback to plain
decoding when the drafter is useless."""

from __future__ import annotations

import pytest
import torch

from ddserve import LLM, SamplingParams
from ddserve.drafter.testing import RandomDrafter
from ddserve.engine import threads
from ddserve.engine.budget import BudgetTuner, tokens_at_budgets
from ddserve.kernels.moe_ref import ExpertWeights, moe_ref
from ddserve.model import moe as moe_module
from ddserve.model.loader import load_model
from tests.engine_helpers import (  # noqa: F401 (single_thread is a fixture)
    PROMPTS,
    drafter,
    greedy_reference,
    make_runner,
    single_thread,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def int4_experts(tiny_int4_model_dir):
    model, _ = load_model(tiny_int4_model_dir, dtype=torch.float32, progress=False)
    return model.model.layers[1].mlp.experts


def _routed(experts, weights: ExpertWeights, t: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = weights.num_experts
    x = torch.randn(t, experts.w13_scale.shape[-1] * 32, generator=g)  # [T, H]
    ids = torch.stack([torch.randperm(e, generator=g)[:4] for _ in range(t)])  # [T, 4]
    return moe_ref(x, ids, torch.rand(t, 4, generator=g), weights)


def _uncached(experts) -> ExpertWeights:
    w = experts.weights()
    return ExpertWeights(w13_packed=w.w13_packed, w13_scale=w.w13_scale,
                         w2_packed=w.w2_packed, w2_scale=w.w2_scale)  # fmt: skip


def test_expert_cache_is_built_once_and_matches_dequantizing_every_call(int4_experts) -> None:
    first, again = int4_experts.weights(), int4_experts.weights()
    assert first.is_int4 and first.w13_dequant is not None
    assert first.w13_dequant is again.w13_dequant  # built at first use, then reused
    got, want = _routed(int4_experts, first), _routed(int4_experts, _uncached(int4_experts))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_expert_cache_follows_the_int4_tensors(int4_experts) -> None:
    old = int4_experts.weights().w13_dequant.clone()
    saved = int4_experts.w13_scale.detach().clone()
    try:
        with torch.no_grad():
            int4_experts.w13_scale.mul_(2)  # the INT4 tensors stay the source of truth
        new = int4_experts.weights()
        torch.testing.assert_close(new.w13_dequant, 2 * old)
        torch.testing.assert_close(
            _routed(int4_experts, new), _routed(int4_experts, _uncached(int4_experts)),
            rtol=1e-4, atol=1e-5,
        )  # fmt: skip
    finally:
        with torch.no_grad():
            int4_experts.w13_scale.copy_(saved)


def test_expert_cache_respects_memory_and_the_off_switch(tiny_int4_model_dir, monkeypatch):
    model, _ = load_model(tiny_int4_model_dir, dtype=torch.float32, progress=False)
    experts = model.model.layers[1].mlp.experts
    monkeypatch.setattr(moe_module, "available_memory", lambda: 1024)  # a full machine
    assert experts.weights().w13_dequant is None
    monkeypatch.setattr(moe_module, "available_memory", lambda: 2**40)
    monkeypatch.setenv("DDSERVE_EXPERT_CACHE", "off")
    assert model.model.layers[2].mlp.experts.weights().w13_dequant is None


def test_thread_count_precedence_and_split(monkeypatch) -> None:
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: 8)
    monkeypatch.setattr(threads, "idle_cores", lambda: 8)
    monkeypatch.delenv(threads.ENV, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        assert threads.cpu_threads(1)[0] == 8
        assert threads.cpu_threads(2)[0] == 4  # two ranks on the host split the cores
        assert threads.cpu_threads(16)[0] == 1
        monkeypatch.setattr(threads, "idle_cores", lambda: 3)  # others keep 5 cores busy
        assert threads.cpu_threads(1)[0] == 3
        torch.set_num_threads(2)  # a count the process lowered itself (OMP_NUM_THREADS, tests)
        assert threads.cpu_threads(1)[0] == 2
        monkeypatch.setenv(threads.ENV, "5")
        assert threads.cpu_threads(1) == (5, threads.ENV)
        assert threads.cpu_threads(1, requested=7) == (7, "config")
        assert threads.configure_cpu_threads(1, requested=3) == 3 == torch.get_num_threads()
        with pytest.raises(ValueError):
            threads.cpu_threads(1, requested=0)
    finally:
        torch.set_num_threads(before)


def test_budget_zero_is_a_plain_step(tiny_model_dir) -> None:
    ref = greedy_reference(tiny_model_dir, PROMPTS[:2], 8)
    runner = make_runner(tiny_model_dir, 8, RandomDrafter(264, depth=4, seed=2))
    for i, p in enumerate(PROMPTS[:2]):
        runner.add_stream(i, p, SamplingParams(max_tokens=8))
    out = {sid: list(o.tokens) for sid, o in runner.prefill().items()}
    while runner.streams:
        for sid, o in runner.ddtree_step(list(runner.streams), 0).items():
            assert len(o.tokens) == 1 and o.accepted_rows == ()
            out[sid] += o.tokens
    assert [out[0], out[1]] == ref
    with pytest.raises(ValueError):
        runner.ddtree_step([], -1)


def test_a_step_says_what_every_smaller_tree_would_have_committed(tiny_model_dir) -> None:
    """The b-node tree is the first b nodes of a bigger one, so `tokens_at_budgets` of a step at
    budget 16 equals what a step at b from the same state commits."""
    ref = greedy_reference(tiny_model_dir, PROMPTS, 24)
    big, small = 16, (0, 1, 4, 8)
    runners = {b: make_runner(tiny_model_dir, 16, drafter("corrupt", 264, PROMPTS, ref))
               for b in (big, *small)}  # fmt: skip
    committed = set()
    for i, p in enumerate(PROMPTS[:4]):
        for plain_steps in (0, 4, 9):  # the same state on every runner, then one tree step
            sid = (i, plain_steps)
            for r in runners.values():
                r.add_stream(sid, p, SamplingParams(max_tokens=24, ignore_eos=True))
                r.prefill()
                for _ in range(plain_steps):
                    r.ar_step([sid])
            got = {b: r.ddtree_step([sid], b)[sid] for b, r in runners.items()}
            predicted = tokens_at_budgets([got[big]], big, small)
            assert predicted == {b: float(len(got[b].tokens)) for b in small}
            committed.add(len(got[big].tokens))
            for r in runners.values():
                r.cancel(sid)
    assert len(committed) >= 3  # paths of several lengths were compared


def test_tuner_falls_back_to_plain_decoding_with_a_useless_drafter(
    tiny_model_dir, monkeypatch
) -> None:
    """A random drafter commits ~1 token per step: when a tree step costs more than a plain
    step for the same token, the tuner settles on budget 0. Step costs come from a fixed model
    (10 ms, +1/16 per tree node) instead of this machine's clock, so a loaded CI machine cannot
    change the decision; bench/cpu_speed.py measures the real costs."""
    want = greedy_reference(tiny_model_dir, PROMPTS[:1], 120)
    llm = LLM(tiny_model_dir, drafter=RandomDrafter(264, depth=4, seed=2), budget=16,
              device="cpu", num_slots=512, max_streams=1)  # fmt: skip
    record = llm.tuner.record

    def modelled(batch, budget, tokens, seconds, *rest):
        return record(batch, budget, tokens, 0.010 * (1 + budget / 16), *rest)

    monkeypatch.setattr(llm.tuner, "record", modelled)
    sp = SamplingParams(max_tokens=120, ignore_eos=True)
    outs = [llm.generate(PROMPTS[0], sp)[0] for _ in range(3)]  # the tuner persists across calls
    assert all(o.token_ids == want[0] for o in outs)
    assert llm.tuner.best(1) == 0
    last = outs[-1].stats["budget_per_step"]
    assert last.count(0) >= 0.85 * len(last)  # plain steps, exploring the trees now and then
    assert isinstance(llm.tuner, BudgetTuner)


def test_sampled_batches_keep_the_fixed_budget_so_a_seed_reproduces(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir, drafter=RandomDrafter(264, depth=4, seed=2), budget=8,
              device="cpu", num_slots=512, max_streams=2)  # fmt: skip
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    first, again = (llm.generate(PROMPTS[:2], sp) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert set(first[0].stats["budget_per_step"]) == {8}  # not tuned: the tree shapes a sample
