"""Tree-verify MLA attention in the absorbed form over the slot-indexed latent cache.

One call serves prefill chunks (causal block mask), plain decode (q_len = 1) and DDTree verify
(ancestor-or-self block mask). This file holds the metadata type and the plain-torch reference
that defines the semantics; faster implementations must match `tree_mla_attention_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeAttnMeta:
    """Which latent-cache slots each query row attends to.

    The T query rows are B blocks laid end to end, block b at rows
    q_starts[b] : q_starts[b] + q_lens[b].
    Keys of block b: its prefix slots prefix_slots[b, :prefix_lens[b]] (all visible to every row of
    the block), then the block's own tokens, whose latents are (already) written at
    block_slots[q_starts[b] : q_starts[b] + q_lens[b]]; row j of the block sees block token i iff
    block_mask[b, j, i]. Every row must see at least itself (block_mask[b, j, j] is True).
    Padding entries of prefix_slots / block_mask beyond the lengths are ignored.
    """

    q_starts: torch.Tensor  # [B] int64
    q_lens: torch.Tensor  # [B] int64
    prefix_slots: torch.Tensor  # [B, P_max] int64
    prefix_lens: torch.Tensor  # [B] int64
    block_slots: torch.Tensor  # [T] int64
    block_mask: torch.Tensor  # [B, Q_max, Q_max] bool

    @property
    def num_blocks(self) -> int:
        return int(self.q_lens.shape[0])

    def to(self, device: torch.device | str) -> TreeAttnMeta:
        return TreeAttnMeta(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def causal_mask(q_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Block mask of a prefill chunk: row j sees block tokens 0..j."""
    return torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()


def tree_mla_attention_ref(
    q_latent: torch.Tensor,  # [T, H, R]  query already multiplied by W_UK (absorbed)
    q_rope: torch.Tensor,  # [T, H, P]
    kv_cache: torch.Tensor,  # [S, R + P] this layer's latent pool: [c_kv | k_rope]
    meta: TreeAttnMeta,
    softmax_scale: float,
) -> torch.Tensor:  # [T, H, R] attention output in latent space (before W_UV)
    """Plain-torch reference: gathers each block's keys, masks, softmax in fp32."""
    r = q_latent.shape[-1]
    out = torch.zeros_like(q_latent)
    rows = zip(meta.q_starts.tolist(), meta.q_lens.tolist(), meta.prefix_lens.tolist(), strict=True)
    for b, (q0, ql, pl) in enumerate(rows):
        if ql == 0:
            continue
        slots = torch.cat([meta.prefix_slots[b, :pl], meta.block_slots[q0 : q0 + ql]])  # [K]
        keys = kv_cache[slots].float()  # [K, R+P]
        c_kv, k_rope = keys[:, :r], keys[:, r:]
        ql_ = q_latent[q0 : q0 + ql].float()  # [Q, H, R]
        qr_ = q_rope[q0 : q0 + ql].float()  # [Q, H, P]
        scores = torch.einsum("qhr,kr->hqk", ql_, c_kv) + torch.einsum("qhp,kp->hqk", qr_, k_rope)
        visible = torch.ones(ql, pl + ql, dtype=torch.bool, device=scores.device)
        visible[:, pl:] = meta.block_mask[b, :ql, :ql]
        scores = (scores * softmax_scale).masked_fill(~visible, float("-inf"))
        probs = scores.softmax(dim=-1)  # [H, Q, K]
        out[q0 : q0 + ql] = torch.einsum("hqk,kr->qhr", probs, c_kv).to(out.dtype)
    return out
