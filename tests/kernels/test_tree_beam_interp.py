"""The fused tree kernel (ddserve/kernels/tree_beam.py, the tree builder's second stage) in the
Triton interpreter on the CPU: the torch beam's tensors (`tree_from_topk_torch`) bit for bit,
scores compared as their int32 bits; plus the host-side contracts (caps, the CPU path, an
offline sm_90 compile with the PDL wait first).

The kernel checks run in one subprocess with TRITON_INTERPRET=1, as in
test_draft_topk_interp.py. Inputs are what `top_draft_tokens` gives: each depth's log-probs
sorted descending in [MIN_LOGPROB, 0]; random, quantized to a few values (ties everywhere),
clamped at MIN_LOGPROB (K < budget: the torch beam pads depth 1 with -inf), and +0.0 / -0.0.
tests/gpu/test_tree_beam_gpu.py repeats the checks on a GPU at K2.6's shapes.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from ddserve.ddtree.tree import MIN_LOGPROB, max_tree_nodes, tree_from_topk, tree_from_topk_torch
from tests.triton_interp import (
    interpreter_results,
    patch_interpreter,
    require_sm90_compiler,
    require_triton,
    run_cases,
)

FIELDS = ("tokens", "parents", "depths", "visible", "scores")
KINDS = ("random", "quantized", "clamped", "signed_zeros")

# name -> (B, D, K, budget, kind)
SHAPES = {
    "k26_depths_budget16": (2, 15, 16, 16, "random"),
    "budget64_k64_ties": (1, 15, 64, 64, "quantized"),
    "odd_k7_budget40": (2, 5, 7, 40, "quantized"),
    "k3_below_budget_clamped": (2, 6, 3, 30, "clamped"),
    "k1_chain": (2, 8, 1, 5, "random"),
    "one_depth": (2, 1, 9, 9, "quantized"),
    "budget1": (2, 3, 1, 1, "random"),
    "depths_past_budget": (1, 20, 4, 12, "signed_zeros"),
}


def topk_inputs(b: int, d: int, k: int, kind: str, seed: int, device="cpu"):
    """(top_lp [B, D, K] float32 sorted descending in [MIN_LOGPROB, 0], top_tok [B, D, K] int64)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        lp = (torch.randn(b, d, max(k, 32), generator=g) * 3).log_softmax(-1)[..., :k]
    elif kind == "quantized":  # 4 values: most candidates tie with many others
        lp = -(torch.randint(0, 4, (b, d, k), generator=g).float() * 0.5)
    elif kind == "clamped":  # about 3 in 4 at MIN_LOGPROB
        lp = -(torch.rand(b, d, k, generator=g) * 4e4)
    else:
        assert kind == "signed_zeros", kind
        lp = torch.where(torch.rand(b, d, k, generator=g) < 0.5, -0.0, 0.0)
        lp[torch.rand(b, d, k, generator=g) < 0.3] = -1.0
    lp = lp.clamp_min(MIN_LOGPROB).sort(dim=-1, descending=True, stable=True).values
    tok = torch.randint(0, 163840, (b, d, k), generator=g)
    return lp.contiguous().to(device), tok.to(device)


def assert_same_tree(got, want) -> None:
    """Every tensor equal, scores bit for bit (-0.0 is not +0.0)."""
    for name, a in zip(FIELDS, got, strict=True):
        b = getattr(want, name)
        if name == "scores":
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert a.shape == b.shape and torch.equal(a, b), (name, a, b)


def check_matches_torch_beam(kernel, name: str) -> None:
    b, d, k, budget, kind = SHAPES[name]
    lp, tok = topk_inputs(b, d, k, kind, seed=len(name))
    assert_same_tree(kernel.tree_beam(lp, tok, budget), tree_from_topk_torch(lp, tok, budget))


def check_random_small_trees(kernel) -> None:
    """12 random (B, D, K, budget, kind), budgets 1 to 21."""
    rng = random.Random(0)
    done = 0
    while done < 12:
        budget = rng.choice([1, 2, 3, 5, 8, 13, 16, 21])
        k, d = rng.randint(1, budget), rng.randint(1, 7)
        if max_tree_nodes(d, k, budget) < budget:
            continue
        lp, tok = topk_inputs(rng.randint(1, 2), d, k, rng.choice(KINDS), seed=done)
        assert_same_tree(kernel.tree_beam(lp, tok, budget), tree_from_topk_torch(lp, tok, budget))
        done += 1


def check_all_equal_log_probs_keep_flat_index_order(kernel) -> None:
    """Every log-prob -1.0: the tree is breadth-first (all of depth 1, then depth 2 ...), each
    depth's nodes by parent row then rank, as the torch beam's stable sorts order them."""
    k, budget = 3, 12
    lp, tok = torch.full((1, 3, k), -1.0), torch.arange(9).view(1, 3, 3)
    got = kernel.tree_beam(lp, tok, budget)
    assert_same_tree(got, tree_from_topk_torch(lp, tok, budget))
    assert got[2][0].tolist() == [1] * 3 + [2] * 9
    assert got[1][0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert got[0][0].tolist() == [0, 1, 2] + [3, 4, 5] * 3


def check_clamped_paths_sort_above_padding(kernel) -> None:
    """K = 2 < budget 6 (the torch beam's depth-1 slots 2..5 are -inf): every log-prob but the
    first of each depth at MIN_LOGPROB; the tree holds real paths only (finite scores)."""
    lp = torch.full((2, 4, 2), MIN_LOGPROB)
    lp[:, :, 0] = torch.tensor([[-0.5, -0.25, -1.0, -0.125], [0.0, 0.0, -0.0, 0.0]])
    tok = torch.arange(16).view(2, 4, 2)
    got = kernel.tree_beam(lp, tok, 6)
    assert_same_tree(got, tree_from_topk_torch(lp, tok, 6))
    assert torch.isfinite(got[4]).all() and (got[4][:, 4:] <= MIN_LOGPROB).all()


def check_row_alone_equals_row_in_batch(kernel) -> None:
    lp, tok = topk_inputs(3, 6, 5, "quantized", seed=3)
    batch = kernel.tree_beam(lp, tok, 12)
    alone = kernel.tree_beam(lp[1:2].contiguous(), tok[1:2].contiguous(), 12)
    for a, b in zip(alone, batch, strict=True):
        assert torch.equal(a[0].view(torch.uint8), b[1].view(torch.uint8))


def check_tree_from_topk_builds_on_the_kernel(kernel) -> None:
    """`tree_from_topk` builds its DraftTree from the kernel's tensors where `backend.tree_beam`
    returns them (here forced: the interpreter runs on CPU tensors)."""
    from unittest import mock

    from ddserve.kernels import backend

    lp, tok = topk_inputs(2, 4, 4, "random", seed=4)
    with mock.patch.object(backend, "tree_beam", kernel.tree_beam):
        tree = tree_from_topk(lp, tok, 10)
    assert tree.max_depth == 4
    assert_same_tree([getattr(tree, n) for n in FIELDS], tree_from_topk_torch(lp, tok, 10))


CASES = (
    [(f"matches_torch_beam[{n}]", check_matches_torch_beam, (n,)) for n in SHAPES]
    + [("random_small_trees", check_random_small_trees, ())]
    + [("all_equal_log_probs", check_all_equal_log_probs_keep_flat_index_order, ())]
    + [("clamped_paths_sort_above_padding", check_clamped_paths_sort_above_padding, ())]
    + [("row_alone_equals_row_in_batch", check_row_alone_equals_row_in_batch, ())]
    + [("tree_from_topk_takes_the_kernel", check_tree_from_topk_builds_on_the_kernel, ())]
)  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


def test_cpu_tree_from_topk_is_the_torch_beam() -> None:
    lp, tok = topk_inputs(2, 5, 6, "quantized", seed=1)
    assert_same_tree([getattr(tree_from_topk(lp, tok, 24), n) for n in FIELDS],
                     tree_from_topk_torch(lp, tok, 24))  # fmt: skip


def test_supports_caps_and_layouts() -> None:
    from ddserve.kernels import tree_beam

    require_triton()
    lp, tok = topk_inputs(2, 15, 16, "random", seed=2)
    assert tree_beam.supports(lp, tok, 16) and tree_beam.supports(lp, tok, tree_beam.MAX_BUDGET)
    assert not tree_beam.supports(lp, tok, tree_beam.MAX_BUDGET + 1)
    assert not tree_beam.supports(lp, tok, 15)  # K > budget
    assert not tree_beam.supports(lp.double(), tok, 16)
    assert not tree_beam.supports(lp, tok.int(), 16)
    assert not tree_beam.supports(lp.transpose(1, 2), tok.transpose(1, 2), 16)
    one = (lp[:, :1, :2].contiguous(), tok[:, :1, :2].contiguous())
    assert tree_beam.supports(*one, 2) and not tree_beam.supports(*one, 3)  # 2 paths < 3
    assert not tree_beam.supports(lp[0], tok[0], 16)


@pytest.mark.parametrize("budget,warps", [(16, 4), (64, 1), (64, 4), (256, 4)])
def test_kernel_compiles_for_sm90_and_waits_first(budget: int, warps: int) -> None:
    """The kernel compiles offline for sm_90 (H100 / H200) at K2.6's 15 depths with PDL and the
    JIT's pointer divisibility, waits before its first global memory access and keeps fp32
    denormals; a compile error fails the test (the interpreter does not compile)."""
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import tree_beam

    require_sm90_compiler()
    rows = triton.next_power_of_2(budget + 1)
    sig = dict(lp_ptr="*fp32", tok_ptr="*i64", tokens_ptr="*i64", parents_ptr="*i64",
               depths_ptr="*i64", scores_ptr="*fp32", visible_ptr="*u8")  # fmt: skip
    consts = dict(D=15, K=budget, N=budget, DEPTH=15, N_PAD=triton.next_power_of_2(budget),
                  ROWS_PAD=rows, ROW_BLOCK=max(1, min(rows, tree_beam.VISIBLE_TILE // rows)),
                  PDL=True)  # fmt: skip
    kernel = tree_beam._tree_beam_kernel
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig}
    src = ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs)
    opts = {"num_warps": warps, "launch_pdl": True}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]
    mem = re.search(r"\b(ld\.global|st\.global)", ptx)
    assert mem and 0 <= ptx.find("griddepcontrol.wait") < mem.start()
    assert ".ftz" not in ptx  # score additions keep denormals, as torch's do


if __name__ == "__main__":  # the interpreter subprocess
    patch_interpreter()
    from ddserve.kernels import tree_beam

    print(json.dumps(run_cases(CASES, tree_beam)))
