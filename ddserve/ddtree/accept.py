"""Acceptance walk: follow the target's token from the root down the tree.

At every verify row the target has chosen a token (argmax, or an exact sample). Starting at the
root, move into the child whose draft token equals the current row's target token while one exists.
The committed tokens are the accepted nodes' draft tokens followed by the target token at the last
accepted row (the new bonus). Each committed token is an exact target choice, so this is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddserve.ddtree.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """Per stream: rows kept (root first), how many, and the tokens to commit.

    path[b, :num_accepted[b]] are verify rows (0 = root) whose KV is kept; the rest of the row is 0.
    tokens[b, :num_accepted[b]] are the committed tokens: accepted draft tokens, then the bonus.
    """

    path: torch.Tensor  # [B, max_depth+1] int64
    num_accepted: torch.Tensor  # [B] int64 in 1..max_depth+1 (root included)
    tokens: torch.Tensor  # [B, max_depth+1] int64
    bonus: torch.Tensor  # [B] int64

    def packed(self) -> torch.Tensor:
        """[B, 2*(max_depth+1) + 1] so the host can fetch everything with one copy."""
        return torch.cat([self.num_accepted[:, None], self.path, self.tokens], dim=1)


def accept(tree: DraftTree, target_tokens: torch.Tensor) -> Acceptance:
    """target_tokens: [B, N+1] the target's token at each verify row (row 0 = root)."""
    b, n = tree.tokens.shape
    rows = torch.arange(n + 1, device=tree.tokens.device)  # [N+1]
    # child[b, i, j]: node j (row j+1) is a child of row i carrying row i's target token.
    child = (tree.parents[:, None, :] == rows[None, :, None]) & (
        tree.tokens[:, None, :] == target_tokens[:, :, None]
    )  # [B, N+1, N]
    has_next = child.any(dim=-1)  # [B, N+1]
    next_row = child.to(torch.int8).argmax(dim=-1) + 1  # [B, N+1] (children carry distinct tokens)

    cur = torch.zeros(b, dtype=torch.long, device=rows.device)  # [B]
    alive = torch.ones(b, dtype=torch.bool, device=rows.device)  # [B]
    path = [cur]
    for _ in range(tree.max_depth):
        alive = alive & has_next.gather(1, cur[:, None])[:, 0]
        cur = torch.where(alive, next_row.gather(1, cur[:, None])[:, 0], cur)
        path.append(torch.where(alive, cur, 0))
    path_t = torch.stack(path, dim=1)  # [B, max_depth+1]
    num = 1 + (path_t[:, 1:] > 0).sum(dim=1)  # [B]
    bonus = target_tokens.gather(1, cur[:, None])[:, 0]  # [B]

    row_tokens = torch.cat([target_tokens.new_zeros(b, 1), tree.tokens], dim=1)  # [B, N+1]
    drafted = row_tokens.gather(1, path_t)[:, 1:]  # [B, max_depth] accepted draft tokens, 0 after
    tokens = torch.cat([drafted, drafted.new_zeros(b, 1)], dim=1)  # [B, max_depth+1]
    tokens.scatter_(1, (num - 1)[:, None], bonus[:, None])
    return Acceptance(path_t, num, tokens, bonus)
