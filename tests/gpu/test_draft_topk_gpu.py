"""The fused draft top-k (ddserve/kernels/draft_topk.py) on a GPU at Kimi K2.6's draft shapes
(V 163840, 15 depths, 1 / 10 / 16 streams, k 16 and 64): `draft_topk_ref`'s tokens exactly, its
log-probs to 1e-5, torch's log_softmax + topk values to 1e-5; bitwise the same across calls,
with PDL on or off, and inside a CUDA graph; no host sync; `build_tree` on CUDA takes it (and
the torch stage past MAX_K).
tests/kernels/test_draft_topk_interp.py runs the same checks at small shapes in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from ddserve.ddtree.tree import (
    MIN_LOGPROB,
    build_tree,
    log_softmax_topk,
    top_draft_tokens,
    tree_from_topk,
)
from ddserve.kernels import backend, draft_topk
from ddserve.kernels.config import KernelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
D, V = 15, 163840


def logits(b: int, seed: int, dtype=torch.bfloat16, v: int = V) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, D, v, generator=g, device="cuda") * 3).to(dtype)  # [B, D, V]


def check_contract(x: torch.Tensor, k: int, lp: torch.Tensor, tok: torch.Tensor) -> None:
    ref_lp, ref_tok = draft_topk.draft_topk_ref(x, k, MIN_LOGPROB)
    assert lp.shape == tok.shape == (*x.shape[:2], k)
    assert torch.equal(tok, ref_tok), (tok != ref_tok).nonzero()[:10]
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, log_softmax_topk(x, k)[0], atol=1e-5, rtol=0)
    assert (lp[..., 1:] <= lp[..., :-1]).all()


@pytest.mark.parametrize("k", [16, 64])
@pytest.mark.parametrize("b", [1, 10, 16])
def test_matches_reference_at_k26_shapes(b: int, k: int) -> None:
    x = logits(b, seed=b * 100 + k)
    check_contract(x, k, *draft_topk.draft_topk(x, k, MIN_LOGPROB))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes(dtype) -> None:
    x = logits(4, seed=7, dtype=dtype)
    check_contract(x, 64, *draft_topk.draft_topk(x, 64, MIN_LOGPROB))


def test_ties_minus_inf_and_large_k() -> None:
    """Integer logits (every value tied thousands of times), a row of -inf but for 3 tokens, and
    k = MAX_K."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randint(0, 5, (2, D, V), generator=g, device="cuda").to(torch.bfloat16)
    x[1, 4] = float("-inf")
    x[1, 4, [5, 90000, 163839]] = 1.0
    for k in (64, draft_topk.MAX_K):
        check_contract(x, k, *draft_topk.draft_topk(x, k, MIN_LOGPROB))


@pytest.mark.parametrize("pdl", [True, False])
def test_bitwise_repeatable_and_graph_capturable(pdl: bool) -> None:
    """Two calls give the same bits (also with the other PDL setting); a captured call replayed
    on new logits gives the eager call's bits on them; the call never syncs with the host."""
    x = logits(16, seed=1)
    with backend.kernel_mode(KernelConfig(pdl=pdl)):
        first = draft_topk.draft_topk(x, 64, MIN_LOGPROB)
        second = draft_topk.draft_topk(x, 64, MIN_LOGPROB)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            draft_topk.draft_topk(x, 64, MIN_LOGPROB)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = draft_topk.draft_topk(x, 64, MIN_LOGPROB)
        x.copy_(logits(16, seed=2))
        graph.replay()
        fresh = draft_topk.draft_topk(x, 64, MIN_LOGPROB)
    with backend.kernel_mode(KernelConfig(pdl=not pdl)):
        other = draft_topk.draft_topk(logits(16, seed=1), 64, MIN_LOGPROB)
    for a, b in ((first, second), (first, other), (captured, fresh)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_row_alone_equals_row_in_batch() -> None:
    x = logits(16, seed=4)
    lp, tok = draft_topk.draft_topk(x, 32, MIN_LOGPROB)
    alone = draft_topk.draft_topk(x[9:10, 3:4], 32, MIN_LOGPROB)
    assert torch.equal(alone[0][0, 0], lp[9, 3]) and torch.equal(alone[1][0, 0], tok[9, 3])


@pytest.mark.parametrize("budget", [16, 64])
def test_build_tree_on_cuda_uses_the_fused_first_stage(budget: int) -> None:
    x = logits(10, seed=5)
    tree = build_tree(x, budget)
    want = tree_from_topk(*draft_topk.draft_topk(x, budget, MIN_LOGPROB), budget)
    for name in ("tokens", "parents", "depths", "visible", "scores"):
        assert torch.equal(getattr(tree, name), getattr(want, name)), name


def test_build_tree_fused_equals_torch_without_near_ties() -> None:
    """fp32 logits (no exact ties): the fused tree is the torch first stage's tree."""
    x = logits(4, seed=6, dtype=torch.float32, v=4096)
    for budget in (8, 64):
        fused = build_tree(x, budget)
        ref = tree_from_topk(*log_softmax_topk(x, budget), budget)
        for name in ("tokens", "parents", "depths", "visible"):
            assert torch.equal(getattr(fused, name), getattr(ref, name)), (budget, name)


def test_k_past_max_k_takes_the_torch_stage() -> None:
    x = logits(2, seed=8)
    k = draft_topk.MAX_K + 1
    got, want = top_draft_tokens(x, k), log_softmax_topk(x, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
