"""Temperature 0: DDTree output equals plain autoregressive greedy output, token for token.

On the CPU in the engine's CPU dtype (float32; tests/gpu repeats the comparison in bf16 with the
batch-invariant kernels)."""

from __future__ import annotations

import dataclasses

import pytest

from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.sampling import SamplingParams
from tests.engine_helpers import (  # noqa: F401 (single_thread is a fixture)
    PROMPTS,
    drafter,
    greedy_reference,
    make_runner,
    run_all,
    single_thread,
)

pytestmark = pytest.mark.usefixtures("single_thread")
MAX = 20


@pytest.fixture(scope="module", params=["bf16", "int4"])
def model(request, tiny_model_dir, tiny_int4_model_dir):
    path = tiny_model_dir if request.param == "bf16" else tiny_int4_model_dir
    return path, greedy_reference(path, PROMPTS, MAX)


def vocab(path) -> int:
    return make_runner(path).model_cfg.vocab_size


@pytest.mark.parametrize("budget", [1, 2, 4, 8, 16, 32, 64, 128])
def test_all_budgets_corrupted_oracle(model, budget: int) -> None:
    path, ref = model
    prompts = PROMPTS[:3]
    runner = make_runner(path, budget, drafter("corrupt", vocab(path), PROMPTS, ref))
    start = runner.free_slots
    assert run_all(runner, prompts, SamplingParams(max_tokens=MAX), True) == ref[:3]
    assert runner.free_slots == start


@pytest.mark.parametrize("budget", [1, 4, 32, 128])
def test_budgets_random_drafter(tiny_model_dir, budget: int) -> None:
    ref = greedy_reference(tiny_model_dir, PROMPTS[3:5], 10)
    runner = make_runner(tiny_model_dir, budget, drafter("random", vocab(tiny_model_dir), [], []))
    assert run_all(runner, PROMPTS[3:5], SamplingParams(max_tokens=10), True) == ref


@pytest.mark.parametrize(
    "kind,batch", [("oracle", 1), ("corrupt", 3), ("oracle", 8), ("random", 8)]
)
def test_drafters_and_batch_sizes(model, kind: str, batch: int) -> None:
    path, ref = model
    runner = make_runner(path, 16, drafter(kind, vocab(path), PROMPTS, ref))
    got = run_all(runner, PROMPTS[:batch], SamplingParams(max_tokens=MAX), True)
    assert got == ref[:batch]


def test_perfect_oracle_commits_a_full_path_per_step(tiny_model_dir) -> None:
    depth, steps = 6, 4
    max_tokens = 1 + steps * (depth + 1)
    prompts = PROMPTS[:3]
    ref = greedy_reference(tiny_model_dir, prompts, max_tokens, ignore_eos=True)
    runner = make_runner(tiny_model_dir, 16, drafter("oracle", vocab(tiny_model_dir), prompts, ref))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    committed = []
    for i, p in enumerate(prompts):
        runner.add_stream(i, p, sp)
    runner.prefill()
    while runner.streams:
        committed += [len(so.tokens) for so in runner.ddtree_step(list(runner.streams)).values()]
    assert sum(committed) / len(committed) > 0.9 * (depth + 1)


def test_streams_join_and_leave_mid_run(model) -> None:
    """Streams added between steps, finishing at different lengths, one cancelled mid-run."""
    path, ref = model
    runner = make_runner(path, 8, drafter("corrupt", vocab(path), PROMPTS, ref))
    start = runner.free_slots
    lengths = {0: MAX, 1: 7, 2: MAX, 3: 12, 4: MAX, 5: 3, 6: MAX}
    joins = {0: [0, 1], 1: [2], 3: [3, 4, 6], 5: [5, 7]}  # step -> prompts joining
    out: dict[int, list[int]] = {}
    step = 0
    while step <= max(joins) or runner.streams:
        for i in joins.get(step, []):
            out[i] = []
            runner.add_stream(i, PROMPTS[i], SamplingParams(max_tokens=lengths.get(i, MAX)))
        for sid, so in runner.prefill().items():
            out[sid] += so.tokens
        if step == 4:
            assert runner.cancel(6)  # mid-run, after a few tokens
        live = [s for s in runner.streams if runner.streams[s].prefilled]
        if live:
            for sid, so in runner.ddtree_step(live).items():
                out[sid] += so.tokens
        step += 1
    for i, toks in out.items():
        if i == 6:
            assert toks == ref[6][: len(toks)] and len(toks) < MAX
        else:
            assert toks == ref[i][: lengths.get(i, MAX)]
    assert runner.free_slots == start and not runner.streams


def test_stops_on_stop_token_and_eos_like_ar(tiny_model_dir) -> None:
    path, ref = tiny_model_dir, greedy_reference(tiny_model_dir, PROMPTS[:1], MAX)
    stop = ref[0][5]
    first = ref[0].index(stop)
    runner = make_runner(path, 8, drafter("oracle", vocab(path), PROMPTS[:1], ref))
    start = runner.free_slots
    got = run_all(runner, PROMPTS[:1], SamplingParams(max_tokens=MAX, stop_token_ids=(stop,)), True)
    assert got[0] == ref[0][: first + 1]
    # EOS: make the model's EOS a token the stream produces; ignore_eos switches it off.
    runner.model_cfg = dataclasses.replace(runner.model_cfg, eos_token_id=stop)
    assert run_all(runner, PROMPTS[:1], SamplingParams(max_tokens=MAX), True)[0] == got[0]
    sp = SamplingParams(max_tokens=MAX, ignore_eos=True)
    assert run_all(runner, PROMPTS[:1], sp, True)[0] == ref[0]
    assert runner.free_slots == start


def test_chunked_prefill_matches_one_shot(model) -> None:
    """Prompts split across several prefill forwards (and several streams per forward)."""
    path, ref = model
    prompts = [PROMPTS[2], PROMPTS[6], PROMPTS[4]]  # 30, 20 and 12 tokens
    want = [ref[2], ref[6], ref[4]]
    runner = make_runner(path, 8, drafter("corrupt", vocab(path), PROMPTS, ref), prefill_chunk=7)
    before = runner.target_forwards
    got = run_all(runner, prompts, SamplingParams(max_tokens=MAX), True)
    assert got == want
    assert runner.target_forwards - before >= 62 // 7  # prefill really ran in chunks


def test_per_bucket_budget_below_the_engine_budget(model) -> None:
    """A bucket's smaller budget changes the tree size only, never the greedy output."""
    path, _ = model
    cfg = EngineConfig(num_slots=4096, budget=16)
    ref = run_all(ModelRunner(path, engine_cfg=cfg, device="cpu"), PROMPTS[:3],
                  SamplingParams(max_tokens=MAX), False)  # fmt: skip
    runner = ModelRunner(path, engine_cfg=cfg, device="cpu",
                         drafter=drafter("corrupt", vocab(path), PROMPTS[:3], ref))  # fmt: skip
    params = SamplingParams(max_tokens=MAX)
    out: dict[int, list[int]] = {i: [] for i in range(3)}
    for i, p in enumerate(PROMPTS[:3]):
        runner.add_stream(i, p, params)
    for sid, so in runner.prefill().items():
        out[sid] += so.tokens
    budgets = iter([1, 3, 16, 5] * MAX)
    while runner.streams:
        for sid, so in runner.ddtree_step(list(runner.streams), budget=next(budgets)).items():
            out[sid] += so.tokens
    assert [out[i] for i in range(3)] == ref[:3]
    with pytest.raises(ValueError, match="budget"):
        runner.ddtree_step([], budget=17)
