"""`ddserve make-tiny`: a small random checkpoint of the target architecture; and where the
embedded default (a trained model, not a random one) lives.

The checkpoint is HF-format (config.json, model.safetensors, tokenizer) so `transformers` loads
it too. Weights are deterministic from the seed and scaled so greedy decoding is not degenerate.
With `int4=True` the routed experts are the group-32 quantization of the same dense weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ddserve.config import ModelConfig
from ddserve.model.quant import checkpoint_int4
from ddserve.tokenizer import SPECIALS, write_byte_tokenizer

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 256 + len(SPECIALS),
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "rope_interleave": True,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 256 + SPECIALS.index("<|bos|>"),
    "eos_token_id": 256 + SPECIALS.index("<|eos|>"),
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
    "torch_dtype": "bfloat16",
}

INT4_QUANT_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "group_size": 32,
                "strategy": "group",
                "dynamic": False,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|down)_proj.*",
    ],
    "quantization_status": "compressed",
}


def _std(name: str, shape: tuple[int, ...]) -> float:
    """Init scale per role: unit-variance embeddings, fan-in scaled matmuls, sharp lm_head."""
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith("lm_head.weight"):
        return 3.0 / math.sqrt(shape[-1])
    if name.endswith("mlp.gate.weight"):
        return 2.0 / math.sqrt(shape[-1])
    return 1.0 / math.sqrt(shape[-1])


def _init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return 0.02 * torch.randn(shape, generator=g)
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return _std(name, shape) * torch.randn(shape, generator=g)


def dense_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor (bf16 experts layout) in float32, generated in name order."""
    from ddserve.model.deepseek import DeepseekV3ForCausalLM
    from ddserve.model.loader import _targets

    shell = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, device="meta")
    shapes = {n: t.full_shape for n, t in _targets(shell).items()}
    g = torch.Generator().manual_seed(seed)
    return {n: _init(n, shapes[n], g) for n in sorted(shapes)}


def _to_checkpoint(tensors: dict[str, torch.Tensor], int4: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if int4 and ".mlp.experts." in name:
            out.update(checkpoint_int4(name, t))
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def save_checkpoint(tensors: dict[str, torch.Tensor], out: Path, num_shards: int = 1) -> None:
    """model.safetensors, or `num_shards` files plus model.safetensors.index.json."""
    names = sorted(tensors)
    if num_shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, out / "model.safetensors")
        return
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[k::num_shards]
        save_file({n: tensors[n].contiguous() for n in part}, out / fname)
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_tiny(
    out_dir: str | Path, int4: bool = False, seed: int = 0, num_shards: int = 1, **overrides: Any
) -> Path:
    """Write config.json, safetensors and the byte tokenizer; `overrides` are HF config fields."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **overrides}
    if int4:
        raw["quantization_config"] = INT4_QUANT_CONFIG
    dense_cfg = ModelConfig.from_hf({k: v for k, v in raw.items() if k != "quantization_config"})
    tensors = _to_checkpoint(dense_tensors(dense_cfg, seed), int4)
    save_checkpoint(tensors, out, num_shards)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    write_byte_tokenizer(out)
    return out


def make_tiny(out_dir: str | Path, int4: bool = False, seed: int = 0) -> Path:
    """Everything `ddserve make-tiny` writes into OUT."""
    from ddserve.drafter.tiny import write_tiny_drafter

    out = write_tiny(out_dir, int4=int4, seed=seed)
    write_tiny_drafter(out / "drafter", ModelConfig.from_hf(out), seed=seed)
    return out


# The served model name of the embedded default (`ddserve serve` without --model).
DEFAULT_NAME = "ddserve-code-21m"


def default_model_dir() -> Path:
    """The embedded default: a trained ~21M-parameter Python code model (INT4 routed experts)
    with its DFlash drafter in `drafter/`, shipped as package data in `ddserve/default_model/`
    (its README.md says how it was trained). Random test models come from `make_tiny`."""
    return Path(__file__).resolve().parents[1] / "default_model"


def main(args) -> int:
    out = make_tiny(args.out, int4=args.int4, seed=args.seed)
    print(f"wrote tiny {'INT4' if args.int4 else 'bf16'} checkpoint (seed {args.seed}) to {out}")
    return 0
