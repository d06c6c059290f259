"""The fused tree kernel (ddserve/kernels/tree_beam.py) on a GPU at Kimi K2.6's draft shapes (15
depths, 1 / 10 / 16 streams, budgets 16 / 32 / 64): the torch beam's tensors on the same device
bit for bit (scores as int32 bits), on the fused first stage's top-k of bf16 logits (ties
between equal logits) and on tied, clamped, signed-zero and denormal log-probs; the same bits
inside a CUDA graph and with PDL on or off; no host sync; `build_tree` on CUDA takes it.
tests/kernels/test_tree_beam_interp.py runs the same checks at small shapes in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from ddserve.ddtree.tree import (
    MIN_LOGPROB,
    build_tree,
    top_draft_tokens,
    tree_from_topk,
    tree_from_topk_torch,
)
from ddserve.kernels import backend, tree_beam
from ddserve.kernels.config import KernelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
D, V = 15, 163840
FIELDS = ("tokens", "parents", "depths", "visible", "scores")


def logits(b: int, seed: int, v: int = V) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, D, v, generator=g, device="cuda") * 3).to(torch.bfloat16)  # [B, D, V]


def special_topk(b: int, k: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_lp [B, D, k] sorted descending in [MIN_LOGPROB, 0] with many exact ties."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (b, D, k)
    if kind == "quantized":
        lp = -(torch.randint(0, 4, shape, generator=g, device="cuda").float() * 0.5)
    elif kind == "clamped":
        lp = -(torch.rand(shape, generator=g, device="cuda") * 4e4)
    elif kind == "signed_zeros":
        lp = torch.where(torch.rand(shape, generator=g, device="cuda") < 0.5, -0.0, 0.0)
        lp[torch.rand(shape, generator=g, device="cuda") < 0.2] = -1.0
    else:
        assert kind == "denormal", kind  # sums of denormals stay denormal (no flush to zero)
        lp = -(torch.randint(0, 4, shape, generator=g, device="cuda").float() * 1e-40)
    lp = lp.clamp_min(MIN_LOGPROB).sort(dim=-1, descending=True, stable=True).values
    return lp.contiguous(), torch.randint(0, V, shape, generator=g, device="cuda")


def assert_same(got, want) -> None:
    for name, a in zip(FIELDS, got, strict=True):
        b = want[name] if isinstance(want, dict) else getattr(want, name)
        if name == "scores":
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), (name, (a != b).nonzero()[:10])


@pytest.mark.parametrize("budget", [16, 32, 64])
@pytest.mark.parametrize("b", [1, 10, 16])
def test_matches_torch_beam_at_k26_shapes(b: int, budget: int) -> None:
    x = logits(b, seed=b * 100 + budget)
    for k in (budget, 8):  # build_tree's default K = budget, and a smaller top-k
        lp, tok = top_draft_tokens(x, k)
        assert_same(tree_beam.tree_beam(lp, tok, budget), tree_from_topk_torch(lp, tok, budget))


@pytest.mark.parametrize("kind", ["quantized", "clamped", "signed_zeros", "denormal"])
@pytest.mark.parametrize("budget,k", [(16, 16), (64, 64), (64, 5), (256, 256)])
def test_matches_torch_beam_on_ties(kind: str, budget: int, k: int) -> None:
    lp, tok = special_topk(10, k, kind, seed=budget + k)
    assert_same(tree_beam.tree_beam(lp, tok, budget), tree_from_topk_torch(lp, tok, budget))


@pytest.mark.parametrize("pdl", [True, False])
def test_bitwise_repeatable_graph_capturable_and_sync_free(pdl: bool) -> None:
    """Two calls give the same bits (also with the other PDL setting); a captured call replayed
    on new top-k gives the eager call's bits on them; the call never syncs with the host."""
    lp, tok = top_draft_tokens(logits(16, seed=1), 64)
    with backend.kernel_mode(KernelConfig(pdl=pdl)):
        first = tree_beam.tree_beam(lp, tok, 64)
        second = tree_beam.tree_beam(lp, tok, 64)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tree_beam.tree_beam(lp, tok, 64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = tree_beam.tree_beam(lp, tok, 64)
        new_lp, new_tok = top_draft_tokens(logits(16, seed=2), 64)
        lp.copy_(new_lp)
        tok.copy_(new_tok)
        graph.replay()
        fresh = tree_beam.tree_beam(lp, tok, 64)
    with backend.kernel_mode(KernelConfig(pdl=not pdl)):
        other = tree_beam.tree_beam(*top_draft_tokens(logits(16, seed=1), 64), 64)
    for a, b in ((first, second), (first, other), (captured, fresh)):
        assert_same(a, dict(zip(FIELDS, b, strict=True)))
    assert_same(fresh, tree_from_topk_torch(lp, tok, 64))


def test_row_alone_equals_row_in_batch() -> None:
    lp, tok = top_draft_tokens(logits(16, seed=4), 32)
    batch = tree_beam.tree_beam(lp, tok, 32)
    alone = tree_beam.tree_beam(lp[9:10].contiguous(), tok[9:10].contiguous(), 32)
    for a, b in zip(alone, batch, strict=True):
        assert torch.equal(a[0].view(torch.uint8), b[9].view(torch.uint8))


@pytest.mark.parametrize("budget", [16, 64])
def test_build_tree_on_cuda_takes_the_fused_beam(budget: int) -> None:
    x = logits(10, seed=5)
    tree = build_tree(x, budget)
    assert tree.max_depth == D
    assert_same([getattr(tree, n) for n in FIELDS],
                tree_from_topk_torch(*top_draft_tokens(x, budget), budget))  # fmt: skip


def test_budget_past_the_cap_takes_the_torch_beam() -> None:
    lp, tok = special_topk(2, 16, "quantized", seed=6)
    budget = tree_beam.MAX_BUDGET + 1
    assert not tree_beam.supports(lp, tok, budget)
    got = tree_from_topk(lp, tok, budget)
    assert_same([getattr(got, n) for n in FIELDS], tree_from_topk_torch(lp, tok, budget))
