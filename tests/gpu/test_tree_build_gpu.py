"""The torch tree builder runs on the GPU, equals its CPU result and captures in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from ddserve.ddtree.tree import build_tree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("budget", [1, 8, 64, 128])
def test_gpu_tree_equals_cpu_tree(budget):
    gen = torch.Generator().manual_seed(budget)
    logits = torch.randn(16, 15, 4096, generator=gen) * 3
    cpu = build_tree(logits, budget)
    gpu = build_tree(logits.cuda(), budget)
    for name in ("tokens", "parents", "depths", "visible"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


def test_builder_captures_in_a_cuda_graph():
    """No host sync inside: capture succeeds and replay recomputes on new logits."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 15, 2048, generator=gen) * 3).cuda()
    build_tree(logits, 32)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree = build_tree(logits, 32)
    logits.copy_(torch.randn(4, 15, 2048, generator=gen).cuda() * 3)
    graph.replay()
    fresh = build_tree(logits, 32)
    assert torch.equal(tree.tokens, fresh.tokens) and torch.equal(tree.parents, fresh.parents)
