"""The default pair's shapes: the target's HF `config.json` dict and the test-sized override.

The target is DeepSeek-V3 / Kimi K2 architecture at ~21M parameters (~8M active per token). It
shards at tp = 1, 2, 4, 8: 8 heads; routed expert width 256 = one INT4 group of 32 per rank at
tp = 8; vocab 4096 (a multiple of 8). bos/eos ids come from the trained tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 6,
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
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "rope_interleave": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": None,  # filled from the tokenizer by `target_config`
    "eos_token_id": None,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}

# `--tiny`: CPU tests and the smoke run. Same structure (groups, q LoRA, YaRN, a dense first
# layer, INT4-groupable widths), a few hundred thousand parameters.
TINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_scaling": {**TARGET_CONFIG["rope_scaling"], "original_max_position_embeddings": 64},
    "max_position_embeddings": 256,
}


def special_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """Special-token name -> id, read from the trained tokenizer's `tokenizer.json`."""
    raw = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in raw["added_tokens"]}


def target_config(
    tokenizer_dir: str | Path | None = None, tiny: bool = False, **overrides: Any
) -> dict[str, Any]:
    """The target's HF config dict; with a tokenizer, its bos/eos ids and its size (rounded up to
    a multiple of 8 so the vocab splits at tp = 8; the trained tokenizer has exactly 4096)."""
    cfg = {**TARGET_CONFIG, **(TINY_OVERRIDES if tiny else {}), **overrides}
    if tokenizer_dir is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        ids = special_ids(tokenizer_dir)
        cfg["vocab_size"] = -(-tok.get_vocab_size(with_added_tokens=True) // 8) * 8  # TP <= 8
        cfg["bos_token_id"], cfg["eos_token_id"] = ids["<|bos|>"], ids["<|eos|>"]
    return cfg
