"""Checkpoint loading: sharded files, the K2.6 wrapper, and errors that name what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_utils import prefill, rel_err
from safetensors.torch import load_file, save_file

from ddserve.distributed import LocalComm
from ddserve.model.deepseek import DeepseekV3ForCausalLM
from ddserve.model.loader import CheckpointError, load_model, split_dim
from ddserve.model.tiny import write_tiny


def edited_copy(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint, applying edit(tensors: dict) to its tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def logits(path: Path) -> torch.Tensor:
    model, _ = load_model(path, dtype=torch.float32, progress=False)
    return prefill(model, model.new_kv_cache(1000), [[4, 5, 6, 7]])[0]


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    bad = edited_copy(tiny_model_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensors: {name}"):
        load_model(bad, progress=False)


def test_unexpected_tensor_is_named(tiny_model_dir, tmp_path):
    name = "model.layers.0.self_attn.rotary.inv_freq"
    bad = edited_copy(tiny_model_dir, tmp_path / "m", lambda t: t.update({name: torch.ones(8)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensors: {name}"):
        load_model(bad, progress=False)


def test_wrong_shape_is_named(tiny_model_dir, tmp_path):
    name = "model.layers.1.mlp.experts.7.down_proj.weight"

    def edit(t):
        t[name] = t[name][:, :-1].contiguous()

    bad = edited_copy(tiny_model_dir, tmp_path / "m", edit)
    with pytest.raises(
        CheckpointError, match=rf"{name}: shape \[256, 127\], expected \[256, 128\]"
    ):
        load_model(bad, progress=False)


def test_wrong_int4_weight_shape_is_named(tiny_int4_model_dir, tmp_path):
    name = "model.layers.3.mlp.experts.0.gate_proj.weight_shape"
    edit = lambda t: t.update({name: torch.tensor([256, 128], dtype=torch.int32)})
    bad = edited_copy(tiny_int4_model_dir, tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=f"{name}: value"):
        load_model(bad, progress=False)


def test_unsupported_config_field_is_named(tiny_model_dir, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(tiny_model_dir, bad)
    raw = json.loads((bad / "config.json").read_text()) | {"use_mla_v2": True}
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="use_mla_v2"):
        load_model(bad, progress=False)


def test_inconsistent_derived_config_field_names_both(tiny_model_dir, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(tiny_model_dir, bad)
    raw = json.loads((bad / "config.json").read_text()) | {"qk_head_dim": 64}
    (bad / "config.json").write_text(json.dumps(raw))
    match = r"qk_head_dim = 64 is inconsistent with qk_nope_head_dim = 32, qk_rope_head_dim = 16"
    with pytest.raises(ValueError, match=match):
        load_model(bad, progress=False)


def test_sharded_checkpoint_equals_single_file(tiny_model_dir, tmp_path):
    sharded = write_tiny(tmp_path / "sharded", seed=0, num_shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    assert torch.equal(logits(sharded), logits(tiny_model_dir))


def test_kimi_k25_wrapper_skips_vision_and_mtp(tiny_model_dir, tmp_path):
    """language_model.-prefixed text model, a vision tower and an MTP layer: same logits."""
    dst = tmp_path / "k25"
    dst.mkdir()
    text = load_file(tiny_model_dir / "model.safetensors")
    tensors = {f"language_model.{n}": t for n, t in text.items()}
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(4, 4)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)
    tensors["language_model.model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)  # MTP layer
    save_file(tensors, dst / "model.safetensors")
    text_cfg = json.loads((tiny_model_dir / "config.json").read_text())
    text_cfg["num_nextn_predict_layers"] = 1
    wrapper = {"model_type": "kimi_k25", "text_config": text_cfg, "vision_config": {}}
    (dst / "config.json").write_text(json.dumps(wrapper))
    assert rel_err(logits(dst), logits(tiny_model_dir)) == 0


def test_split_table():
    assert split_dim("model.layers.3.self_attn.q_b_proj.weight") == 0
    assert split_dim("model.layers.3.self_attn.kv_b_proj.weight") == 0
    assert split_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert split_dim("model.layers.3.self_attn.kv_a_proj_with_mqa.weight") is None
    assert split_dim("model.layers.3.mlp.experts.9.up_proj.weight_packed") == 0
    assert split_dim("model.layers.3.mlp.experts.9.down_proj.weight_scale") == 1
    assert split_dim("model.layers.3.mlp.shared_experts.down_proj.weight") == 1
    assert split_dim("model.layers.0.mlp.gate_proj.weight") == 0
    assert split_dim("model.layers.3.mlp.gate.weight") is None  # the router is replicated
    assert split_dim("model.embed_tokens.weight") == 0 and split_dim("lm_head.weight") == 0


class _Ranks(LocalComm):
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


def test_indivisible_tp_is_named(tiny_model_dir):
    from ddserve.config import ModelConfig

    cfg = ModelConfig.from_hf(tiny_model_dir)
    with pytest.raises(ValueError, match="num_attention_heads = 8 is not divisible .* 3"):
        DeepseekV3ForCausalLM(cfg, _Ranks(3), dtype=torch.float32, device="meta")
