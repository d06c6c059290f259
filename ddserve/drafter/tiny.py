"""A tiny random DFlash drafter matching a (tiny) target, in the published checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from ddserve.drafter.config import DrafterConfig, build_target_layer_ids
from ddserve.drafter.model import DFlashModel
from ddserve.tokenizer import SPECIALS

if TYPE_CHECKING:
    from ddserve.config import ModelConfig

# `<|mask|>` of the tiny byte tokenizer (256 byte tokens, then the specials): 260.
TINY_MASK_TOKEN_ID = 256 + SPECIALS.index("<|mask|>")
# Small enough that the embedded model's per-stream context ring stays light; Kimi's is 2048.
TINY_SLIDING_WINDOW = 256


def tiny_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """DFlash's spread, clipped to the target's layers; evenly spaced instead if that repeats."""
    ids = [
        min(max(i, 0), num_target_layers - 1) for i in build_target_layer_ids(num_target_layers, n)
    ]
    if len(set(ids)) < len(ids):
        n = min(n, num_target_layers)
        ids = sorted({round(i * (num_target_layers - 1) / max(n - 1, 1)) for i in range(n)})
    return ids


def tiny_drafter_config(
    target_cfg: ModelConfig,
    num_layers: int = 2,
    block_size: int = 8,
    sliding_window: int | None = TINY_SLIDING_WINDOW,
    mask_token_id: int = TINY_MASK_TOKEN_ID,
) -> dict[str, Any]:
    """config.json of a tiny drafter: Qwen3 layout, YaRN rope, every layer sliding (if a window)."""
    ids = tiny_target_layer_ids(target_cfg.num_hidden_layers, num_layers)
    kind = "sliding_attention" if sliding_window is not None else "full_attention"
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": 2 * target_cfg.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "vocab_size": target_cfg.vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "block_size": block_size,
        "num_target_layers": target_cfg.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
        "layer_types": [kind] * num_layers,
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
        "torch_dtype": "bfloat16",
    }


def random_weights(cfg: DrafterConfig, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of a DFlash checkpoint (norm weights near 1)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in DFlashModel(cfg).state_dict().items():
        noise = torch.randn(p.shape, generator=gen) * std
        out[name] = (1.0 + noise) if name.endswith("norm.weight") else noise
    return out


def write_tiny_drafter(
    out_dir: str | Path,
    target_cfg: ModelConfig,
    seed: int = 0,
    sliding_window: int | None = TINY_SLIDING_WINDOW,
    block_size: int = 8,
    num_layers: int = 2,
) -> Path:
    """Write config.json + model.safetensors (bf16) of a random tiny drafter; returns the dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_drafter_config(target_cfg, num_layers, block_size, sliding_window)
    cfg = DrafterConfig.from_hf(raw)
    cfg.validate(target_cfg)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in random_weights(cfg, seed).items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out
