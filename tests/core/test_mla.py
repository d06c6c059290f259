"""MLA over the latent cache: absorbed == expanded, incremental == full, tree verify == paths."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_meta, prefill, rel_err

from ddserve.model.loader import load_model

PROMPTS = [[10, 20, 30, 40, 50, 60, 70, 80, 90], [1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.float32, progress=False)[0]


def test_absorbed_equals_expanded(model):
    full_exp, _ = prefill(model, model.new_kv_cache(2000), PROMPTS, absorbed=False)
    full_abs, _ = prefill(model, model.new_kv_cache(2000), PROMPTS, absorbed=True)
    assert rel_err(full_abs, full_exp) <= 1e-5


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_incremental_decode_equals_one_forward(model, absorbed):
    prompt = PROMPTS[0]
    full, _ = prefill(model, model.new_kv_cache(2000), [prompt], absorbed=False)  # [T, V]
    cache = model.new_kv_cache(64)
    slots = [7, 3, 60, 12]  # arbitrary, non-contiguous slots for the 4-token first chunk
    meta = make_meta([([], slots, None)])
    logits = [
        model(torch.tensor(prompt[:4]), torch.arange(4), cache, meta, absorbed=absorbed).logits
    ]
    for pos in range(4, len(prompt)):  # then one token at a time
        meta = make_meta([(slots, [20 + pos], None)])
        step = model(
            torch.tensor([prompt[pos]]), torch.tensor([pos]), cache, meta, absorbed=absorbed
        )
        logits.append(step.logits)
        slots.append(20 + pos)
    assert rel_err(torch.cat(logits), full) <= 1e-5


def test_tree_verify_equals_each_path(model):
    """A tree block (ancestor-or-self mask) gives every node the logits of its own root path."""
    prompt = PROMPTS[1]
    # nodes: 0 = root, 1 and 2 children of 0, 3 child of 1; depths 0, 1, 1, 2
    tokens, parents, depth = [100, 101, 102, 103], [None, 0, 0, 1], [0, 1, 1, 2]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j is not None:
            mask[i, j] = True
            j = parents[j]
    cache = model.new_kv_cache(64)
    _, (slots,) = prefill(model, cache, [prompt])
    n = len(prompt)
    meta = make_meta([(slots, [40, 41, 42, 43], mask)])
    pos = torch.tensor([n + d for d in depth])
    tree = model(torch.tensor(tokens), pos, cache, meta).logits  # [4, V]
    for node, path in ((1, [0, 1]), (2, [0, 2]), (3, [0, 1, 3])):
        seq = prompt + [tokens[k] for k in path]
        ref, _ = prefill(model, model.new_kv_cache(2000), [seq], absorbed=False)
        assert rel_err(tree[node], ref[-1]) <= 1e-5


def test_captured_hidden_and_lm_logits(model):
    """hidden holds the requested layers' outputs; norm(last layer) through lm_logits = logits."""
    cache = model.new_kv_cache(2000)
    ids = torch.tensor(PROMPTS[0])
    meta = make_meta([([], list(range(len(ids))), None)])
    last = model.cfg.num_hidden_layers - 1
    out = model(ids, torch.arange(len(ids)), cache, meta, capture_layers=(1, last))
    d = model.cfg.hidden_size
    assert out.hidden.shape == (len(ids), 2 * d)
    relogits = model.lm_logits(model.model.norm(out.hidden[:, d:]))
    assert torch.allclose(relogits, out.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.embed(ids), model.model.embed_tokens.weight[ids])


def test_cache_holds_latents_only(model):
    cfg = model.cfg
    cache = model.new_kv_cache(16)
    assert cache.shape == (cfg.num_hidden_layers, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    prefill(model, cache, [[5, 6, 7]])
    written = cache.abs().sum(-1) > 0  # [L, S]
    assert written[:, :3].all() and not written[:, 3:].any()


def test_down_projections_share_one_buffer_filled_by_the_loader(tiny_model_dir):
    """q_a_proj and kv_a_proj_with_mqa are views of one buffer (one matmul on the CUDA invariant
    path), filled in place from the checkpoint; replacing one makes the merged view unavailable."""
    from safetensors.torch import load_file

    from ddserve.model.mla import MLA
    from ddserve.stacked import stacked_rows

    model, cfg = load_model(tiny_model_dir, dtype=torch.float32, progress=False)
    ckpt = {}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        ckpt.update(load_file(f))
    mlas = {n: m for n, m in model.named_modules() if isinstance(m, MLA)}
    assert mlas
    for name, attn in mlas.items():
        stem = cfg.weight_prefix + name
        q_a, kv_a = attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight
        merged = stacked_rows(q_a, kv_a)
        assert merged is not None, name
        want = torch.cat(
            [ckpt[stem + ".q_a_proj.weight"], ckpt[stem + ".kv_a_proj_with_mqa.weight"]]
        )
        assert torch.equal(merged, want.float()), name
        q, kv = attn._down_projections(torch.randn(3, q_a.shape[1]))  # CPU: two matmuls
        assert q.shape == (3, q_a.shape[0]) and kv.shape == (3, kv_a.shape[0])
    attn = next(iter(mlas.values()))
    saved = attn.kv_a_proj_with_mqa.weight
    attn.kv_a_proj_with_mqa.weight = torch.nn.Parameter(saved.clone(), requires_grad=False)
    assert stacked_rows(attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight) is None
    attn.kv_a_proj_with_mqa.weight = saved


def test_share_rows_refuses_weights_of_other_widths():
    from ddserve.model.layers import Linear
    from ddserve.stacked import share_rows

    with pytest.raises(ValueError, match="width"):
        share_rows(Linear(8, 4, torch.float32, "cpu"), Linear(6, 4, torch.float32, "cpu"))
