"""bench/drafter_variants.py on the CPU: the switch variants turn their attribute off and
restore it (alone and joined with '+'), unknown names fail, and the separate MLP matmuls draft the
same logits as the stacked ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_variants import VARIANTS, variant  # noqa: E402

from ddserve.drafter import layers  # noqa: E402


class FakeDrafter:
    graph_commits = ring_attention = step_commits = True


def test_switch_variants_turn_off_and_restore():
    d = FakeDrafter()
    with variant("eager-commit", d):
        assert not d.graph_commits and d.ring_attention
    with variant("gathered", d):
        assert d.graph_commits and not d.ring_attention
    with variant("eager-commit+gathered", d):
        assert not d.graph_commits and not d.ring_attention
    assert d.graph_commits and d.ring_attention
    with variant("commit-after-step+eager-commit", d):
        assert not d.step_commits and not d.graph_commits and d.ring_attention
    assert d.step_commits
    with variant("default", d):
        assert d.graph_commits and d.ring_attention
    with pytest.raises(ValueError, match="unknown drafter variant 'nope'"):
        variant("gathered+nope", d)
    assert set(VARIANTS) == {"default", "commit-after-step", "eager-commit", "gathered",
                             "separate-mlp"}  # fmt: skip


def test_separate_mlp_variant_drafts_the_same_logits():
    """The stacked MLP (the code in use after `DFlashModel.stack`) and the separate-mlp
    variant's two matmuls: the same draft logits (float32), the stacked path back after."""
    from bench_drafter import SMALL, build

    cfg, model, hooks, drafter, width = build(SMALL, 24, 2, "cpu", torch.float32)
    mlp = model.layers[0].mlp
    assert layers.stacked_rows(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
    rows, bonus = torch.tensor(drafter.state_rows([1, 0])), torch.tensor([4, 7])
    want = drafter.draft_rows(rows, bonus)
    with variant("separate-mlp", drafter):
        assert layers.stacked_rows(mlp.gate_proj.weight, mlp.up_proj.weight) is None
        got = drafter.draft_rows(rows, bonus)
    assert layers.stacked_rows(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
