"""Unit tests of the engine benchmark's harness (bench/engine_runs.py, engine_model.py,
bench_engine.py's configuration loop). They import bench/ modules, so they live here, not in
tests/ (tests/core/test_bench_engine.py runs the benchmark as a program). CPU, a few seconds:

    OMP_NUM_THREADS=1 python -m pytest bench/test_engine_harness.py -q
"""

from __future__ import annotations

import bench_engine
import torch
from engine_model import build_random_model, rank_slice_config
from engine_runs import EngineBench

from ddserve.config import ModelConfig
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner

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
