"""DeepseekV3ForCausalLM: the target model as single-device code over TP-aware layers.

Parameter names equal the HF checkpoint names (minus the K2.6 `language_model.` prefix), except
the routed experts, which the loader stacks into `mlp.experts.{w13,w2}[_packed|_scale]`.
Each residual add runs in one launch with the RMSNorm that follows it (`RMSNorm.add_and_norm`):
post_attention_layernorm inside a layer, the next layer's input_layernorm (or the final norm)
between layers, so the forward carries the stream and the pending MLP output from layer to layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ddserve.config import ModelConfig
from ddserve.distributed import Communicator, LocalComm
from ddserve.kernels.tree_attn import TreeAttnMeta
from ddserve.model.layers import ParallelLMHead, RMSNorm, VocabParallelEmbedding
from ddserve.model.mla import MLA
from ddserve.model.moe import DenseMLP, MoE
from ddserve.model.rope import RotaryEmbedding


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [T, vocab_size] float32, identical on every rank
    hidden: torch.Tensor | None  # [T, len(capture_layers) * hidden_size] or None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, comm: Communicator, dtype, device):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = MLA(cfg, comm, dtype, device)
        if cfg.is_moe_layer(i):
            self.mlp = MoE(cfg, comm, dtype, device)
        else:
            self.mlp = DenseMLP(d, cfg.intermediate_size, comm, dtype, device)
        self.input_layernorm = RMSNorm(d, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, device)

    def forward(self, h, x, cos, sin, kv_cache, meta, absorbed: bool):
        """h = input_layernorm(x) for the residual stream x [T, D] (the caller computes it
        together with the previous layer's residual add). Returns (MLP output, x + attention
        output); the layer's output is their sum, which the caller adds in the next norm's launch.
        """
        attn = self.self_attn(h, cos, sin, kv_cache, meta, absorbed)  # [T, D]
        x, h = self.post_attention_layernorm.add_and_norm(attn, x)  # x + attn, its norm
        return self.mlp(h), x


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype, device) -> None:
        super().__init__()
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = VocabParallelEmbedding(v, d, comm, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, comm, dtype, device) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)


class DeepseekV3ForCausalLM(nn.Module):
    """Weights are allocated empty; fill them with `loader.load_checkpoint`."""

    def __init__(
        self,
        cfg: ModelConfig,
        comm: Communicator | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg, self.comm = cfg, comm or LocalComm()
        self.dtype, self.device = dtype, torch.device(device)
        self.rotary_emb = RotaryEmbedding(cfg, self.device)
        self.model = DeepseekV3Model(cfg, self.comm, dtype, self.device)
        v, d = cfg.vocab_size, cfg.hidden_size
        self.lm_head = ParallelLMHead(v, d, self.comm, dtype, self.device)

    def new_kv_cache(self, num_slots: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed latent pool [L, num_slots, kv_latent_dim] (tests; the engine owns its own)."""
        shape = (self.cfg.num_hidden_layers, num_slots, self.cfg.kv_latent_dim)
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, D]
        return self.model.embed_tokens(ids)

    @torch.no_grad()
    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] float32
        """lm_head only (no final norm), full vocabulary on every rank."""
        return self.lm_head(h)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [L, S, R + P]
        meta: TreeAttnMeta,
        capture_layers: tuple[int, ...] = (),
        absorbed: bool = True,
        logit_rows: torch.Tensor | None = None,  # [N] rows that need logits (None: all T)
    ) -> ModelOutput:
        """Write the T tokens' latents at meta.block_slots in every layer, attend, return logits.

        `hidden` concatenates the outputs (residual stream) of decoder layers `capture_layers`
        (0-based), in the order given. With `logit_rows` only those rows go through the final
        norm and lm_head (prefill needs one row per prompt, not a [T, vocab] all-gather).
        """
        x = self.embed(input_ids)  # [T, D] the residual stream
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)  # [T, P] each
        layers, captured = self.model.layers, {}
        h = layers[0].input_layernorm(x)  # [T, D]
        for i, layer in enumerate(layers):
            out, x = layer(h, x, cos, sin, kv_cache[i], meta, absorbed)  # x: after attention
            if i + 1 < len(layers):  # x: layer i's output, h: the next layer's input
                x, h = layers[i + 1].input_layernorm.add_and_norm(out, x)
            elif logit_rows is None:
                x, h = self.model.norm.add_and_norm(out, x)  # [T, D] each
            else:  # only the logit rows go through the final norm
                x = out + x
                h = self.model.norm(x[logit_rows])  # [N, D]
            if i in capture_layers:
                captured[i] = x
        hidden = None
        if capture_layers:
            hidden = torch.cat([captured[i] for i in capture_layers], dim=-1)  # [T, n * D]
        return ModelOutput(logits=self.lm_head(h), hidden=hidden)
