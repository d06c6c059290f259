"""Tree-verify MLA attention and verify inputs against dense masked softmax attention."""

from __future__ import annotations

import random

import pytest
import torch

from ddserve.ddtree.tree import ancestor_mask, build_tree
from ddserve.ddtree.verify import block_meta, causal_masks, verify_inputs
from ddserve.kernels.tree_attn import tree_mla_attention_ref

H, R, P = 2, 16, 8


def random_parents(n: int, rng: random.Random) -> list[int]:
    """Random tree in topological order: node i (row i+1) has a parent row in 0..i."""
    return [rng.randint(0, i) for i in range(n)]


def dense_attention(q_lat, q_rope, cache, visible, scale):
    """[T, S] visibility over the whole pool, plain softmax in float64."""
    keys = cache.double()
    scores = torch.einsum("thr,sr->hts", q_lat.double(), keys[:, :R])
    scores += torch.einsum("thp,sp->hts", q_rope.double(), keys[:, R:])
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,sr->thr", scores.softmax(-1), keys[:, :R])


@pytest.mark.parametrize(
    "prefix_lens,tree_sizes",
    [([0], [1]), ([1000], [129]), ([0, 7, 300], [1, 64, 129]), ([999, 1, 50, 0], [17, 2, 129, 33])],
)
def test_tree_attention_matches_dense(prefix_lens: list[int], tree_sizes: list[int]) -> None:
    rng, gen = random.Random(sum(prefix_lens)), torch.Generator().manual_seed(len(tree_sizes))
    num_slots = sum(prefix_lens) + sum(tree_sizes) + 5
    perm = torch.randperm(num_slots, generator=gen).tolist()  # scattered slots
    cache = torch.randn(num_slots, R + P, generator=gen)
    prefixes, blocks, parents = [], [], []
    for pl, ts in zip(prefix_lens, tree_sizes, strict=True):
        prefixes.append([perm.pop() for _ in range(pl)])
        blocks.append([perm.pop() for _ in range(ts)])
        parents.append(random_parents(ts - 1, rng))
    q_max = max(tree_sizes)
    masks = torch.zeros(len(tree_sizes), q_max, q_max, dtype=torch.bool)
    for b, par in enumerate(parents):
        masks[b, : len(par) + 1, : len(par) + 1] = ancestor_mask(torch.tensor([par]).long(), 200)[0]
    meta = block_meta(tree_sizes, prefixes, blocks, masks, "cpu")
    t = sum(tree_sizes)
    q_lat, q_rope = torch.randn(t, H, R, generator=gen), torch.randn(t, H, P, generator=gen)
    got = tree_mla_attention_ref(q_lat, q_rope, cache, meta, softmax_scale=0.3)

    visible = torch.zeros(t, num_slots, dtype=torch.bool)
    row = 0
    for pre, blk, par in zip(prefixes, blocks, parents, strict=True):
        for j in range(len(blk)):
            visible[row + j, pre] = True
            x = j
            while True:  # ancestors of row j, computed independently from the parent list
                visible[row + j, blk[x]] = True
                if x == 0:
                    break
                x = par[x - 1]
        row += len(blk)
    want = dense_attention(q_lat, q_rope, cache, visible, 0.3)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_is_a_tree_of_one_and_prefill_is_causal() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(40, R + P, generator=gen)
    q_lat, q_rope = torch.randn(12, H, R, generator=gen), torch.randn(12, H, P, generator=gen)
    meta = block_meta(
        [5, 7],
        [list(range(10)), []],
        [list(range(10, 15)), list(range(20, 27))],
        causal_masks([5, 7]),
        "cpu",
    )
    got = tree_mla_attention_ref(q_lat, q_rope, cache, meta, 0.5)
    vis = torch.zeros(12, 40, dtype=torch.bool)
    for j in range(5):
        vis[j, : 11 + j] = True
    for j in range(7):
        vis[5 + j, 20 : 21 + j] = True
    torch.testing.assert_close(
        got.double(), dense_attention(q_lat, q_rope, cache, vis, 0.5), atol=1e-5, rtol=1e-5
    )


def test_verify_positions_are_prefix_plus_depth() -> None:
    tree = build_tree(torch.randn(3, 4, 9), 12)
    roots, prefix = torch.tensor([5, 6, 7]), torch.tensor([0, 10, 333])
    ids, pos = verify_inputs(tree, roots, prefix)
    ids, pos = ids.view(3, 13), pos.view(3, 13)
    assert ids[:, 0].tolist() == [5, 6, 7] and torch.equal(ids[:, 1:], tree.tokens)
    for b in range(3):
        parents = [0] + tree.parents[b].tolist()
        for j in range(13):
            depth, x = 0, j
            while x:
                x, depth = parents[x], depth + 1
            assert pos[b, j] == prefix[b] + depth
