"""The DFlash drafter's block commit on a GPU: `commit_block` replays a CUDA graph captured per
block shape, and its ring and lengths equal the eager `commit_many`'s, step after step, in bf16
with the engine's kernel mode. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from ddserve.config import ModelConfig
from ddserve.drafter.config import DrafterConfig
from ddserve.drafter.model import DFlashDrafter, DFlashModel
from ddserve.drafter.tiny import random_weights, tiny_drafter_config
from ddserve.kernels import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
H, V = 256, 264


class Hooks:  # never called: the test commits and compares rings, it does not draft
    def embed(self, ids):
        raise AssertionError

    def lm_logits(self, h):
        raise AssertionError


def drafter_pair():
    tcfg = ModelConfig.from_hf(dict(
        model_type="deepseek_v3", hidden_size=H, num_hidden_layers=6, vocab_size=V,
        num_attention_heads=4, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
    ))  # fmt: skip
    cfg = DrafterConfig.from_hf(tiny_drafter_config(tcfg, num_layers=3, block_size=8,
                                                    sliding_window=16))  # fmt: skip
    model = DFlashModel(cfg)
    model.load_state_dict(random_weights(cfg, seed=4, std=0.1))
    model = model.to("cuda", torch.bfloat16)
    model.stack_context_kv()
    pair = [DFlashDrafter(model, Hooks(), max_streams=4, max_context=512) for _ in range(2)]
    pair[1].graph_commits = False  # the reference: eager `commit_many`
    return pair


def test_graphed_block_commit_equals_commit_many():
    graphed, eager = drafter_pair()
    k = len(eager.capture_layers)
    g, rng = torch.Generator(device="cuda").manual_seed(1), random.Random(2)
    sids = ["a", "b", "c"]
    with backend.invariant_mode(True):
        for sid, n in zip(sids, (3, 20, 9), strict=True):
            first = torch.randn(n, k * H, generator=g, device="cuda").bfloat16()
            for d in (graphed, eager):
                d.add_stream(sid, [0] * n, first)
        for step in range(9):
            batch = sids if step % 3 else sids[:2]  # two block shapes, each replayed
            w = 8 if step % 2 else 5
            hidden = torch.randn(len(batch), w, k * H, generator=g, device="cuda").bfloat16()
            toks = [[0] * rng.randint(1, w) for _ in batch]
            graphed.commit_block(batch, toks, hidden)
            eager.commit_many([(s, t, hidden[i, : len(t)]) for i, (s, t) in
                               enumerate(zip(batch, toks, strict=True))])  # fmt: skip
            torch.testing.assert_close(graphed.cache.k, eager.cache.k, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(graphed.cache.v, eager.cache.v, atol=2e-2, rtol=2e-2)
            assert torch.equal(graphed.cache.lengths, eager.cache.lengths)
            assert [graphed.cache.length(s) for s in sids] == [eager.cache.length(s) for s in sids]
    assert len(graphed._graphs) == 4  # (2 or 3 streams) x (5 or 8 rows), captured once each
    assert graphed.cache.length("b") > 2 * graphed.cache.capacity  # the ring wrapped


def prompted_pair(seed: int, prompt_len: int):
    """`drafter_pair` holding the same prompt of stream "a", and the generator its commits draw
    from. Call inside the engine's kernel mode."""
    graphed, eager = drafter_pair()
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = len(eager.capture_layers) * H
    prompt = torch.randn(prompt_len, width, generator=g, device="cuda").bfloat16()
    for d in (graphed, eager):
        d.add_stream("a", [0] * prompt_len, prompt)
    return graphed, eager, g


def commit_both(graphed, eager, g, rows: int, count: int) -> None:
    """One commit of `count` tokens to stream "a": a block of `rows` to the graphed drafter, its
    first `count` rows to the eager one."""
    width = len(eager.capture_layers) * H
    hidden = torch.randn(1, rows, width, generator=g, device="cuda").bfloat16()
    graphed.commit_block(["a"], [[0] * count], hidden)
    eager.commit_many([("a", [0] * count, hidden[0, :count])])


def test_a_shape_whose_capture_fails_commits_eagerly(monkeypatch):
    """The first commit of a shape runs eagerly and counts (host and device lengths agree) even
    when its graph then cannot be captured; that shape stays eager, the ring still equal."""
    from ddserve.drafter import model as dflash_model

    def fail(self):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(dflash_model._CommitGraph, "capture", fail)
    with backend.invariant_mode(True):
        graphed, eager, g = prompted_pair(3, 4)
        for _ in range(3):
            commit_both(graphed, eager, g, 6, 4)
    assert graphed._graphs == {} and graphed._eager == {(1, 6)}
    assert graphed.cache.length("a") == eager.cache.length("a") == 16
    assert torch.equal(graphed.cache.lengths, eager.cache.lengths)
    torch.testing.assert_close(graphed.cache.k, eager.cache.k, atol=2e-2, rtol=2e-2)


def test_close_frees_the_commit_graphs_and_later_commits_capture_again():
    """`close` (the runner's, before its communicator goes) drops the graphs; a commit after it
    captures its shape again and the ring still equals the eager one."""
    with backend.invariant_mode(True):
        graphed, eager, g = prompted_pair(7, 5)
        for step in range(4):
            commit_both(graphed, eager, g, 4, 3)
            assert len(graphed._graphs) == 1
            if step == 1:
                graphed.close()
                assert graphed._graphs == {}
    assert graphed.cache.length("a") == eager.cache.length("a") == 17
    torch.testing.assert_close(graphed.cache.k, eager.cache.k, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(graphed.cache.v, eager.cache.v, atol=2e-2, rtol=2e-2)
