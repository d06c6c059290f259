"""ddserve's model equals HF transformers' DeepseekV3ForCausalLM on the same random checkpoint.

Checkpoints come from two writers: `ddserve make-tiny` (`write_tiny`), and transformers itself
(`DeepseekV3ForCausalLM(...).save_pretrained`), whose config.json carries the fields transformers
derives (`head_dim`, `qk_head_dim`, `rope_scaling.rope_type`) and which ddserve loads unchanged.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import greedy, prefill, rel_err

from ddserve.model.loader import load_model
from ddserve.model.tiny import write_tiny

transformers = pytest.importorskip("transformers")

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [3, 250, 17, 99, 100, 101, 7, 7, 7, 64, 1, 2], [9] * 5]

CONFIGS = {
    # Group-limited routing (4 groups, best 2), q LoRA, interleaved YaRN rope (the tiny default).
    "groups_qlora": dict(num_hidden_layers=3),
    # No q LoRA, plain (non-interleaved) rope, YaRN attention_factor != 1, no top-k renorm.
    "no_qlora": dict(
        num_hidden_layers=3,
        q_lora_rank=None,
        rope_interleave=False,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
}


# Tiny shapes for checkpoints written by transformers; every other field takes HF's default.
HF_TINY = dict(
    vocab_size=264, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
    num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=64,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
)  # fmt: skip

HF_SAVED = {
    # YaRN given as the legacy `type` key (transformers also writes `rope_type`).
    "hf_saved_yarn": dict(
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        }
    ),
    "hf_saved_grouped": dict(n_group=4, topk_group=2),  # group-limited routing
    "hf_saved_no_qlora": dict(q_lora_rank=None, rope_interleave=False),
}


def save_hf_model(path, seed: int, **overrides) -> None:
    """A random DeepseekV3ForCausalLM written by transformers' own `save_pretrained`."""
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_TINY | overrides))
    with torch.no_grad():  # HF initialises the routing bias to zero: make it matter
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    hf.save_pretrained(path)


def write_checkpoint(path, name: str):
    if name in HF_SAVED:
        save_hf_model(path, seed=1, **HF_SAVED[name])
        return path
    return write_tiny(path, seed=1, **CONFIGS[name])


@pytest.fixture(scope="module", params=sorted(CONFIGS) + sorted(HF_SAVED))
def models(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.generation_config.eos_token_id = None  # always generate the full 32 tokens
    hf.generation_config.pad_token_id = 0
    ours, _ = load_model(path, dtype=torch.float32, progress=False)
    return ours, hf.eval()


def hf_logits(hf, prompt: list[int], stride: int) -> torch.Tensor:
    pos = torch.arange(len(prompt)).unsqueeze(0) * stride
    with torch.no_grad():
        return hf(torch.tensor([prompt]), position_ids=pos).logits[0]  # [T, V]


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
@pytest.mark.parametrize("stride", [1, 150], ids=["dense_pos", "spread_pos"])  # long distances
def test_prefill_logits_match_hf(models, absorbed, stride):
    ours, hf = models
    logits, _ = prefill(ours, ours.new_kv_cache(3000), PROMPTS, absorbed=absorbed, stride=stride)
    ref = torch.cat([hf_logits(hf, p, stride) for p in PROMPTS])
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    assert rel_err(logits, ref) <= 1e-4


def test_greedy_generation_matches_hf(models):
    ours, hf = models
    got = greedy(ours, PROMPTS, steps=32)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()
    assert all(len(set(t)) > 4 for t in got), f"degenerate greedy output {got}"
