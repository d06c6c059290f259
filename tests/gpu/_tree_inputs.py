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
    prefix_slots = torch.zeros(nb, max(p_max, 1), dtype=torch.int64)
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


def ar_meta(meta: TreeAttnMeta) -> TreeAttnMeta:
    """The AR decode twin of every row: one q_len-1 block per row of `meta` (same row order), whose
    prefix is the row's prefix slots then the slots of its visible block tokens before itself (its
    path root..parent), and whose one block token is the row's own slot. Same keys, same order."""
    prefixes, own = [], []
    rows = zip(meta.q_starts.tolist(), meta.q_lens.tolist(), meta.prefix_lens.tolist(), strict=True)
    for b, (q0, ql, pl) in enumerate(rows):
        pre = meta.prefix_slots[b, :pl].tolist()
        for j in range(ql):
            path = [int(meta.block_slots[q0 + i]) for i in range(j) if meta.block_mask[b, j, i]]
            prefixes.append(pre + path)
            own.append(int(meta.block_slots[q0 + j]))
    n, p_max = len(own), max((len(p) for p in prefixes), default=0)
    prefix_slots = torch.zeros(n, max(p_max, 1), dtype=torch.int64)
    for i, p in enumerate(prefixes):
        prefix_slots[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
    return TreeAttnMeta(
        q_starts=torch.arange(n, dtype=torch.int64),
        q_lens=torch.ones(n, dtype=torch.int64),
        prefix_slots=prefix_slots,
        prefix_lens=torch.tensor([len(p) for p in prefixes], dtype=torch.int64),
        block_slots=torch.tensor(own, dtype=torch.int64),
        block_mask=torch.ones(n, 1, 1, dtype=torch.bool),
    )


def select_blocks(meta: TreeAttnMeta, blocks: list[int]) -> tuple[TreeAttnMeta, torch.Tensor]:
    """Meta of the chosen blocks alone (tensors trimmed to their sizes) and the indices of their
    rows in the original row order, to slice the queries with."""
    q_lens = meta.q_lens[blocks]
    rows = torch.cat([torch.arange(int(meta.q_starts[b]), int(meta.q_starts[b] + meta.q_lens[b]))
                      for b in blocks])  # fmt: skip
    p_max, q_max = max(1, int(meta.prefix_lens[blocks].max())), int(q_lens.max())
    return TreeAttnMeta(
        q_starts=torch.cumsum(q_lens, 0) - q_lens,
        q_lens=q_lens,
        prefix_slots=meta.prefix_slots[blocks, :p_max].clone(),
        prefix_lens=meta.prefix_lens[blocks],
        block_slots=meta.block_slots[rows],
        block_mask=meta.block_mask[blocks, :q_max, :q_max].clone(),
    ), rows
