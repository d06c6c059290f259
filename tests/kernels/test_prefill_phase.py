"""Prompt chunks run under `backend.prefill_phase()`: the batch-invariant matmuls switch to the
large-tile prefill configuration there and back to the decode configuration after, and the
engine's prefill forward (only it) runs inside the phase."""

from __future__ import annotations

import torch

from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels import backend, invariant_configs
from ddserve.sampling import SamplingParams


def test_prefill_phase_switches_16bit_configs_only() -> None:
    decode = invariant_configs.mm_config(1536, 7168, torch.bfloat16)
    fp32 = invariant_configs.mm_config(384, 7168, torch.float32)
    with backend.prefill_phase():
        prefill = invariant_configs.mm_config(1536, 7168, torch.bfloat16)
        assert invariant_configs.mm_config(384, 7168, torch.float32) == fp32
        with backend.prefill_phase():  # nesting keeps the phase
            assert invariant_configs.mm_config(1536, 7168, torch.bfloat16) == prefill
        assert invariant_configs.mm_config(1536, 7168, torch.bfloat16) == prefill
    assert prefill != decode and prefill.split == 1 and prefill.block_m >= decode.block_m
    assert invariant_configs.mm_config(1536, 7168, torch.bfloat16) == decode


def test_only_the_prefill_forward_runs_in_the_phase(tiny_model_dir, monkeypatch) -> None:
    runner = ModelRunner(tiny_model_dir, engine_cfg=EngineConfig(num_slots=512), device="cpu")
    seen: list[tuple[int, bool]] = []
    forward = runner._forward

    def spy(ids, *args, **kwargs):
        seen.append((int(ids.numel()), backend.in_prefill_phase()))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(runner, "_forward", spy)
    runner.add_stream(0, list(range(5, 30)), SamplingParams(max_tokens=3))
    runner.prefill()
    runner.ar_step([0])
    assert seen[0] == (25, True)  # the prompt chunk
    assert seen[-1] == (1, False)  # the decode step
