"""ModelConfig.from_hf: DeepSeek-V3, Kimi K2 and the K2.6 wrapper; clear errors for the rest."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from ddserve.config import ModelConfig
from ddserve.model.tiny import INT4_QUANT_CONFIG, TINY_CONFIG

transformers = pytest.importorskip("transformers")

# The shape of a real Kimi K2 Thinking config.json (the fields it ships, values as shipped).
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": INT4_QUANT_CONFIG,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}


def test_kimi_k2_config():
    cfg = ModelConfig.from_hf(KIMI_K2)
    assert (cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_experts_per_tok) == (64, 384, 8)
    assert cfg.kv_latent_dim == 576 and cfg.weight_prefix == "" and cfg.quant is not None
    assert cfg.softmax_scale == pytest.approx(0.144680, abs=1e-6)  # YaRN mscale included
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)


def test_kimi_k25_wrapper():
    raw = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {k: v for k, v in KIMI_K2.items() if k != "quantization_config"},
        "vision_config": {"hidden_size": 1152},
        "quantization_config": INT4_QUANT_CONFIG,
        "media_placeholder_token_id": 163605,
    }
    cfg = ModelConfig.from_hf(raw)
    assert cfg.weight_prefix == "language_model." and cfg.quant is not None
    assert cfg.hidden_size == 7168


def test_matches_hf_deepseek_v3_config():
    """Same fields, same defaults and the same attention scale as transformers reads them."""
    minimal = {"model_type": "deepseek_v3", "hidden_size": 256, "num_attention_heads": 8}
    for raw in (TINY_CONFIG, KIMI_K2 | {"model_type": "deepseek_v3"}, minimal):
        ours = ModelConfig.from_hf(raw)
        hf_raw = {k: v for k, v in raw.items() if k != "quantization_config"}
        hf = transformers.DeepseekV3Config(**copy.deepcopy(hf_raw))
        for field in ("vocab_size", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank",
                      "first_k_dense_replace", "routed_scaling_factor", "rope_theta",
                      "rope_interleave", "max_position_embeddings", "eos_token_id"):  # fmt: skip
            assert getattr(ours, field) == getattr(hf, field), field
        attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention
        with torch.device("meta"):  # only the scale is needed, not real weights
            scaling = attn(hf, 0).scaling
        assert math.isclose(ours.softmax_scale, scaling, rel_tol=1e-12)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("scoring_func", "softmax", "scoring_func"),
        ("topk_method", "greedy", "topk_method"),
        ("hidden_act", "gelu", "hidden_act"),
        ("attention_bias", True, "attention_bias"),
        ("moe_layer_freq", 2, "moe_layer_freq"),
        ("num_key_value_heads", 8, "num_key_value_heads"),
        ("sliding_window", 4096, "sliding_window"),
        ("model_type", "llama", "model_type"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling type"),
        ("n_group", 5, "n_group"),
    ],
)
def test_unsupported_fields_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(KIMI_K2 | {field: value})


def test_unsupported_quantization_is_named():
    bad = copy.deepcopy(INT4_QUANT_CONFIG)
    bad["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    with pytest.raises(ValueError, match="num_bits"):
        ModelConfig.from_hf(KIMI_K2 | {"quantization_config": bad})
    with pytest.raises(ValueError, match="quant_method"):
        ModelConfig.from_hf(KIMI_K2 | {"quantization_config": {"quant_method": "fp8"}})


def test_reads_config_json_from_directory(tiny_model_dir):
    cfg = ModelConfig.from_hf(tiny_model_dir)
    assert cfg == ModelConfig.from_hf(tiny_model_dir / "config.json")
    assert cfg.eos_token_id == 257 and cfg.vocab_size == 264 and cfg.quant is None


def test_generation_config_eos_ids_join_the_config_ones(tmp_path):
    """Chat checkpoints (Kimi K2) end a turn with generation_config.json's eos: stop on both."""
    from ddserve.model.tiny import write_tiny

    d = write_tiny(tmp_path / "m", seed=0)
    base = ModelConfig.from_hf(d).eos_token_id
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [base, 259]}))
    assert ModelConfig.from_hf(d).eos_token_id == (base, 259)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": base}))
    assert ModelConfig.from_hf(d).eos_token_id == base


SAVED_VARIANTS = {
    "tiny_yarn_type": TINY_CONFIG,  # YaRN with the legacy `type` key, grouped routing, q LoRA
    "yarn_rope_type": TINY_CONFIG | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    "no_qlora_no_rope_scaling": TINY_CONFIG | {"q_lora_rank": None, "rope_scaling": None},
    "kimi_k2_shapes": KIMI_K2 | {"model_type": "deepseek_v3"},
    "hf_defaults": {"model_type": "deepseek_v3"},
}


@pytest.mark.parametrize("raw", SAVED_VARIANTS.values(), ids=SAVED_VARIANTS.keys())
def test_transformers_saved_config_loads_unchanged(raw, tmp_path):
    """`save_pretrained` adds derived fields (head_dim, qk_head_dim, rope_scaling.rope_type, ...);
    the saved file means the same model as the fields it was made from."""
    hf_raw = {k: v for k, v in raw.items() if k != "model_type"}
    transformers.DeepseekV3Config(**copy.deepcopy(hf_raw)).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {"head_dim", "qk_head_dim"} <= saved.keys()
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("qk_head_dim", 128, "qk_head_dim = 128 is inconsistent with qk_nope_head_dim = 128, "
         r"qk_rope_head_dim = 64 \(qk_head_dim must equal qk_nope_head_dim \+ qk_rope_head_dim "
         r"= 192\)"),
        ("head_dim", 128, "head_dim = 128 is inconsistent with qk_rope_head_dim = 64"),
        ("num_key_value_heads", 8, "num_key_value_heads = 8 is inconsistent with "
         "num_attention_heads = 64"),
    ],
)  # fmt: skip
def test_inconsistent_derived_field_names_both(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(KIMI_K2 | {field: value})


def test_derived_fields_follow_their_sources():
    raw = KIMI_K2 | {"qk_nope_head_dim": 96, "qk_rope_head_dim": 32}
    cfg = ModelConfig.from_hf(raw | {"qk_head_dim": 128, "head_dim": 32})
    assert cfg == ModelConfig.from_hf(raw) and cfg.qk_head_dim == 128
    assert ModelConfig.from_hf(KIMI_K2 | {"head_dim": None}) == ModelConfig.from_hf(KIMI_K2)


def test_inconsistent_rope_type_names_both():
    rope = KIMI_K2["rope_scaling"] | {"rope_type": "linear"}
    match = "rope_scaling.rope_type = 'linear' does not match rope_scaling.type = 'yarn'"
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(KIMI_K2 | {"rope_scaling": rope})


def test_unknown_field_is_still_refused_beside_derived_ones():
    with pytest.raises(ValueError, match=r"unsupported config field\(s\) \['v_head_dim_x'\]"):
        ModelConfig.from_hf(KIMI_K2 | {"head_dim": 64, "qk_head_dim": 192, "v_head_dim_x": 128})


def test_kimi_k25_text_config_with_derived_fields():
    text = {k: v for k, v in KIMI_K2.items() if k != "quantization_config"}
    text |= {"head_dim": 64, "qk_head_dim": 192}
    raw = {"model_type": "kimi_k25", "text_config": text, "quantization_config": INT4_QUANT_CONFIG}
    assert ModelConfig.from_hf(raw).qk_head_dim == 192
    with pytest.raises(ValueError, match="head_dim = 128 is inconsistent"):
        ModelConfig.from_hf(raw | {"text_config": text | {"head_dim": 128}})
