"""The batched tree builder equals the paper's heapq best-first builder, written here in Python."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest
import torch

from ddserve.ddtree.tree import MIN_LOGPROB, build_tree


class Tie(Exception):
    pass


def heapq_tree(logp: np.ndarray, budget: int, k: int) -> list[tuple[int, int, int]]:
    """Best-first over one stream's [D, V] float32 log-probs -> [(token, parent_row, depth)].

    Max-heap on the summed log-prob, seeded with (depth 1, rank 0); pop = add a node; push its next
    sibling and its first child. Raises Tie when equal scores would make the order ambiguous.
    """
    d = logp.shape[0]
    order = np.argsort(-logp, axis=1, kind="stable")[:, :k]  # [D, K] token ids by rank
    lp = np.take_along_axis(logp, order, axis=1)  # [D, K] float32
    if any(len(set(row.tolist())) < len(row) for row in lp):
        raise Tie
    # entry: (-score, tie counter, depth, rank, parent_row, parent_score)
    heap = [(-lp[0, 0], 0, 1, 0, 0, np.float32(0))]
    counter, nodes, popped = 1, [], []
    while heap and len(nodes) < budget:
        neg, _, depth, rank, parent, pscore = heapq.heappop(heap)
        score = np.float32(-neg)
        popped.append(score)
        nodes.append((int(order[depth - 1, rank]), parent, depth))
        row = len(nodes)
        if rank + 1 < k:
            s = np.float32(pscore + lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-s, counter, depth, rank + 1, parent, pscore))
            counter += 1
        if depth < d:
            s = np.float32(score + lp[depth, 0])
            heapq.heappush(heap, (-s, counter, depth + 1, 0, row, score))
            counter += 1
    if len(set(popped)) < len(popped) or (heap and -heap[0][0] == popped[-1]):
        raise Tie
    return nodes


def random_case(rng: random.Random):
    budget = rng.choice([1, 2, 3, 5, 8, 16, 17, 31, 64, 100, 128, 200, 256])
    d = rng.randint(1, 8)
    v = rng.choice([2, 3, 7, 33, 264, 300])
    k = rng.choice([None, rng.randint(1, budget)])
    kk = min(budget, v, k or budget)
    total = sum(kk**i for i in range(1, d + 1))
    if total < budget:
        d = next(i for i in range(1, 64) if sum(kk**j for j in range(1, i + 1)) >= budget)
    scale = rng.choice([0.3, 1.0, 3.0, 8.0])
    return budget, d, v, k, scale


@pytest.mark.parametrize("seed", range(40))
def test_builder_matches_heapq(seed: int) -> None:
    rng = random.Random(seed)
    budget, d, v, k, scale = random_case(rng)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, d, v, generator=gen, dtype=torch.float64).float() * scale
    tree = build_tree(logits, budget, topk=k)
    kk = min(budget, v, k or budget)
    logp = logits.log_softmax(-1).clamp_min(MIN_LOGPROB).numpy()
    checked = 0
    for b in range(3):
        try:
            ref = heapq_tree(logp[b], budget, kk)
        except Tie:
            continue
        checked += 1
        assert tree.tokens[b].tolist() == [t for t, _, _ in ref]
        assert tree.parents[b].tolist() == [p for _, p, _ in ref]
        assert tree.depths[b].tolist() == [dd for _, _, dd in ref]
    assert checked >= 1


def test_visibility_is_ancestor_or_self() -> None:
    tree = build_tree(torch.randn(2, 5, 11), 40)
    for b in range(2):
        parent = [0] + tree.parents[b].tolist()
        for j in range(41):
            anc, x = {j}, j
            while x:
                x = parent[x]
                anc.add(x)
            assert tree.visible[b, j].nonzero().flatten().tolist() == sorted(anc)


def test_tied_distribution_keeps_parents_first_and_paths_distinct() -> None:
    logits = torch.zeros(2, 4, 6)
    logits[:, :, 2] = 5.0  # one strong guess per depth, every other token tied
    tree = build_tree(logits, 30)
    for b in range(2):
        parents, toks = tree.parents[b].tolist(), tree.tokens[b].tolist()
        assert all(p < i + 1 for i, p in enumerate(parents))
        paths = set()
        for i in range(30):
            path, x = [], i + 1
            while x:
                path.append(toks[x - 1])
                x = parents[x - 1]
            paths.add(tuple(path))
        assert len(paths) == 30
    assert tree.tokens[0, :4].tolist() == [2, 2, 2, 2]  # the guessed chain comes first


def test_budget_larger_than_tree_space_is_rejected() -> None:
    with pytest.raises(ValueError):
        build_tree(torch.randn(1, 2, 3), 13)  # 3 + 9 = 12 paths
    assert build_tree(torch.randn(1, 2, 3), 12).budget == 12
