"""Acceptance walk against a plain-Python walk over the same tree."""

from __future__ import annotations

import random

import torch

from ddserve.ddtree.accept import accept
from ddserve.ddtree.tree import build_tree


def python_walk(tokens: list[int], parents: list[int], target: list[int]):
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents, strict=True)):
        children.setdefault(p, {})[t] = i + 1
    path, cur = [0], 0
    while target[cur] in children.get(cur, {}):
        cur = children[cur][target[cur]]
        path.append(cur)
    return path, [tokens[r - 1] for r in path[1:]] + [target[cur]]


def test_walk_matches_python_on_random_trees() -> None:
    rng = random.Random(0)
    for trial in range(60):
        b, d, v = 3, rng.randint(1, 6), rng.choice([5, 20, 100])
        budget = rng.randint(1, min(64, sum(v**i for i in range(1, d + 1))))
        tree = build_tree(
            torch.randn(b, d, v, generator=torch.Generator().manual_seed(trial)), budget
        )
        # Targets that often follow the tree, so long paths occur.
        target = torch.randint(0, v, (b, budget + 1))
        for bb in range(b):
            for r in range(budget + 1):
                kids = [i for i in range(budget) if tree.parents[bb, i] == r]
                if kids and rng.random() < 0.8:
                    target[bb, r] = tree.tokens[bb, rng.choice(kids)]
        acc = accept(tree, target)
        for bb in range(b):
            path, toks = python_walk(
                tree.tokens[bb].tolist(), tree.parents[bb].tolist(), target[bb].tolist()
            )
            n = int(acc.num_accepted[bb])
            assert n == len(path)
            assert acc.path[bb, :n].tolist() == path
            assert acc.path[bb, n:].eq(0).all()
            assert acc.tokens[bb, :n].tolist() == toks
            assert int(acc.bonus[bb]) == toks[-1]


def test_no_match_commits_only_the_root_targets_token() -> None:
    logits = torch.zeros(1, 3, 8)
    logits[0, :, 1] = 9.0
    tree = build_tree(logits, 3)  # chain 1 -> 1 -> 1
    acc = accept(tree, torch.tensor([[5, 1, 1, 1]]))
    assert acc.num_accepted.tolist() == [1] and acc.tokens[0, 0] == 5
    acc = accept(tree, torch.tensor([[1, 1, 1, 7]]))
    assert acc.num_accepted.tolist() == [4]
    assert acc.tokens[0].tolist() == [1, 1, 1, 7] and acc.path[0].tolist() == [0, 1, 2, 3]
