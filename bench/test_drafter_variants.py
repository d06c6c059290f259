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
    assert set(VARIANTS) == {"default", "eager-commit", "gathered", "separate-mlp",
                             "invariant-linear"}  # fmt: skip


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


def test_invariant_linear_variant_drafts_and_commits_the_same():
    """Every drafter matmul through `backend.linear` (on the CPU its torch reference): the same
    draft logits and context keys, each projection counted, and F.linear back after."""
    from bench_drafter import SMALL, build

    from ddserve.drafter import model as dflash_model
    from ddserve.kernels import backend

    cfg, model, hooks, drafter, width = build(SMALL, 24, 2, "cpu", torch.float32)
    rows, bonus = torch.tensor(drafter.state_rows([1, 0])), torch.tensor([4, 7])
    hidden = torch.randn(3, width, generator=torch.Generator().manual_seed(3))
    want = drafter.draft_rows(rows, bonus), model.context_kv(hidden, torch.arange(24, 27))
    calls, linear = [], backend.linear
    backend.linear = lambda *a, **k: calls.append(1) or linear(*a, **k)
    try:
        with variant("invariant-linear", drafter):
            got = drafter.draft_rows(rows, bonus), model.context_kv(hidden, torch.arange(24, 27))
    finally:
        backend.linear = linear
    # per layer: q, k, v, o, stacked gate+up, down; then fc and the stacked k/v
    assert len(calls) == 6 * cfg.num_hidden_layers + 2
    assert layers.F is dflash_model.F is torch.nn.functional
    assert "forward" not in vars(model.fc)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
