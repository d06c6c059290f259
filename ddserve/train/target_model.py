"""`TrainTarget`: the DeepSeek-V3 / Kimi K2 target as compact, trainable plain torch.

Parameter names are the HF `DeepseekV3ForCausalLM` checkpoint names (routed experts one module
per expert: `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`), so `state_dict()`
is a bf16 HF checkpoint once cast (`export.py`). The math is ddserve's (`ddserve/model/`):
- MLA in the expanded form: q = q_b(norm(q_a(x))), latent = kv_a(x) = [c_kv | k_rope],
  k/v = kv_b(norm(c_kv)) per head, rope (YaRN, `rope_interleave`) on the rope dims, causal
  `F.scaled_dot_product_attention` with ddserve's softmax scale (YaRN mscale included).
- MoE: fp32 sigmoid gate; experts *chosen* on score + `e_score_correction_bias` within the best
  `topk_group` groups, *weighted* by the unbiased scores (normalised, times
  `routed_scaling_factor`); one shared expert added unscaled. Tokens are sorted by expert and each
  expert runs one matmul chain over its tokens (one host sync per layer for the split sizes).
- Balance without an aux loss: each MoE layer counts its tokens per expert (`gate.load`);
  `update_routing_bias` moves the bias by `gamma * sign(mean_load - load_e)` (DeepSeek-V3).
- `qat = True` fake-quantizes the routed experts (INT4, group 32, straight-through gradient),
  exactly as `export` will quantize them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddserve.config import ModelConfig
from ddserve.kernels.router_ref import RoutingParams, route_ref
from ddserve.model.quant import GROUP, dequantize_int4
from ddserve.model.rope import RotaryEmbedding, apply_rope

LORA_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the default eps


def fake_int4(w: torch.Tensor) -> torch.Tensor:
    """w [R, C] rounded as `quantize_int4` + a bf16 scale would store it; identity gradient.

    Symmetric int4 per group of 32 input columns: scale = absmax / 7 (fp32, as quantize_int4),
    q = round(w / scale) clamped to [-8, 7], value = q * bf16(scale) (the checkpoint's scale).
    """
    g = w.float().unflatten(-1, (-1, GROUP))  # [R, C/32, 32]
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 7.0  # [R, C/32, 1]
    q = torch.round(g / scale).clamp(-8, 7)
    deq = (q * scale.to(torch.bfloat16).float()).flatten(-2).to(w.dtype)  # [R, C]
    return w + (deq - w).detach()


class RMSNorm(nn.Module):
    """x / rms(x) in fp32, cast back to x's dtype, times weight (HF's and ddserve's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


class Attention(nn.Module):
    """MLA, expanded (non-absorbed) form, over a whole [B, T] batch with a causal mask."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.rank, self.scale, self.interleave = (
            cfg.kv_lora_rank,
            cfg.softmax_scale,
            cfg.rope_interleave,
        )
        if cfg.q_lora_rank is None:
            self.q_proj = _linear(d, self.heads * cfg.qk_head_dim)
        else:
            self.q_a_proj = _linear(d, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = _linear(cfg.q_lora_rank, self.heads * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(d, cfg.kv_latent_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.heads * (self.nope + self.v_dim))
        self.o_proj = _linear(self.heads * self.v_dim, d)

    def _query(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, H, nope + P]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.unflatten(-1, (self.heads, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], cos/sin [T, 1, P] -> [B, T, D]."""
        q_nope, q_pe = self._query(x).split([self.nope, self.rope_dim], dim=-1)  # [B, T, H, .]
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin, self.interleave)  # [B, T, 1, P]
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).unflatten(-1, (self.heads, -1))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, T, H, nope], [B, T, H, v]
        q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)  # [B, T, H, nope + P]
        k = torch.cat([k_nope, k_pe.to(k_nope.dtype).expand_as(q_pe)], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            scale=self.scale,
        )  # [B, H, T, v]  # fmt: skip
        return self.o_proj(o.transpose(1, 2).flatten(2))  # [B, T, D]


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense layers, the shared expert and each routed expert."""

    def __init__(self, d: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(d, inter), _linear(d, inter)
        self.down_proj = _linear(inter, d)

    def forward(self, x: torch.Tensor, qat: bool = False) -> torch.Tensor:
        w = (lambda m: fake_int4(m.weight)) if qat else (lambda m: m.weight)
        h = F.silu(F.linear(x, w(self.gate_proj))) * F.linear(x, w(self.up_proj))
        return F.linear(h, w(self.down_proj))


class Gate(nn.Module):
    """Router: `weight` [E, D] (trained), `e_score_correction_bias` [E] fp32 (a buffer moved by
    `update_bias`, not by gradients), `load` [E] tokens routed per expert since the last update."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.register_buffer("load", torch.zeros(e), persistent=False)
        self.params = RoutingParams.from_config(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> topk_ids [N, k] int64, topk_weights [N, k] float32: the served routing
        (`route_ref`), with gradients to the gate weight through the chosen experts' scores."""
        with torch.autocast(x.device.type, enabled=False):
            return route_ref(
                x, self.weight.float(), self.e_score_correction_bias, self.params,
                row_sum=lambda w: w.sum(dim=-1, keepdim=True),
            )  # fmt: skip

    @torch.no_grad()
    def update_bias(self, gamma: float) -> None:
        """bias += gamma * sign(mean_load - load), then reset the load count."""
        self.e_score_correction_bias += gamma * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(MLP(d, inter) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(d, inter * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.qat = False

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[n, j] * expert_{ids[n, j]}(x_n), experts run over sorted token groups;
        accumulated in fp32, in ascending expert order per token (as ddserve's reference)."""
        k = ids.shape[1]
        flat = ids.flatten()  # [N * k]
        order = flat.argsort(stable=True)  # [N * k] grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts))  # [E]
        if self.training:
            self.gate.load += counts.to(self.gate.load.dtype)
        rows = order // k  # [N * k] token of each sorted slot
        if torch.is_autocast_enabled(x.device.type):  # gather once in bf16, not k copies in fp32
            x = x.to(torch.get_autocast_dtype(x.device.type))
        xs = x[rows]  # [N * k, D]
        outs = [
            self.experts[e](chunk, self.qat)
            for e, chunk in enumerate(xs.split(counts.tolist()))
            if chunk.shape[0]
        ]
        y = torch.cat(outs).float() * weights.flatten()[order].unsqueeze(-1)  # [N * k, D]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [N, D]
        return out.index_add_(0, rows, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        flat = x.flatten(0, 1)  # [N, D]
        ids, weights = self.gate(flat)
        y = self._routed(flat, ids, weights)  # [N, D] fp32
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.to(x.dtype).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.`: embeddings, decoder layers, final norm, rotary table (not saved)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, "cpu")  # inv_freq: a non-persistent buffer


class TrainTarget(nn.Module):
    """The target for training and for the drafter's trainer (see the module docstring)."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.hf_config = dict(hf_config)
        dense = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        self.cfg = ModelConfig.from_hf(dense)
        self.model = Backbone(self.cfg)
        self.lm_head = _linear(self.cfg.hidden_size, self.cfg.vocab_size)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, hf_config: dict[str, Any], seed: int = 0) -> TrainTarget:
        """A freshly initialised model (deterministic from `seed`)."""
        model = cls(hf_config)
        model.init_weights(seed)
        return model

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> TrainTarget:
        """An exported HF checkpoint (bf16 or INT4 experts, dequantized) as a frozen TrainTarget
        (eval mode, requires_grad off) in `dtype` on `device`. The router stays float32."""
        from ddserve.train.export import read_checkpoint

        hf_config, tensors = read_checkpoint(path)
        model = cls(hf_config).to(device=device, dtype=dtype)
        for gate in model.gates():
            gate.float()  # fp32 router (as ddserve), so the loaded bias is not rounded
        model.model.rotary_emb = RotaryEmbedding(model.cfg, device)  # fp32 inv_freq again
        model.load_state_dict(tensors, strict=True)
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """N(0, initializer_range) matrices (output projections / sqrt(2 L)), unit norms, zero
        routing bias; generated on the CPU in parameter order so any device gets the same."""
        g = torch.Generator().manual_seed(seed)
        std = float(self.hf_config.get("initializer_range", 0.02))
        out_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
        for gate in self.gates():
            gate.e_score_correction_bias.zero_()

    # -- running ------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        capture_layers: Sequence[int] = (),
        positions: torch.Tensor | None = None,  # [T]; default 0 .. T-1
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits [B, T, V], the outputs of decoder layers `capture_layers` (0-based, in the
        order given), each [B, T, H]: the residual stream after layer i, before the final norm,
        as ddserve's engine captures it for DFlash)."""
        x = self.model.embed_tokens(input_ids)  # [B, T, D]
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.model.rotary_emb.cos_sin(positions, torch.float32)  # [T, P] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, P]
        wanted, captured = set(capture_layers), {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin)
            if i in wanted:
                captured[i] = x
        logits = self.lm_head(self.model.norm(x))  # [B, T, V]
        return logits, [captured[i] for i in capture_layers]

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def gates(self) -> list[Gate]:
        return [m.gate for m in self.moe_layers()]

    def set_qat(self, on: bool) -> None:
        """Fake-quantize the routed experts to INT4 (group 32) in every forward from now on."""
        for moe in self.moe_layers():
            moe.qat = on

    def update_routing_bias(self, gamma: float) -> None:
        """The aux-loss-free balance step (after each optimizer step)."""
        for gate in self.gates():
            gate.update_bias(gamma)

    @torch.no_grad()
    def dequantize_experts_(self) -> None:
        """Replace each routed expert's weights by their INT4 rounding (what `qat` simulates)."""
        for moe in self.moe_layers():
            for expert in moe.experts:
                for lin in (expert.gate_proj, expert.up_proj, expert.down_proj):
                    lin.weight.copy_(fake_int4(lin.weight))


def unpack_expert(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's INT4 (weight_packed, weight_scale) as a float32 [out, in] matrix."""
    return dequantize_int4(packed, scale, torch.float32)


def save_config(hf_config: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
