"""`ModelConfig`: the HF `config.json` of a DeepSeek-V3 / Kimi K2 model, converted once.

Field names follow HF's `DeepseekV3Config` and missing fields take its defaults, so a config
means the same thing here as in `transformers`. Anything we do not understand is an error that
names the field: silently ignoring e.g. a different scoring function would serve garbage. Fields
that transformers derives and saves (`head_dim`, `qk_head_dim`, ...) are checked against their
sources, so a config that `save_pretrained` wrote loads unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddserve.quant_config import QuantConfig, parse_quant_config

# HF DeepseekV3Config defaults for the fields we use.
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, rope_scaling=None,
    rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=0,
    eos_token_id=1, tie_word_embeddings=False, num_nextn_predict_layers=0,
)  # fmt: skip

# Fields that are fine to ignore whatever their value (bookkeeping, training-only, HF plumbing).
_IGNORED = {
    "architectures", "auto_map", "torch_dtype", "dtype", "use_cache", "transformers_version",
    "_name_or_path", "model_type", "initializer_range", "pretraining_tp", "ep_size",
    "aux_loss_alpha", "seq_aux", "pad_token_id", "attention_dropout", "quantization_config",
    "output_hidden_states", "output_attentions", "return_dict", "use_return_dict",
}  # fmt: skip

# Fields we accept only with these values (HF's behaviour for DeepseekV3 hard-codes them).
_FIXED: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "moe_layer_freq": (1,),
    "tie_word_embeddings": (False,),
}

# Fields `transformers` derives from others and writes into every config it saves
# (DeepseekV3Config.__init__, 4.57): field -> the fields it is the sum of. Accepted when they agree,
# refused when not: transformers would compute with the written value, ddserve with the sources.
_DERIVED: dict[str, tuple[str, ...]] = {
    "head_dim": ("qk_rope_head_dim",),  # the rotary dimension
    "qk_head_dim": ("qk_nope_head_dim", "qk_rope_head_dim"),
    "num_key_value_heads": ("num_attention_heads",),  # MLA: one kv head per query head
}

_ROPE_KEYS = {
    "type", "rope_type", "factor", "original_max_position_embeddings", "mscale",
    "mscale_all_dim", "beta_fast", "beta_slow", "truncate", "attention_factor",
}  # fmt: skip

_WRAPPER_IGNORED = {
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
    "_name_or_path", "vision_config", "media_placeholder_token_id", "pad_token_id",
    "ignore_index", "use_unified_vision_chunk", "video_placeholder", "bos_token_id",
    "eos_token_id", "tie_word_embeddings", "use_cache", "initializer_range",
}  # fmt: skip

TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
WRAPPER_MODEL_TYPES = ("kimi_k25",)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rope_interleave: bool
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    tie_word_embeddings: bool
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers (skipped)
    quant: QuantConfig | None = None  # INT4 routed experts, or None for bf16 experts
    weight_prefix: str = ""  # "language_model." for the K2.6 wrapper
    model_type: str = "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token and layer: [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN mscale(factor, mscale_all_dim)^2 as HF does."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.get("mscale_all_dim"):
            scale *= yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """Read `config.json` (a directory, the file itself, or its parsed dict)."""
        if isinstance(path_or_dict, dict):
            raw, where = dict(path_or_dict), "config"
        else:
            p = Path(path_or_dict)
            p = p / "config.json" if p.is_dir() else p
            raw, where = json.loads(p.read_text()), str(p)
            gen = p.parent / "generation_config.json"
            if gen.exists():  # chat models end a turn with generation_config's eos (K2: <|im_end|>)
                raw = _with_generation_eos(raw, json.loads(gen.read_text()))
        return _from_raw(raw, where)


def _with_generation_eos(raw: dict[str, Any], gen: dict[str, Any]) -> dict[str, Any]:
    """config.json's eos ids plus generation_config.json's (decoding stops on any of them)."""
    as_list = lambda v: [] if v is None else (list(v) if isinstance(v, list | tuple) else [v])
    text = raw.get("text_config") if raw.get("model_type") in WRAPPER_MODEL_TYPES else None
    target = dict(text) if isinstance(text, dict) else raw
    ids = as_list(target.get("eos_token_id", raw.get("eos_token_id")))
    ids += [i for i in as_list(gen.get("eos_token_id")) if i not in ids]
    if not ids:
        return raw
    target = {**target, "eos_token_id": ids[0] if len(ids) == 1 else ids}
    return {**raw, "text_config": target} if text is not None else target


def _from_raw(raw: dict[str, Any], where: str) -> ModelConfig:
    model_type = raw.get("model_type", "deepseek_v3")
    prefix, quant_raw = "", raw.get("quantization_config")
    if model_type in WRAPPER_MODEL_TYPES:
        unknown = sorted(set(raw) - _WRAPPER_IGNORED - {"text_config", "quantization_config"})
        if unknown:
            raise ValueError(f"{where}: unsupported {model_type} field(s) {unknown}")
        if not isinstance(raw.get("text_config"), dict):
            raise ValueError(f"{where}: {model_type} config has no text_config")
        text = raw["text_config"]
        quant_raw = quant_raw or text.get("quantization_config")
        prefix, inner_type = "language_model.", text.get("model_type", "deepseek_v3")
        if inner_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"{where}: unsupported text_config.model_type {inner_type!r}")
        raw = text
    elif model_type not in TEXT_MODEL_TYPES:
        supported = TEXT_MODEL_TYPES + WRAPPER_MODEL_TYPES
        raise ValueError(f"{where}: unsupported model_type {model_type!r} (supported: {supported})")
    _check_fields(raw, where)
    vals = {k: raw.get(k, d) for k, d in _DEFAULTS.items()}
    _check_derived(raw, vals, where)
    vals["rope_scaling"] = _rope_scaling(vals["rope_scaling"], where)
    if isinstance(vals["eos_token_id"], list):
        vals["eos_token_id"] = tuple(vals["eos_token_id"])
    vals["routed_scaling_factor"] = float(vals["routed_scaling_factor"])
    vals["rope_theta"] = float(vals["rope_theta"])
    cfg = ModelConfig(
        **vals, quant=parse_quant_config(quant_raw), weight_prefix=prefix, model_type=model_type
    )
    _check_shapes(cfg, where)
    return cfg


def _check_fields(raw: dict[str, Any], where: str) -> None:
    unknown = sorted(set(raw) - set(_DEFAULTS) - _IGNORED - set(_FIXED) - set(_DERIVED))
    if unknown:
        raise ValueError(f"{where}: unsupported config field(s) {unknown}")
    for key, allowed in _FIXED.items():
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"{where}: unsupported {key} = {raw[key]!r} (supported: {allowed})")


def _check_derived(raw: dict[str, Any], vals: dict[str, Any], where: str) -> None:
    """Each derived field present (and not null) equals the sum of its sources."""
    for key, sources in _DERIVED.items():
        expected = sum(vals[f] for f in sources)
        if raw.get(key) is not None and raw[key] != expected:
            given = ", ".join(f"{f} = {vals[f]!r}" for f in sources)
            total = f" = {expected}" if len(sources) > 1 else ""
            raise ValueError(
                f"{where}: {key} = {raw[key]!r} is inconsistent with {given} "
                f"({key} must equal {' + '.join(sources)}{total})"
            )


def _rope_scaling(rs: dict | None, where: str) -> dict | None:
    if rs is None:
        return None
    rs = dict(rs)
    if "type" in rs and "rope_type" in rs and rs["type"] != rs["rope_type"]:
        # transformers copies `type` into `rope_type` and writes both when it saves.
        raise ValueError(
            f"{where}: rope_scaling.rope_type = {rs['rope_type']!r} does not match "
            f"rope_scaling.type = {rs['type']!r}"
        )
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"{where}: unsupported rope_scaling type {kind!r} (only yarn)")
    unknown = sorted(set(rs) - _ROPE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unsupported rope_scaling field(s) {unknown}")
    rs["rope_type"] = "yarn"
    rs.pop("type", None)
    for key in ("factor", "beta_fast", "beta_slow"):
        if key in rs:
            rs[key] = float(rs[key])
    return rs


def _check_shapes(cfg: ModelConfig, where: str) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"{where}: {what}")

    need(cfg.n_routed_experts % cfg.n_group == 0, "n_group must divide n_routed_experts")
    need(1 <= cfg.topk_group <= cfg.n_group, "topk_group must lie in [1, n_group]")
    per_group = cfg.n_routed_experts // cfg.n_group
    need(per_group >= 2, "routing needs >= 2 experts per group (group score = top-2 sum)")
    need(
        cfg.num_experts_per_tok <= cfg.topk_group * per_group,
        "num_experts_per_tok exceeds the experts in topk_group groups",
    )
    need(cfg.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
    need(0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers, "bad first_k_dense_replace")
