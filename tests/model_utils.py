"""Helpers for model tests: attention metadata for prefill / decode / tree blocks, comparisons."""

from __future__ import annotations

import torch

from ddserve.kernels.tree_attn import TreeAttnMeta


def make_meta(blocks: list[tuple[list[int], list[int], torch.Tensor | None]]) -> TreeAttnMeta:
    """blocks: (prefix_slots, block_slots, block_mask [Q, Q] or None for causal), end to end."""
    q_lens = [len(b[1]) for b in blocks]
    q_max, p_max = max(q_lens), max(1, max(len(b[0]) for b in blocks))
    prefix = torch.zeros(len(blocks), p_max, dtype=torch.int64)
    masks = torch.zeros(len(blocks), q_max, q_max, dtype=torch.bool)
    for i, (pre, slots, mask) in enumerate(blocks):
        prefix[i, : len(pre)] = torch.tensor(pre, dtype=torch.int64)
        q = len(slots)
        masks[i, :q, :q] = torch.ones(q, q, dtype=torch.bool).tril() if mask is None else mask
    starts = torch.tensor([0, *q_lens[:-1]], dtype=torch.int64).cumsum(0)
    return TreeAttnMeta(
        q_starts=starts,
        q_lens=torch.tensor(q_lens, dtype=torch.int64),
        prefix_slots=prefix,
        prefix_lens=torch.tensor([len(b[0]) for b in blocks], dtype=torch.int64),
        block_slots=torch.tensor([s for b in blocks for s in b[1]], dtype=torch.int64),
        block_mask=masks,
    )


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def prefill(model, cache, prompts: list[list[int]], absorbed: bool = True, stride: int = 1):
    """Run prompts as one batch of causal blocks at positions 0, stride, 2 * stride, ...; prompt i
    uses cache slots [i * 1000, ...). Returns (logits [T, V], slot lists per prompt)."""
    slots = [list(range(i * 1000, i * 1000 + len(p))) for i, p in enumerate(prompts)]
    meta = make_meta([([], s, None) for s in slots])
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([j * stride for p in prompts for j in range(len(p))])
    return model(ids, pos, cache, meta, absorbed=absorbed).logits, slots


def greedy(model, prompts: list[list[int]], steps: int, absorbed_prefill: bool = False):
    """Greedy decoding of a batch over the latent cache: prefill, then one token per step."""
    cache = model.new_kv_cache(1000 * len(prompts))
    logits, slots = prefill(model, cache, prompts, absorbed=absorbed_prefill)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    nxt = logits[ends].argmax(-1).tolist()
    outs = [[t] for t in nxt]
    for _ in range(steps - 1):
        new = [s[-1] + 1 for s in slots]
        meta = make_meta([(s, [n], None) for s, n in zip(slots, new, strict=True)])
        pos = torch.tensor([len(s) for s in slots])
        logits = model(torch.tensor(nxt), pos, cache, meta).logits
        nxt = logits.argmax(-1).tolist()
        for o, t, s, n in zip(outs, nxt, slots, new, strict=True):
            o.append(t)
            s.append(n)
    return outs
