"""Random tree-attention inputs shared by the GPU test and the benchmark (not a test module)."""

from __future__ import annotations

import torch

from ddserve.kernels.tree_attn import TreeAttnMeta


def ancestor_mask(q_len: int, gen: torch.Generator) -> torch.Tensor:
    """[q_len, q_len] ancestor-or-self mask of a random tree whose node 0 is the root."""
    vis = torch.eye(q_len, dtype=torch.bool)
    for i in range(1, q_len):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        vis[i] = vis[parent]
        vis[i, i] = True
    return vis


def random_meta(
    prefix_lens: list[int], q_lens: list[int], num_slots: int, seed: int = 0
) -> TreeAttnMeta:
    """Blocks laid end to end; every prefix and block token gets a distinct random cache slot."""
    gen = torch.Generator().manual_seed(seed)
    nb, p_max, q_max = len(q_lens), max(prefix_lens, default=0), max(q_lens, default=0)
    need = sum(prefix_lens) + sum(q_lens)
    assert need <= num_slots, (need, num_slots)
    perm = torch.randperm(num_slots, generator=gen)
    prefix_slots = torch.zeros(nb, p_max, dtype=torch.int64)
    mask = torch.zeros(nb, q_max, q_max, dtype=torch.bool)
    used = 0
    for b, (pl, ql) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        prefix_slots[b, :pl] = perm[used : used + pl]
        used += pl
        mask[b, :ql, :ql] = ancestor_mask(ql, gen)
    block_slots = perm[used : used + sum(q_lens)].clone()
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    return TreeAttnMeta(
        q_starts=torch.cumsum(q_lens_t, 0) - q_lens_t,
        q_lens=q_lens_t,
        prefix_slots=prefix_slots,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        block_slots=block_slots,
        block_mask=mask,
    )
