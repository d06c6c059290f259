"""On CUDA, tree build, target-token selection and the acceptance walk never sync with the host."""

from __future__ import annotations

import pytest
import torch

from ddserve.ddtree import accept, build_tree, select_tokens, verify_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,d,v,budget", [(1, 15, 163840, 16), (10, 15, 163840, 64), (4, 7, 264, 128)]
)
def test_ddtree_pure_step_has_no_host_sync(b: int, d: int, v: int, budget: int) -> None:
    dev = "cuda"
    logits = torch.randn(b, d, v, device=dev)
    target_logits = torch.randn(b, budget + 1, v, device=dev)
    args = [
        torch.full((b,), 0.7, device=dev),
        torch.full((b,), 20, device=dev),
        torch.full((b,), 0.9, device=dev),
        torch.arange(b, device=dev),
        torch.zeros(b, dtype=torch.long, device=dev),
    ]
    prefix = torch.arange(b, device=dev) * 100
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree = build_tree(logits, budget)
        verify_inputs(tree, tree.tokens[:, 0], prefix)
        acc = accept(tree, select_tokens(target_logits, *args))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert acc.packed().shape == (b, 2 * (tree.max_depth + 1) + 1)
    parents = tree.parents.cpu()
    assert (parents < torch.arange(1, budget + 1)).all()  # parents precede children
