"""Inputs of the target forward: token ids, positions and attention metadata for a batch of blocks.

A block is one stream's new tokens in one forward: a prefill chunk (causal mask), one decode token,
or a DDTree verify block (root + `budget` nodes, ancestor-or-self mask). Keys of a block are the
stream's committed prefix slots plus the block's own freshly allocated slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddserve.ddtree.accept import accept
from ddserve.ddtree.tree import DraftTree, build_tree
from ddserve.kernels.tree_attn import TreeAttnMeta


def verify_inputs(
    tree: DraftTree, root_tokens: torch.Tensor, prefix_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened verify-block token ids and positions, [B * (N+1)] each.

    Row 0 of each block is the root (bonus token, position prefix_len); node i sits at
    prefix_len + depth(i).
    """
    b = root_tokens.shape[0]
    ids = torch.cat([root_tokens[:, None], tree.tokens], dim=1)  # [B, N+1]
    depth = torch.cat([tree.depths.new_zeros(b, 1), tree.depths], dim=1)  # [B, N+1]
    positions = prefix_lens[:, None] + depth  # [B, N+1]
    return ids.reshape(-1), positions.reshape(-1)


@dataclass(frozen=True)
class VerifyResult:
    """A verify step's outcome: what the host reads, and what `reselect` needs."""

    packed: torch.Tensor  # [B, 2 * (D' + 1) + 1] `Acceptance.packed`
    hidden: torch.Tensor | None  # [B, D' + 1, C] hidden states of the accepted rows
    tree: DraftTree
    logits: torch.Tensor  # [B, N+1, V] the target's logits at every verify row
    all_hidden: torch.Tensor | None  # [B, N+1, C] hidden states of every verify row


def verify_step(
    forward: Callable,  # (ids [T], positions [T], visible [B, N+1, N+1]) -> ModelOutput
    select: Callable[[torch.Tensor], torch.Tensor],  # logits [B, N+1, V] -> tokens [B, N+1]
    draft_logits: torch.Tensor,  # [B, D, V]
    bonus: torch.Tensor,  # [B] each stream's last committed token (the root)
    prefix_lens: torch.Tensor,  # [B]
    budget: int,
) -> VerifyResult:
    """Everything of a DDTree step between the draft and the host: tree build, verify inputs, the
    target forward over every block's budget + 1 rows, the target's token at each row, and the
    acceptance walk. Pure tensor code with shapes fixed by (B, D, V, budget): the engine runs it
    eagerly or captures it whole in one CUDA graph (`graphs.GraphedForward.run_verify`).
    D' is the tree's depth bound; rows of `hidden` past a block's accepted count are the
    root's; hidden states are None when the forward captures none."""
    tree = build_tree(draft_logits, budget)
    ids, pos = verify_inputs(tree, bonus, prefix_lens)  # [B * (N+1)] each
    out = forward(ids, pos, tree.visible)
    b = bonus.shape[0]
    logits = out.logits.view(b, budget + 1, -1)  # [B, N+1, V]
    all_hidden = None if out.hidden is None else out.hidden.view(b, budget + 1, -1)
    return _accepted(tree, logits, all_hidden, select)


def reselect(res: VerifyResult, select: Callable[[torch.Tensor], torch.Tensor]) -> VerifyResult:
    """The same verify step with other token choices (e.g. sampling where `res` was greedy):
    acceptance redone from `res`'s logits and tree, no forward."""
    return _accepted(res.tree, res.logits, res.all_hidden, select)


def _accepted(tree: DraftTree, logits, all_hidden, select) -> VerifyResult:
    acc = accept(tree, select(logits))
    hidden = None
    if all_hidden is not None:
        idx = acc.path[..., None].expand(-1, -1, all_hidden.shape[-1])  # [B, D'+1, C]
        hidden = all_hidden.gather(1, idx)
    return VerifyResult(acc.packed(), hidden, tree, logits, all_hidden)


def pad_slot_lists(slot_lists: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Host slot lists -> [B, max(len, 1)] int64 tensor, zero padded (padding is never read)."""
    width = max(1, max((len(s) for s in slot_lists), default=0))
    out = torch.zeros(len(slot_lists), width, dtype=torch.long)
    for i, s in enumerate(slot_lists):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


def block_meta(
    q_lens: list[int],
    prefix_slots: list[list[int]] | torch.Tensor,
    block_slots: list[list[int]],
    block_mask: torch.Tensor,
    device: torch.device | str,
    prefix_lens: list[int] | None = None,
) -> TreeAttnMeta:
    """TreeAttnMeta for B blocks laid end to end.

    q_lens[b] new tokens of block b, written at block_slots[b] (length q_lens[b]); the block sees
    all of prefix_slots[b] plus the block tokens allowed by block_mask [B, Q_max, Q_max].
    `prefix_slots` is host lists, or a padded [B, P] device tensor with `prefix_lens` given.
    """
    if not all(len(s) == q for s, q in zip(block_slots, q_lens, strict=True)):
        raise ValueError("each block needs exactly q_len slots")
    starts = [0]
    for q in q_lens[:-1]:
        starts.append(starts[-1] + q)
    flat = [s for slots in block_slots for s in slots]
    is_lists = not isinstance(prefix_slots, torch.Tensor)
    if is_lists:
        prefix_lens = [len(s) for s in prefix_slots]
    elif prefix_lens is None:
        raise ValueError("a prefix-slot tensor needs prefix_lens")
    return TreeAttnMeta(
        q_starts=torch.tensor(starts, dtype=torch.long, device=device),
        q_lens=torch.tensor(q_lens, dtype=torch.long, device=device),
        prefix_slots=pad_slot_lists(prefix_slots, device) if is_lists else prefix_slots,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.long, device=device),
        block_slots=torch.tensor(flat, dtype=torch.long, device=device),
        block_mask=block_mask.to(device),
    )


def causal_masks(q_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, Q_max, Q_max] causal block masks for prefill chunks of different lengths."""
    q_max = max(q_lens)
    tri = torch.ones(q_max, q_max, dtype=torch.bool, device=device).tril()
    return tri.expand(len(q_lens), q_max, q_max).clone()
