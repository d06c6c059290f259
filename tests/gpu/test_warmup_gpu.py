"""The serving warm-up on a GPU with CUDA graphs (bf16): it captures one graph per bucket and
prefix capacity, leaves every KV slot free, and afterwards batches of each bucket,
short or long, replay graphs captured during the warm-up (no capture on the first request).
One rank without Ray: the warm-up drives a ShardWorker directly, through the Router's Commands."""

from __future__ import annotations

import time

import pytest
import torch

from ddserve.actors.shard import Command, ShardSpec, ShardWorker
from ddserve.actors.warmup import WarmupPlan, prefix_capacities, run_warmup, step_shapes
from ddserve.engine.config import EngineConfig
from ddserve.model.tiny import make_tiny
from ddserve.sampling import SamplingParams

pytestmark = pytest.mark.gpu
BUCKETS = (1, 2, 4)
BUDGET = 8


class OneRank:
    def __init__(self, worker: ShardWorker) -> None:
        self.worker = worker

    def run(self, cmd: Command):
        out = self.worker.execute(cmd)
        torch.cuda.synchronize()
        return out


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> ShardWorker:
    model = make_tiny(tmp_path_factory.mktemp("tiny") / "m", int4=True, seed=0)
    engine = EngineConfig(dtype="bfloat16", cuda_graphs=True, num_slots=8192, budget=BUDGET,
                          max_streams=max(BUCKETS), graph_buckets=BUCKETS)  # fmt: skip
    spec = ShardSpec(model_path=str(model), drafter_path=str(model / "drafter"), device="cuda",
                     engine=engine)  # fmt: skip
    w = ShardWorker(0, spec)
    w.setup("")
    return w


def _first_step_s(rank: OneRank, prompt_lens: list[int], tag: str) -> float:
    """Admit and prefill streams of these prompt lengths; seconds of their first decode step."""
    sids = [(tag, i) for i in range(len(prompt_lens))]
    params = SamplingParams(max_tokens=BUDGET + 2, ignore_eos=True)
    add = tuple((s, [(3 * i + j) % 250 for j in range(n)], params)
                for i, (s, n) in enumerate(zip(sids, prompt_lens, strict=True)))  # fmt: skip
    done = set(rank.run(Command(add=add, prefill=True)).outputs)
    while done < set(sids):
        done |= set(rank.run(Command(prefill=True)).outputs)
    t0 = time.perf_counter()
    rank.run(Command(step=tuple(sids), speculative=True, budget=BUDGET))
    took = time.perf_counter() - t0
    rank.run(Command(cancel=tuple(sids)))
    return took


def test_after_warmup_every_bucket_and_capacity_replays_a_captured_graph(worker) -> None:
    runner, rank = worker.runner, OneRank(worker)
    free = runner.free_slots
    plan = WarmupPlan(step_shapes(BUCKETS, max(BUCKETS), [(BUDGET,)] * len(BUCKETS)),
                      prefix_capacities(True, 1024))  # fmt: skip
    took = run_warmup(rank, plan, runner.model_cfg.vocab_size)
    captured = set(runner._graphs._verify)  # DDTree steps replay whole verify-step graphs
    assert len(captured) == len(BUCKETS) * len(plan.capacities) == 9  # (bucket, budget, P, ..)
    assert runner.free_slots == free
    batches = {"1 short": [8], "2 short": [8, 9], "3 short": [8, 9, 10], "1 long": [300],
               "3 mixed": [8, 600, 20], "4 long": [700, 701, 702, 703]}  # fmt: skip
    steps = {name: _first_step_s(rank, lens, name) for name, lens in batches.items()}
    assert set(runner._graphs._verify) == captured and runner.free_slots == free
    print(f"\nwarm-up {took:.2f} s for {plan.total} shapes; first steps after it: "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in steps.items()))  # fmt: skip
