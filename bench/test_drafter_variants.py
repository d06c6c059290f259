"""bench/drafter_variants.py on the CPU: each attention variant computes the drafter's attention
(against `grouped_attention`), is what the drafter's layers call inside its context and is
undone after it; the commit variant toggles the graphed commit and restores it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_variants import VARIANTS, variant  # noqa: E402

from ddserve.drafter import layers  # noqa: E402


class FakeDrafter:
    graph_commits = False


@pytest.mark.parametrize("name", ["sdpa", "pad8", "fp32-pv"])
def test_attention_variants_compute_the_same_attention(name):
    g = torch.Generator().manual_seed(1)
    b, q_len, nh, kvh, d, keys = 2, 5, 8, 2, 16, 27  # 27 keys: pad8 pads 5
    q = torch.randn(b, q_len, nh, d, generator=g)
    k, v = (torch.randn(b, kvh, keys, d, generator=g) for _ in "kv")
    visible = torch.rand(b, q_len, keys, generator=g) > 0.3
    visible[..., -q_len:] = True
    want = layers.grouped_attention(q, k, v, visible)
    original = layers.grouped_attention
    with variant(name, FakeDrafter()):
        assert layers.grouped_attention is not original  # what DFlashAttention calls now
        got = layers.grouped_attention(q, k, v, visible)
    assert layers.grouped_attention is original
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_graph_commit_variant_toggles_and_restores():
    d = FakeDrafter()
    with variant("graph-commit", d):
        assert d.graph_commits
    assert not d.graph_commits
    with variant("default", d):
        assert not d.graph_commits
    with pytest.raises(ValueError, match="unknown drafter variant"):
        variant("nope", d)
    assert set(VARIANTS) == {"default", "graph-commit", "sdpa", "pad8", "fp32-pv", "triton-ring",
                             "stacked-mlp"}  # fmt: skip


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
