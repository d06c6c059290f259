"""Qwen3-style DFlash decoder layer: pre-RMSNorm, GQA with per-head q/k norm, RoPE, SwiGLU.

The one DFlash twist: every layer also projects the shared *context* (the drafter's projection of
the target's hidden states) with its own k_proj/v_proj (+ k_norm, + RoPE at the context tokens'
positions) into extra keys/values. The context gets no input_layernorm and never passes through
the layers; only the block does. The block's queries attend non-causally to [context; block].
Parameter names match published DFlash checkpoints (`layers.N.self_attn.q_proj.weight`, ...).

Tensor parallelism (`comm.world_size` W > 1): each rank holds 1/W of the query and KV heads
(contiguous, so a rank's query heads use its own KV heads) and of the MLP's intermediate
features; q/k/v/gate/up are split by output rows, o/down by input columns and their partial
outputs summed with one all-reduce each. Every rank ends each sublayer with the same sum. The
all-reduce is the plain one, also in the batch-invariant mode: NCCL's ring and tree algorithms
leave every rank the same bits (each sum is taken once, then copied), which is all the drafter
needs (each rank builds the same tree); those bits may follow the message size, which changes
drafts, never outputs (DDTree == AR for any drafter), where the target's rank-ordered sum would
all-gather W times the bytes, 13 times a draft.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddserve.distributed import Communicator, LocalComm
from ddserve.drafter.cache import RingRows
from ddserve.drafter.config import SLIDING, DrafterConfig
from ddserve.drafter.rope import apply_rope
from ddserve.kernels import backend
from ddserve.stacked import stacked_rows

Ctx = Tensor | RingRows  # a layer's context keys or values, gathered or in the ring

# Which dimension of each projection's weight a rank holds 1/W of (the checkpoint's full tensor
# is cut there when loaded): output rows for the column-parallel ones, input columns for the
# row-parallel ones, whose outputs are all-reduced.
SHARD_DIM = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
    "o_proj": 1, "down_proj": 1, "fc": 1,
}  # fmt: skip


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, cast back, then scale (the target's order of
    operations, so `backend.rms_norm`: one Triton launch where the engine's batch-invariant
    mode is on, on CUDA, instead of ~7 torch kernels)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return backend.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, comm: Communicator):
        super().__init__()
        self.comm = comm
        inter //= comm.world_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj.weight, self.up_proj.weight
        trains = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
        w = None if trains else stacked_rows(gate, up)  # after `DFlashModel.stack`
        if w is None:
            return self.comm.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
        # gate and up as one matmul; SiLU-times-up by the target's op (`backend.silu_mul`)
        return self.comm.all_reduce(self.down_proj(backend.silu_mul(F.linear(x, w))))


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, comm: Communicator):
        super().__init__()
        h, d, w = cfg.hidden_size, cfg.head_dim, comm.world_size
        self.comm = comm
        self.n_heads, self.n_kv = cfg.num_attention_heads // w, cfg.num_key_value_heads // w
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., T, H] -> k (normed, rotated), v: [..., T, KVH, Dh]; for context and block."""
        shape = (*x.shape[:-1], self.n_kv, self.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)  # [..., T, KVH, Dh]
        return k, self.v_proj(x).view(shape)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Ctx, ctx_v: Ctx, visible: Tensor
    ) -> Tensor:
        """x [B, Q, H]; cos/sin [B, Q, Dh]; ctx_k/ctx_v [B, C, KVH, Dh] gathered, or the
        layer's rings and the streams' rows (`RingRows`, inference on CUDA: read in place by
        `backend.ring_attention`, gathered here where it cannot); visible [B, Q, C+Q]."""
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin)  # [B, Q, NH, Dh]
        k_blk, v_blk = self.kv(x, cos, sin)  # [B, Q, KVH, Dh]
        if isinstance(ctx_k, RingRows):
            out = backend.ring_attention(q, ctx_k.ring, ctx_v.ring, ctx_k.rows, k_blk, v_blk,
                                         visible, ctx_k.lengths)  # fmt: skip
            if out is not None:
                return self.comm.all_reduce(self.o_proj(out))
            ctx_k, ctx_v = (c.ring.index_select(0, c.rows) for c in (ctx_k, ctx_v))
        k = torch.cat((ctx_k, k_blk), dim=1).transpose(1, 2)  # [B, KVH, C+Q, Dh]
        v = torch.cat((ctx_v, v_blk), dim=1).transpose(1, 2)  # [B, KVH, C+Q, Dh]
        if torch.is_grad_enabled():  # training: SDPA's fused kernels keep no [.., Q, K] scores
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=visible[:, None], enable_gqa=True
            )  # [B, NH, Q, Dh]; default scale is Dh^-0.5
            out = out.transpose(1, 2).reshape(b, q_len, -1)
        else:
            out = grouped_attention(q, k, v, visible)  # [B, Q, NH * Dh]
        return self.comm.all_reduce(self.o_proj(out))


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """Softmax attention of q [B, Q, NH, Dh] over k, v [B, KVH, K, Dh] where visible [B, Q, K],
    query head h reading KV head h // (NH / KVH), scale Dh^-0.5 -> [B, Q, NH * Dh]. A KV head's
    query heads go through one matmul as G * Q rows; scores and softmax in float32. The
    inference path over gathered rows (the CPU's; on CUDA the ring is read in place by
    `backend.ring_attention` unless its kernel cannot take the shapes): explicit matmuls rather
    than SDPA, whose masked cuDNN kernel took ~100 us per call at the K2.5 drafter's tp = 8
    block shapes on an H200, these few launches ~12 us. Training keeps SDPA (its fused kernels
    store no score matrix)."""
    b, q_len, nh, d = q.shape
    kvh = k.shape[1]
    g = nh // kvh
    qg = q.transpose(1, 2).reshape(b, kvh, g * q_len, d).float() * d**-0.5  # [B, KVH, G*Q, Dh]
    scores = torch.matmul(qg, k.float().transpose(-1, -2))  # [B, KVH, G*Q, K]
    scores = scores.view(b, kvh, g, q_len, -1).masked_fill(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(b, kvh, g * q_len, -1)
    out = torch.matmul(probs, v)  # [B, KVH, G*Q, Dh]
    return out.view(b, nh, q_len, d).transpose(1, 2).reshape(b, q_len, nh * d)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int, comm: Communicator | None = None):
        super().__init__()
        comm = comm or LocalComm()
        self.sliding = cfg.layer_types[index] == SLIDING
        self.self_attn = DFlashAttention(cfg, comm)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's extra keys/values for context rows ctx [T, H] (no input norm)."""
        return self.self_attn.kv(ctx, cos, sin)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Ctx, ctx_v: Ctx, visible: Tensor
    ) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, visible)
        return h + self.mlp(self.post_attention_layernorm(h))
