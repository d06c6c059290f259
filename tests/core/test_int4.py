"""INT4 routed experts (compressed-tensors pack-quantized): layout, packing, model equivalence."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from model_utils import prefill, rel_err
from safetensors import safe_open
from safetensors.torch import save_file

from ddserve.config import ModelConfig
from ddserve.distributed import LocalComm
from ddserve.model.deepseek import DeepseekV3ForCausalLM
from ddserve.model.loader import load_model
from ddserve.model.quant import dequantize_int4, pack_int4, unpack_int4


def spec_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The compressed-tensors INT4 formula, element by element: w[r, c] = (nibble(c) - 8) *
    scale[r, c // 32]."""
    c = torch.arange(packed.shape[1] * 8)
    words = packed.to(torch.int64)[:, c // 8] & 0xFFFFFFFF  # [R, C] unsigned view
    q = ((words >> (4 * (c % 8))) & 0xF) - 8
    return q.float() * scale.float()[:, c // 32]


@pytest.mark.parametrize("shape", [(1, 8), (3, 64), (7, 40), (2, 5, 96)])
def test_pack_unpack_roundtrip(shape):
    q = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(unpack_int4(packed).long(), q)


def test_packing_is_lsb_first_value_plus_8():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]])
    want = sum((v + 8) << (4 * i) for i, v in enumerate(q[0].tolist()))  # as unsigned 32-bit
    assert int(pack_int4(q)[0, 0]) & 0xFFFFFFFF == want


def test_checkpoint_layout_matches_kimi(tiny_int4_model_dir):
    cfg = ModelConfig.from_hf(tiny_int4_model_dir)
    raw = json.loads((tiny_int4_model_dir / "config.json").read_text())["quantization_config"]
    assert raw["format"] == "pack-quantized" and cfg.quant is not None
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    with safe_open(tiny_int4_model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        stem = "model.layers.1.mlp.experts.5"
        for proj, (rows, cols) in {"gate": (i, h), "up": (i, h), "down": (h, i)}.items():
            p = f"{stem}.{proj}_proj"
            assert f.get_tensor(f"{p}.weight_packed").dtype == torch.int32
            assert f.get_tensor(f"{p}.weight_packed").shape == (rows, cols // 8)
            assert f.get_tensor(f"{p}.weight_scale").dtype == torch.bfloat16
            assert f.get_tensor(f"{p}.weight_scale").shape == (rows, cols // 32)
            assert f.get_tensor(f"{p}.weight_shape").tolist() == [rows, cols]
            assert f"{p}.weight" not in names
        for n in names:  # only routed experts are quantized
            assert n.endswith(".weight") or ".mlp.experts." in n or "e_score_correction" in n, n
        w = dequantize_int4(
            f.get_tensor(f"{stem}.down_proj.weight_packed"),
            f.get_tensor(f"{stem}.down_proj.weight_scale"),
        )
        ref = spec_dequant(
            f.get_tensor(f"{stem}.down_proj.weight_packed"),
            f.get_tensor(f"{stem}.down_proj.weight_scale"),
        )
        assert torch.equal(w, ref)


def _dequantized_copy(src, dst):
    """The same checkpoint with every INT4 expert replaced by its dequantized fp32 weight."""
    dst.mkdir()
    tensors = {}
    with safe_open(src / "model.safetensors", framework="pt") as f:
        for n in f.keys():
            if n.endswith("weight_packed"):
                stem = n.removesuffix("_packed")
                tensors[stem] = spec_dequant(f.get_tensor(n), f.get_tensor(stem + "_scale"))
            elif ".mlp.experts." not in n:
                tensors[n] = f.get_tensor(n)
    save_file(tensors, dst / "model.safetensors")
    raw = json.loads((src / "config.json").read_text())
    del raw["quantization_config"]
    (dst / "config.json").write_text(json.dumps(raw))


def test_int4_model_equals_dequantized_dense_model(tiny_int4_model_dir, tmp_path):
    _dequantized_copy(tiny_int4_model_dir, tmp_path / "dense")
    int4, _ = load_model(tiny_int4_model_dir, dtype=torch.float32, progress=False)
    dense, _ = load_model(tmp_path / "dense", dtype=torch.float32, progress=False)
    assert int4.model.layers[1].mlp.experts.weights().is_int4
    assert not dense.model.layers[1].mlp.experts.weights().is_int4
    prompts = [[1, 2, 3, 4, 5, 6], [200, 100, 50]]
    a, _ = prefill(int4, int4.new_kv_cache(2000), prompts)
    b, _ = prefill(dense, dense.new_kv_cache(2000), prompts)
    assert rel_err(a, b) <= 1e-5


def test_int4_quantizes_the_dense_seed_weights(tiny_model_dir, tiny_int4_model_dir):
    """make-tiny --int4 stores the group-32 quantization of the bf16 model's expert weights."""
    name = "model.layers.2.mlp.experts.3.up_proj"
    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as f:
        dense = f.get_tensor(f"{name}.weight").float()
    with safe_open(tiny_int4_model_dir / "model.safetensors", framework="pt") as f:
        deq = spec_dequant(
            f.get_tensor(f"{name}.weight_packed"), f.get_tensor(f"{name}.weight_scale")
        )
    step = dense.abs().reshape(dense.shape[0], -1, 32).amax(-1) / 7  # quantization step per group
    err = (deq - dense).abs().reshape(dense.shape[0], -1, 32).amax(-1)
    # half a step of rounding, plus bf16 rounding of the stored dense weight and of the scale
    assert (err <= 0.6 * step).all()


class _Ranks(LocalComm):
    """Shape-only stand-in for rank 0 of `world_size` ranks (no collectives are called)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


def test_int4_tp_split_needs_whole_groups(tiny_int4_model_dir):
    cfg = ModelConfig.from_hf(tiny_int4_model_dir)
    DeepseekV3ForCausalLM(cfg, _Ranks(4), dtype=torch.float32, device="meta")  # 128 / 4 = 32: ok
    narrow = dataclasses.replace(cfg, moe_intermediate_size=64)
    with pytest.raises(ValueError, match="moe_intermediate_size.*INT4 groups"):
        DeepseekV3ForCausalLM(narrow, _Ranks(4), dtype=torch.float32, device="meta")
