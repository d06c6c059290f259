"""Unit tests of the engine benchmark's harness (bench/engine_runs.py, engine_model.py,
bench_engine.py's configuration loop). They import bench/ modules, so they live here, not in
tests/ (tests/core/test_bench_engine.py runs the benchmark as a program). CPU, a few seconds:

    OMP_NUM_THREADS=1 python -m pytest bench/test_engine_harness.py -q
"""

from __future__ import annotations

import statistics

import bench_engine
import torch
from engine_model import INT4_STD, build_random_model, rank_slice_config
from engine_probe import uniform_distinct
from engine_runs import EngineBench, RunResult

from ddserve.config import ModelConfig
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels.moe_ref import unpack_int4
from ddserve.model.moe import RoutedExperts

SMALL = ["--small", "--device", "cpu", "--steps", "2", "--warmup", "1"]


def test_a_failing_configuration_is_recorded_and_the_rest_still_run(monkeypatch):
    real = EngineBench.run_ddtree

    def flaky(self, sids, budget, *args, **kwargs):
        if budget == 2:
            raise RuntimeError("boom")
        return real(self, sids, budget, *args, **kwargs)

    monkeypatch.setattr(EngineBench, "run_ddtree", flaky)
    rep = bench_engine.main([*SMALL, "--batches", "1", "--budgets", "2,4", "--corrupt", "0"])
    assert [(e["budget"], e["error"]) for e in rep["errors"]] == [(2, "RuntimeError: boom")]
    assert [e["budget"] for e in rep["ddtree"]] == [4]
    assert rep["ddtree"][0]["committed_per_step"] == 5  # the failed run left nothing behind


def test_rewind_returns_every_slot():
    cfg = ModelConfig.from_hf(rank_slice_config(2, small=True))
    model = build_random_model(cfg, torch.device("cpu"))
    runner = ModelRunner.from_model(model, cfg, engine_cfg=EngineConfig(num_slots=256, budget=4))
    bench = EngineBench(runner, [[5, 6, 7, 8], [9, 10, 11]], max_tokens=40, graph_reps=0)
    free = runner.free_slots
    first = bench.run_ar([0, 1], warmup=1, steps=3)
    assert runner.free_slots == free - 2 * 4
    bench.run_ddtree([0, 1], 4, warmup=0, steps=2, split_steps=1, depth=3, margin=20.0)
    bench.rewind([0, 1])
    assert runner.free_slots == free
    again = bench.run_ar([0, 1], warmup=1, steps=3)
    assert [runner.streams[s].output for s in (0, 1)] == [
        bench.continuation[(5, 6, 7, 8)],
        bench.continuation[(9, 10, 11)],
    ]
    assert first.committed == again.committed == [2, 2, 2]


def test_random_int4_experts_are_zero_mean():
    """Nibble values uniform in [-7, 7]: a mean of -0.5 (uniform in [-8, 7]) puts a common
    direction into every expert's output that K2 widths grow layer over layer until routing and
    the greedy token no longer depend on the token."""
    cfg = ModelConfig.from_hf(rank_slice_config(3, small=True))
    model = build_random_model(cfg, torch.device("cpu"))
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 2
    for m in experts:
        for packed in (m.w13_packed, m.w2_packed):
            q = unpack_int4(packed).float()
            assert (q.min().item(), q.max().item()) == (-7, 7)
            assert abs(q.mean().item()) < 0.02
            assert abs(q.std().item() - INT4_STD) < 0.02
            counts = torch.bincount((q + 7).long().flatten(), minlength=15).float()
            assert counts.min() > 0.95 * counts.mean()


def _distinct_over_uniform(res: RunResult, cfg: ModelConfig) -> float:
    measured = statistics.fmean(statistics.fmean(f) for f in res.distinct)
    uniform = statistics.fmean(
        uniform_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, t)
        for t in res.routed_tokens
    )
    return measured / uniform


def test_routing_touches_about_as_many_experts_as_independent_tokens():
    """Distinct experts per layer of AR and DDTree forwards over several streams are close to
    independent uniform routing: the streams emit different tokens, and their trees hold
    different tokens (each stream's continuation, per-stream noise off the path)."""
    cfg = ModelConfig.from_hf(rank_slice_config(3, small=True))
    model = build_random_model(cfg, torch.device("cpu"))
    runner = ModelRunner.from_model(model, cfg, engine_cfg=EngineConfig(num_slots=512, budget=8))
    prompts = torch.randint(2, cfg.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    bench = EngineBench(runner, prompts.tolist(), max_tokens=40, graph_reps=0)
    ar = bench.run_ar(bench.sids, warmup=0, steps=10)  # also the oracle's continuations
    outs = [runner.streams[s].output for s in bench.sids]
    assert all(len(set(step)) == 4 for step in zip(*outs, strict=True))  # no shared tokens
    ratios = {"ar4": _distinct_over_uniform(ar, cfg)}
    ratios["ar2"] = _distinct_over_uniform(bench.run_ar(bench.sids[:2], 0, 3), cfg)
    for c in (1, 2, 4):
        res = bench.run_ddtree(bench.sids[:c], 8, 0, 1, 0, depth=7, margin=20.0)
        assert res.committed == [8 * c] and res.matches_ar == 1.0
        ratios[f"ddtree{c}"] = _distinct_over_uniform(res, cfg)
    assert min(ratios.values()) >= 0.85, ratios


def test_costed_oracle_runs_the_drafter_and_keeps_the_oracles_trees():
    """`--drafter dflash`: every DDTree step also runs the DFlash drafter (its draft and its
    context commit of each step's tokens, from the target's captured hidden states), while the
    tree, and so what is committed, is the oracle's."""
    import argparse

    cfg = ModelConfig.from_hf(rank_slice_config(3, small=True))
    model = build_random_model(cfg, torch.device("cpu"))
    runner = ModelRunner.from_model(model, cfg, engine_cfg=EngineConfig(num_slots=512, budget=4))
    args = argparse.Namespace(small=True, depth=3, drafter_tp=2, seed=0)
    dflash = bench_engine.costed_dflash(args, runner, layers=3, streams=2, context=256)
    assert dflash.model.comm.world_size == 2 and dflash.capture_layers
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    bench = EngineBench(runner, prompts, max_tokens=60, graph_reps=0, dflash=dflash)
    bench.run_ar([0, 1], warmup=0, steps=20)
    drafts, commits = [], []
    draft_rows, commit_many = dflash.draft_rows, dflash.commit_many
    dflash.draft_rows = lambda rows, bonus: drafts.append(len(rows)) or draft_rows(rows, bonus)
    dflash.commit_many = lambda items: commits.append(len(items)) or commit_many(items)
    block = dflash.commit_block  # the engine's call, eager on the CPU (through commit_many)
    dflash.commit_block = lambda *a: commits.append("block") or block(*a)
    res = bench.run_ddtree([0, 1], 4, warmup=1, steps=3, split_steps=1, depth=3, margin=20.0)
    assert res.matches_ar == 1.0 and res.committed == [8, 8, 8]  # 2 chains of 3 + the bonus
    assert drafts == [2] * 5 and commits == ["block", 2] * 5  # warm-up, 3 timed, the split
    for sid, prompt in zip((0, 1), prompts, strict=True):  # the split step ran again after
        assert dflash.cache.length(sid) == len(prompt) + len(runner.streams[sid].output) - 1
    first = runner.drafter
    again = bench.run_ddtree([0, 1], 4, warmup=0, steps=2, split_steps=0, depth=3, margin=20.0)
    assert runner.drafter is first  # the same drafter: graphs keyed by it are replayed
    assert again.matches_ar == 1.0 and again.committed == [8, 8]
    other = bench.run_ddtree([0], 4, warmup=0, steps=2, split_steps=0, depth=3, margin=20.0,
                             corrupt=0.5)  # fmt: skip
    assert runner.drafter is not first and other.matches_ar == 1.0
    assert dflash.cache.num_streams == 1
