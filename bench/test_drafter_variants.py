"""bench/drafter_variants.py on the CPU: the switch variants turn their attribute off and
restore it (alone and joined with '+'), unknown names fail, and the stacked MLP drafts the same
logits as the code in use."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_variants import VARIANTS, variant  # noqa: E402

from ddserve.drafter import layers  # noqa: E402


class FakeDrafter:
    graph_commits = ring_attention = True


def test_switch_variants_turn_off_and_restore():
    d = FakeDrafter()
    with variant("eager-commit", d):
        assert not d.graph_commits and d.ring_attention
    with variant("gathered", d):
        assert d.graph_commits and not d.ring_attention
    with variant("eager-commit+gathered", d):
        assert not d.graph_commits and not d.ring_attention
    assert d.graph_commits and d.ring_attention
    with variant("default", d):
        assert d.graph_commits and d.ring_attention
    with pytest.raises(ValueError, match="unknown drafter variant 'nope'"):
        variant("gathered+nope", d)
    assert set(VARIANTS) == {"default", "eager-commit", "gathered", "stacked-mlp"}


def test_stacked_mlp_variant_drafts_the_same_logits():
    """Gate and up as one matmul over stacked weights, SiLU-times-up in one call: the same draft
    logits as the code in use (float32), and the MLP's own forward back after the variant."""
    from bench_drafter import SMALL, build

    cfg, model, hooks, drafter, width = build(SMALL, 24, 2, "cpu", torch.float32)
    rows, bonus = torch.tensor(drafter.state_rows([1, 0])), torch.tensor([4, 7])
    want = drafter.draft_rows(rows, bonus)
    forward = layers.MLP.forward
    with variant("stacked-mlp", drafter):
        assert layers.MLP.forward is not forward
        got = drafter.draft_rows(rows, bonus)
    assert layers.MLP.forward is forward
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
