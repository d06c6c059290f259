"""Multi-head latent attention over the slot-indexed latent cache.

Per token and layer the cache holds only [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)].
kv_b_proj's rows per head are [W_UK (qk_nope rows) ; W_UV (v_head rows)], each [., kv_lora_rank].

The latent path (kv_a_layernorm, RoPE of k_pe and of the query, the cache write) is one
`backend.mla_rope_cache` call after q_b_proj (one fused launch on CUDA in batch-invariant mode).
Where `backend.fuses_mla_latent` holds (and `MLA.latent_fusion`, on by default), it is split
around q_b_proj instead: `backend.mla_latent` right after the down projections (q_a_layernorm
and the latent path's cache side, one launch) and `backend.linear_rope` (q_b_proj with the
query's RoPE in the matmul's epilogue), so q_a_layernorm takes no launch of its own; q_pe is
then a strided view of q. Both ways give the same bits.

- absorbed (decode / verify / any chunk): q_latent = q_nope W_UK, attention in latent space by
  `backend.tree_attention`, then W_UV after attention; the per-head matmuls are
  `backend.bmm_heads` (batch-invariant when that mode is on; every decode/verify op must be).
- expanded (prefill): keys and values re-expanded from the cached latents with kv_b_proj, as HF
  does. Both forms write the new tokens' latents first and then read every key from the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from ddserve.config import ModelConfig
from ddserve.distributed import Communicator
from ddserve.kernels import backend
from ddserve.kernels.tree_attn import TreeAttnMeta
from ddserve.model.layers import (
    ColumnParallelLinear,
    Linear,
    RMSNorm,
    RowParallelLinear,
    shard_size,
)
from ddserve.stacked import share_rows, stacked_rows

LORA_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the default eps


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype, device):
        super().__init__()
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        self.n_local = shard_size(heads, comm.world_size, "num_attention_heads")
        self.nope, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.rank, self.scale = cfg.kv_lora_rank, cfg.softmax_scale
        self.interleave = cfg.rope_interleave
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d, heads * cfg.qk_head_dim, comm, dtype, device)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype, device)
            q_out = heads * cfg.qk_head_dim
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, q_out, comm, dtype, device)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_latent_dim, dtype, device)
        if cfg.q_lora_rank is not None:  # one [q_lora + R + P, D] buffer: one matmul on CUDA
            share_rows(self.q_a_proj, self.kv_a_proj_with_mqa)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS, dtype, device)
        kv_b_out = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, kv_b_out, comm, dtype, device)
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, d, comm, dtype, device)
        # the latent path split around q_b_proj where the backend fuses it (module docstring);
        # False always takes `mla_rope_cache` (tests compare the two)
        self.latent_fusion = True

    def _down_projections(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(q_a_proj(x) [T, q_lora] or None without a q LoRA, kv_a_proj_with_mqa(x) [T, R + P]).
        On the CUDA batch-invariant path with both weights in one buffer (as built): one matmul,
        the two outputs column slices of it (strided rows, which the norms and the latent
        kernel read as such). Elsewhere two matmuls (the CPU reference)."""
        kv_a = self.kv_a_proj_with_mqa
        if hasattr(self, "q_proj"):
            return None, kv_a(x)
        merged = None
        if backend.batch_invariant() and x.device.type == "cuda":
            merged = stacked_rows(self.q_a_proj.weight, kv_a.weight)
        if merged is None:
            return self.q_a_proj(x), kv_a(x)
        both = backend.linear(x, merged)  # [T, q_lora + R + P]
        n_q = self.q_a_proj.weight.shape[0]
        return both[:, :n_q], both[:, n_q:]

    def _query(self, x: torch.Tensor, q_a: torch.Tensor | None) -> torch.Tensor:
        """[T, D] -> [T, H_local, qk_head_dim] (q_a: q_a_proj(x) when there is a q LoRA)."""
        q = self.q_proj(x) if q_a is None else self.q_b_proj(self.q_a_layernorm(q_a))
        return q.view(x.shape[0], self.n_local, -1)

    def _fuses_latent(self, q_a: torch.Tensor | None, kv_cache: torch.Tensor) -> bool:
        if not self.latent_fusion or q_a is None:
            return False
        return backend.fuses_mla_latent(
            q_a, kv_cache, self.q_b_proj.weight, self.nope, self.rope_dim
        )

    def _query_rope(self, q_n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_b_proj(q_n) [T, H, nope + P] from the normed q_a [T, q_lora], each head's rope part
        rotated in the matmul's epilogue."""
        q = backend.linear_rope(q_n, self.q_b_proj.weight, cos, sin, self.nope, self.interleave)
        return q.view(q_n.shape[0], self.n_local, -1)

    def _query_and_latent(
        self, x: torch.Tensor, q_a: torch.Tensor | None, kv: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(q [T, H, nope + P], q_pe [T, H, P]: q's rope parts rotated); writes kv_cache[slots]
        = [kv_a_layernorm(c_kv) | rope(k_pe)]. Split around q_b_proj where the backend fuses that
        (module docstring; q's own rope parts rotated and q_pe a strided view of them), else
        `mla_rope_cache` after it."""
        if self._fuses_latent(q_a, kv_cache):
            qn, kvn = self.q_a_layernorm, self.kv_a_layernorm
            q_n = backend.mla_latent(
                q_a, qn.weight, qn.eps, kv, kvn.weight, kvn.eps, cos, sin, kv_cache, slots,
                self.interleave,
            )  # fmt: skip
            q = self._query_rope(q_n, cos, sin)  # [T, H, nope + P]
            return q, q[..., self.nope :]
        q = self._query(x, q_a)  # [T, H, nope + P]
        norm = self.kv_a_layernorm
        q_pe = backend.mla_rope_cache(
            q, kv, norm.weight, norm.eps, cos, sin, kv_cache, slots, self.interleave
        )  # [T, H, P] contiguous
        return q, q_pe

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.n_local, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]  # [H, nope, R], [H, v, R]

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        cos: torch.Tensor,  # [T, P]
        sin: torch.Tensor,  # [T, P]
        kv_cache: torch.Tensor,  # [S, R + P] this layer's latent pool
        meta: TreeAttnMeta,
        absorbed: bool = True,
    ) -> torch.Tensor:  # [T, D] (all-reduced)
        q_a, kv = self._down_projections(x)  # kv [T, R + P] = [c_kv | k_pe]
        q, q_pe = self._query_and_latent(x, q_a, kv, cos, sin, kv_cache, meta.block_slots)
        q_nope = q[..., : self.nope]  # [T, H, nope]
        w_uk, w_uv = self._w_uk_uv()
        if absorbed:
            q_lat = backend.bmm_heads(q_nope, w_uk)  # [T, H, R]
            attend = backend.tree_attention(backend.device_type(x))
            o_lat = attend(q_lat, q_pe, kv_cache, meta, self.scale)  # [T, H, R]
            out = backend.bmm_heads(o_lat.to(w_uv.dtype), w_uv.transpose(1, 2))  # [T, H, v]
        else:
            out = expanded_attention(q_nope, q_pe, kv_cache, meta, w_uk, w_uv, self.scale)
        return self.o_proj(out.flatten(1))


def block_visibility(meta: TreeAttnMeta, b: int, device) -> torch.Tensor:
    """[Q, P + Q] bool: block b's rows see all prefix slots and their block_mask tokens."""
    ql, pl = int(meta.q_lens[b]), int(meta.prefix_lens[b])
    visible = torch.ones(ql, pl + ql, dtype=torch.bool, device=device)
    visible[:, pl:] = meta.block_mask[b, :ql, :ql]
    return visible


def expanded_attention(
    q_nope: torch.Tensor,  # [T, H, nope]
    q_pe: torch.Tensor,  # [T, H, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    meta: TreeAttnMeta,
    w_uk: torch.Tensor,  # [H, nope, R]
    w_uv: torch.Tensor,  # [H, v, R]
    scale: float,
) -> torch.Tensor:  # [T, H, v]
    """Plain multi-head attention with keys/values expanded from the cached latents."""
    rank = w_uk.shape[-1]
    out = q_nope.new_zeros(*q_nope.shape[:2], w_uv.shape[1])
    for b in range(meta.num_blocks):
        q0, ql, pl = int(meta.q_starts[b]), int(meta.q_lens[b]), int(meta.prefix_lens[b])
        if ql == 0:
            continue
        slots = torch.cat([meta.prefix_slots[b, :pl], meta.block_slots[q0 : q0 + ql]])  # [K]
        lat = kv_cache[slots].to(q_nope.dtype)  # [K, R + P]
        c_kv, k_pe = lat[:, :rank], lat[:, rank:]
        k_nope = torch.einsum("kr,hnr->khn", c_kv, w_uk)  # [K, H, nope]
        v = torch.einsum("kr,hvr->khv", c_kv, w_uv)  # [K, H, v]
        qn, qp = q_nope[q0 : q0 + ql], q_pe[q0 : q0 + ql]
        scores = torch.einsum("qhn,khn->hqk", qn, k_nope) + torch.einsum("qhp,kp->hqk", qp, k_pe)
        scores = scores.float() * scale
        scores = scores.masked_fill(~block_visibility(meta, b, scores.device), float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype)  # [H, Q, K]
        out[q0 : q0 + ql] = torch.einsum("hqk,khv->qhv", probs, v)
    return out
