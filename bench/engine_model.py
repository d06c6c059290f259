"""The engine benchmark's model: a random "K2.6 rank slice" built directly on the device.

One GPU of a tp=8 Kimi K2.6 deployment holds 64/8 = 8 attention heads, 1/8 of every expert's
width (2048/8 = 256), 1/8 of the dense MLP (18432/8 = 2304) and of the shared expert, and a
1/8 slice of the vocabulary (163840/8 = 20480) for embedding and lm_head. q_a_proj and
kv_a_proj_with_mqa are replicated, as is the 576-wide latent KV cache. Running exactly those
shapes as tp=1 on one GPU reads the bytes one rank reads per step; what it leaves out are the
collectives (2 all-reduces per layer and the logits all-gather) and the all-gather's full-vocab
sampling.

Weights are random (no checkpoint), scaled by 1/sqrt(fan_in) so bf16 activations stay finite.
The embedding carries a strong token signal (RMS `EMBED_RMS`) and lm_head row v is the unit
embedding of token perm(v), so the greedy next token is a robust function of the current token:
bf16 differences between a q_len-1 AR forward and a batched tree-verify forward do not flip the
argmax, and an oracle drafter fed the AR continuation stays in sync. Routing is random (random
router rows per layer) and every weight has zero mean, so the residual stream stays dominated by
the token and every distinct token picks its own experts: C streams (each on its own path
through perm) and their trees touch about as many distinct experts per layer as independent
uniform routing would. The INT4 values are uniform in [-7, 7]: with [-8, 7] (mean -0.5) every
expert's output would share a direction (a bias of -0.5 x scale per weight), which K2's widths
amplify ~1.2x per layer; over 60 layers it outweighs the token, the greedy token stops
depending on it, and the streams fall into one shared cycle of tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ddserve.config import ModelConfig
from ddserve.model.deepseek import DeepseekV3ForCausalLM
from ddserve.model.quant import GROUP, PACK
from ddserve.model.tiny import INT4_QUANT_CONFIG

EMBED_RMS = 100.0  # token signal in the residual stream (61 random layers add RMS ~10-15)
LM_HEAD_GAIN = 0.2  # matched logit ~ GAIN * sqrt(hidden); others ~ N(0, GAIN^2)
INT4_STD = math.sqrt((15**2 - 1) / 12)  # std of an int4 value uniform in [-7, 7]

# Kimi K2.x (K2-Instruct-0905 / K2-Thinking / K2.6 text_config): 61 layers, 64 heads,
# 384 experts top-8, n_group 1, first layer dense, YaRN factor 64 over 4096 positions.
K2_ROPE_SCALING = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
}
K2_FULL = dict(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, n_routed_experts=384, num_experts_per_tok=8,
)  # fmt: skip
TP = 8


def rank_slice_config(layers: int = 61, small: bool = False) -> dict[str, Any]:
    """HF config.json fields of one tp=8 rank of K2.6, run as tp=1 (or a tiny stand-in)."""
    if small:
        shapes = dict(
            vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
            num_attention_heads=2, n_routed_experts=32, num_experts_per_tok=4, q_lora_rank=64,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            max_position_embeddings=4096,
        )  # fmt: skip
        rope = {**K2_ROPE_SCALING, "factor": 4.0, "original_max_position_embeddings": 1024}
    else:
        shapes = dict(
            vocab_size=K2_FULL["vocab_size"] // TP,
            hidden_size=K2_FULL["hidden_size"],
            intermediate_size=K2_FULL["intermediate_size"] // TP,
            moe_intermediate_size=K2_FULL["moe_intermediate_size"] // TP,
            num_attention_heads=K2_FULL["num_attention_heads"] // TP,
            n_routed_experts=K2_FULL["n_routed_experts"],
            num_experts_per_tok=K2_FULL["num_experts_per_tok"],
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, max_position_embeddings=262144,
        )  # fmt: skip
        rope = dict(K2_ROPE_SCALING)
    return {
        "model_type": "kimi_k2",
        **shapes,
        "num_hidden_layers": layers,
        "num_key_value_heads": shapes["num_attention_heads"],
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "rope_theta": 50000.0,
        "rope_scaling": rope,
        "rope_interleave": True,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "quantization_config": INT4_QUANT_CONFIG,
    }


def weight_bytes_per_layer(cfg: ModelConfig) -> tuple[int, int]:
    """(bytes of one MoE layer's routed experts, bytes of one expert) in the INT4 layout."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    w13 = 2 * i * (h // PACK) * 4 + 2 * i * (h // GROUP) * 2
    w2 = h * (i // PACK) * 4 + h * (i // GROUP) * 2
    return cfg.n_routed_experts * (w13 + w2), w13 + w2


def estimate_weight_bytes(cfg: ModelConfig) -> int:
    """Total weight bytes without building the model (meta device)."""
    shell = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    return sum(p.numel() * p.element_size() for p in shell.parameters())


def _fill_int4_(p: torch.Tensor, gen: torch.Generator) -> None:
    """Every nibble n uniform in [1, 15]: the value n - 8 is uniform in [-7, 7], zero mean, as
    symmetric quantization (amax / 7) gives. Uniform nibbles in [0, 15] would have mean -0.5 (a
    -0.5 x scale bias on every weight), which K2 widths amplify layer over layer (see the module
    docstring)."""
    nib = torch.empty_like(p)
    p.zero_()
    for k in range(PACK):
        nib.random_(1, 16, generator=gen)
        if k == PACK - 1:  # the top nibble as a two's-complement int32: n << 28 - (2^32 if n > 7)
            nib = torch.where(nib > 7, nib - 16, nib)
        p.bitwise_or_(nib * (1 << (4 * k)))


def _fill_(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    if p.dtype == torch.int32:  # packed INT4
        _fill_int4_(p, gen)
    elif name.endswith("_scale"):  # INT4 group scales: 1/sqrt(fan_in) / std(q), jittered
        fan_in = p.shape[-1] * GROUP
        p.uniform_(0.5, 1.5, generator=gen).mul_(1.0 / (math.sqrt(fan_in) * INT4_STD))
    elif name.endswith("e_score_correction_bias"):
        p.normal_(0.0, 0.01, generator=gen)
    elif name.endswith("norm.weight"):
        p.fill_(1.0)
    elif name.endswith("embed_tokens.weight"):
        p.normal_(0.0, EMBED_RMS, generator=gen)
    elif name.endswith("lm_head.weight"):
        pass  # set from the embedding afterwards
    elif name.endswith("mlp.gate.weight"):  # bf16 values, as checkpoints store the gate
        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        p.copy_(p.to(torch.bfloat16).float())
    else:
        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)


@torch.no_grad()
def build_random_model(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> DeepseekV3ForCausalLM:
    """The model with random weights generated on `device` (see the module docstring)."""
    model = DeepseekV3ForCausalLM(cfg, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        _fill_(name, p.data, gen)
    emb = model.model.embed_tokens.weight  # [V, D]
    cpu_gen = torch.Generator().manual_seed(seed)  # host randperm: CUDA may route small n via CPU
    perm = torch.randperm(emb.shape[0], generator=cpu_gen).to(device)  # [V] next token of t
    unit = emb.float() / EMBED_RMS  # rows of RMS ~1
    head = torch.empty_like(unit)
    head[perm] = unit  # row perm[t] = unit embedding of t: token t -> perm[t]
    model.lm_head.weight.copy_(head * (LM_HEAD_GAIN / math.sqrt(emb.shape[1])))
    return model


def parameter_bytes(model: DeepseekV3ForCausalLM) -> dict[str, int]:
    """Weight bytes by role, as one step reads them. 'experts' is all routed experts (a step
    reads only the distinct ones it touches); 'embedding' is read one row per token."""
    out = dict(attention=0, dense_mlp=0, shared_expert=0, router=0, norms=0, experts=0,
               lm_head=0, embedding=0)  # fmt: skip
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if ".self_attn." in name and "layernorm" not in name:
            out["attention"] += n
        elif ".mlp.experts." in name:
            out["experts"] += n
        elif ".mlp.shared_experts." in name:
            out["shared_expert"] += n
        elif ".mlp.gate." in name:
            gate = name.endswith("gate.weight") and p.is_cuda
            if gate and torch.equal(p.to(torch.bfloat16).float(), p):
                n //= 2  # the fused router reads its exact bf16 copy (`Router.gate_for`)
            out["router"] += n
        elif ".mlp." in name:
            out["dense_mlp"] += n
        elif name.startswith("lm_head"):
            out["lm_head"] += n
        elif "embed_tokens" in name:
            out["embedding"] += n
        else:
            out["norms"] += n
    return out
