"""`cuda_graphs` is CUDA-only: elsewhere the engine says so and decodes eagerly, unchanged."""

from __future__ import annotations

import logging

from ddserve.drafter.testing import RandomDrafter
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.sampling import SamplingParams


def test_cuda_graphs_on_cpu_fall_back_to_eager(tiny_model_dir, caplog):
    def decode(graphs: bool) -> list[int]:
        cfg = EngineConfig(num_slots=512, budget=4, dtype="float32", cuda_graphs=graphs)
        runner = ModelRunner(tiny_model_dir, engine_cfg=cfg, device="cpu",
                             drafter=RandomDrafter(264, depth=3, seed=0))  # fmt: skip
        start = runner.free_slots
        runner.add_stream(0, [5, 6, 7], SamplingParams(max_tokens=10))
        toks = list(runner.prefill()[0].tokens)
        while runner.streams:
            toks += runner.ddtree_step([0])[0].tokens
        assert runner.free_slots == start
        runner.close()
        return toks

    with caplog.at_level(logging.WARNING, logger="ddserve.engine.runner"):
        assert decode(True) == decode(False)
    assert "running eagerly" in caplog.text
