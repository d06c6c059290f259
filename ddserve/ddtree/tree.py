"""Batched best-first draft-tree builder (DDTree).

The paper's builder pops a max-heap on the summed draft log-prob of a path, seeded with
(depth 1, rank 0); each pop adds a node and pushes its next sibling and its first child. Because a
path never scores above its prefix and rank r+1 never above rank r, the pops come out in
non-increasing score order: the tree is the `budget` most probable prefixes, in descending score
order. This file computes that set directly with fixed shapes and no host sync:

0. per depth, the top-K draft tokens and their log-probs (`top_draft_tokens`: a fused Triton
   kernel on CUDA, `kernels/draft_topk.py`; torch's log_softmax + topk elsewhere);
1. per depth d, a beam of the `budget` best depth-d paths, taken among the children of the
   depth-(d-1) beam (a top-`budget` path's prefix is itself a top-`budget` path);
2. a stable descending sort of all D * budget beam entries, keep the first `budget`.

Ties are broken by depth (shallower first), then by position in the depth's beam (parent's
position, then the child's draft rank), so parents always precede their children.
Steps 1-2 (`tree_from_topk`) are one fused Triton kernel on CUDA (`kernels/tree_beam.py`: the
paper's best-first pops, the same tensors bit for bit); `tree_from_topk_torch` is the torch code
(the CPU path and the kernel's reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddserve.kernels import backend

# Log-probs are clamped here so that padding (-inf) always sorts after every real path.
MIN_LOGPROB = -1.0e4


@dataclass(frozen=True)
class DraftTree:
    """`budget` draft nodes per stream. Node i (0-based) is row i + 1 of the verify block; row 0
    is the root (the stream's bonus token, not part of the tree tensors)."""

    tokens: torch.Tensor  # [B, N] int64 draft token of each node
    parents: torch.Tensor  # [B, N] int64 verify row of the parent (0 = root)
    depths: torch.Tensor  # [B, N] int64 in 1..max_depth
    visible: torch.Tensor  # [B, N+1, N+1] bool: row j sees row i iff i is j or an ancestor of j
    scores: torch.Tensor  # [B, N] float32 summed draft log-prob of the node's path
    max_depth: int  # static bound on depths: min(D, budget)

    @property
    def budget(self) -> int:
        return int(self.tokens.shape[1])


def max_tree_nodes(depth: int, k: int, cap: int) -> int:
    """Number of distinct paths of length 1..depth over k ranks, stopping once it exceeds cap."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total > cap:
            break
    return total


def build_tree(draft_logits: torch.Tensor, budget: int, topk: int | None = None) -> DraftTree:
    """The `budget` most probable draft prefixes per stream.

    draft_logits: [B, D, V] per-depth drafter logits (depth 1..D). Each depth contributes its
    top-K tokens, K = min(budget, V, topk or budget) (`top_draft_tokens`). Raises ValueError when
    fewer than `budget` distinct paths exist (sum_d K^d < budget); the check uses shapes only.
    """
    _, d, v = draft_logits.shape
    k = min(budget, v, topk or budget)
    _check_budget(budget, d, k)
    return tree_from_topk(*top_draft_tokens(draft_logits, k), budget)


def _check_budget(budget: int, d: int, k: int) -> None:
    if budget < 1 or d < 1:
        raise ValueError(f"need budget >= 1 and depth >= 1, got budget={budget}, depth={d}")
    if max_tree_nodes(d, k, budget) < budget:
        raise ValueError(
            f"budget {budget} exceeds the {max_tree_nodes(d, k, budget)} paths of D={d}, K={k}"
        )


def top_draft_tokens(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each depth's k most probable draft tokens: (log-probs [B, D, k] float32 clamped at
    MIN_LOGPROB, sorted descending; tokens [B, D, k] int64). On CUDA the fused Triton kernel
    (`kernels.draft_topk`: ties to the lower token, deterministic) where it takes the shape,
    else `log_softmax_topk`; the two agree up to the log-probs' last bits and the order of
    (near-)ties."""
    fused = backend.draft_topk(draft_logits, k, MIN_LOGPROB)
    return fused if fused is not None else log_softmax_topk(draft_logits, k)


def log_softmax_topk(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_draft_tokens` in torch ops (the CPU path; torch orders ties as it likes)."""
    logp = draft_logits.float().log_softmax(dim=-1).clamp_min(MIN_LOGPROB)  # [B, D, V]
    return logp.topk(k, dim=-1)  # [B, D, K] each, sorted descending


def tree_from_topk(top_lp: torch.Tensor, top_tok: torch.Tensor, budget: int) -> DraftTree:
    """`build_tree` from each depth's top-K: top_lp [B, D, K] float32 log-probs sorted descending
    per depth, clamped at MIN_LOGPROB (so in [MIN_LOGPROB, 0]: `top_draft_tokens`' outputs),
    top_tok [B, D, K] int64. On CUDA the fused kernel (`kernels.tree_beam`) where it takes the
    shape, which equals `tree_from_topk_torch` bit for bit on such inputs (not on others, e.g.
    unsorted or positive log-probs); else `tree_from_topk_torch`."""
    _, d, k = top_lp.shape
    _check_budget(budget, d, k)
    fused = backend.tree_beam(top_lp, top_tok, budget)
    if fused is None:
        return tree_from_topk_torch(top_lp, top_tok, budget)
    return DraftTree(*fused, max_depth=min(d, budget))


def tree_from_topk_torch(top_lp: torch.Tensor, top_tok: torch.Tensor, budget: int) -> DraftTree:
    """`tree_from_topk` in torch ops: the beam of steps 1-2 (any device)."""
    b, d, k = top_lp.shape
    _check_budget(budget, d, k)
    dev = top_lp.device
    w, depth_used = budget, min(d, budget)

    # Depth 1: the top-K tokens themselves, padded to the beam width.
    beam_score = torch.full((b, w), float("-inf"), device=dev)  # [B, W]
    beam_score[:, :k] = top_lp[:, 0]
    beam_tok = torch.zeros(b, w, dtype=torch.long, device=dev)  # [B, W]
    beam_tok[:, :k] = top_tok[:, 0]
    scores, toks, pars = [beam_score], [beam_tok], [torch.zeros_like(beam_tok)]
    for depth in range(1, depth_used):
        cand = beam_score[:, :, None] + top_lp[:, depth, None, :]  # [B, W, K]
        beam_score, idx = cand.reshape(b, w * k).sort(dim=1, descending=True, stable=True)
        beam_score, idx = beam_score[:, :w], idx[:, :w]  # [B, W]
        beam_tok = top_tok[:, depth].gather(1, idx % k)  # [B, W]
        scores.append(beam_score)
        toks.append(beam_tok)
        pars.append(idx // k)

    all_scores = torch.stack(scores, dim=1).reshape(b, depth_used * w)  # [B, D'*W] depth-major
    node_score, sel = all_scores.sort(dim=1, descending=True, stable=True)
    node_score, sel = node_score[:, :budget], sel[:, :budget]  # [B, N]
    depths = sel // w + 1  # [B, N]
    tokens = torch.stack(toks, dim=1).reshape(b, -1).gather(1, sel)  # [B, N]
    beam_parent = torch.stack(pars, dim=1).reshape(b, -1).gather(1, sel)  # [B, N]
    parent_flat = ((depths - 2) * w + beam_parent).clamp_min(0)  # [B, N] flat index at depth-1
    row_of = torch.zeros(b, depth_used * w, dtype=torch.long, device=dev)
    rows = torch.arange(1, budget + 1, device=dev).expand(b, budget)  # [B, N]
    row_of.scatter_(1, sel, rows)
    parents = torch.where(depths >= 2, row_of.gather(1, parent_flat), 0)  # [B, N]
    visible = ancestor_mask(parents, depth_used)
    return DraftTree(tokens, parents, depths, visible, node_score, depth_used)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N] parent rows -> [B, N+1, N+1] ancestor-or-self visibility (row 0 = root)."""
    b, n = parents.shape
    parent_full = torch.cat([parents.new_zeros(b, 1), parents], dim=1)  # [B, N+1], root -> root
    cur = torch.arange(n + 1, device=parents.device).expand(b, n + 1)  # [B, N+1]
    visible = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=parents.device)
    for _ in range(max_depth + 1):
        visible.scatter_(2, cur[..., None], True)
        cur = parent_full.gather(1, cur)
    return visible
