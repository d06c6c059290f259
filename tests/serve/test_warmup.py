"""The serving warm-up (ddserve/actors/warmup.py) on one CPU rank, without Ray: it runs one step
of every reachable bucket with each budget it may use, at every CUDA-graph prefix capacity of
the plan (the graph key: bucket, budget, the longest prefix rounded up to a power of two >= 256),
and leaves no stream or KV slot behind."""

from __future__ import annotations

import pytest

from ddserve.actors.shard import Command, ShardSpec, ShardWorker
from ddserve.actors.warmup import Shape, WarmupPlan, prefix_capacities, run_warmup, step_shapes
from ddserve.engine.config import EngineConfig


def _capacity(prefix: int) -> int:
    cap = 256
    while cap < prefix:
        cap *= 2
    return cap


class RecordingRank:
    """Runs Commands on one ShardWorker and records each step's graph key."""

    def __init__(self, worker: ShardWorker) -> None:
        self.worker, self.keys = worker, []

    def run(self, cmd: Command):
        if cmd.step:
            streams = self.worker.runner.streams
            prefix = max(len(streams[s].slots) for s in cmd.step)
            self.keys.append((len(cmd.step), cmd.bucket, cmd.budget, _capacity(prefix)))
        return self.worker.execute(cmd)


@pytest.fixture(scope="module")
def worker(tiny_int4_model_dir) -> ShardWorker:
    engine = EngineConfig(num_slots=4096, budget=6, prefill_chunk=256, dtype="float32",
                          max_streams=3, graph_buckets=(1, 2, 4))  # fmt: skip
    spec = ShardSpec(model_path=str(tiny_int4_model_dir),
                     drafter_path=str(tiny_int4_model_dir / "drafter"), engine=engine)  # fmt: skip
    w = ShardWorker(0, spec)
    w.setup("")
    return w


def test_every_batch_size_with_its_buckets_budgets_makes_the_shapes() -> None:
    shapes = step_shapes((1, 2, 4, 8), 3, [(6,), (6,), (3, 6), (6,)])
    assert shapes == (Shape(1, 1, 6), Shape(2, 2, 6), Shape(3, 4, 3), Shape(3, 4, 6))
    assert step_shapes((1, 4), 4, None) == (Shape(1, 1, None), Shape(2, 4, None),
                                            Shape(3, 4, None), Shape(4, 4, None))  # fmt: skip


def test_capacities_double_up_to_the_limit_with_graphs_only() -> None:
    assert prefix_capacities(True, 2048) == (256, 512, 1024, 2048)
    assert prefix_capacities(True, 1500) == (256, 512, 1024)
    assert prefix_capacities(False, 2048) == (256,)


@pytest.mark.parametrize("speculative", [True, False], ids=["ddtree", "ar"])
def test_warmup_steps_every_shape_at_every_capacity_and_frees_everything(worker, speculative):
    runner = worker.runner
    free, rank = runner.free_slots, RecordingRank(worker)
    budgets = [(6,), (2, 6), (6,)] if speculative else None
    plan = WarmupPlan(step_shapes((1, 2, 4), 3, budgets), (256, 512, 1024))
    run_warmup(rank, plan, runner.model_cfg.vocab_size)
    wanted = {(s.streams, s.bucket, s.budget or 0, cap) for s in plan.shapes
              for cap in plan.capacities}  # fmt: skip
    assert set(rank.keys) == wanted and len(rank.keys) == plan.total
    assert runner.streams == {} and runner.free_slots == free
