"""MLA's latent path split around q_b_proj (`backend.mla_latent` + `backend.linear_rope`: the q_a
norm in the latent kernel, the query's RoPE in the q_b matmul's epilogue) on the GPU: the same
bits as rms_norm + q_b_proj + `mla_rope_cache`, op by op at K2.6 rank shapes, and as logits of
an engine with K2.6's attention shapes (8 local heads of 128 + 64, q LoRA 1536, latent 512 + 64;
tiny elsewhere) eager and replayed from CUDA graphs; DDTree still equals plain decoding with
it. Prompt chunks keep the unsplit path (their 128-column q_b tiles hold a rope part and half a
nope part), so the engines differ only in decode and verify forwards. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from _forwards import PROMPTS, forward_logits, prefilled_runner

from ddserve.config import ModelConfig
from ddserve.drafter.tiny import write_tiny_drafter
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels import backend, fused, invariant
from ddserve.kernels.fused_ref import apply_rope, mla_rope_cache_ref
from ddserve.model.mla import MLA
from ddserve.model.tiny import write_tiny
from ddserve.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
T_LIST = [1, 2, 10, 17, 64, 170]
Q_LORA, KV_LORA, ROPE, HEADS, NOPE = 1536, 512, 64, 8, 128
K2_ATTENTION = dict(q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
                    qk_rope_head_dim=ROPE, v_head_dim=128, num_attention_heads=HEADS,
                    num_key_value_heads=HEADS)  # fmt: skip


def rand(*shape, dtype=torch.bfloat16, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def _rope_inputs(t: int, seed: int, dtype=torch.bfloat16):
    ang = torch.rand(t, ROPE, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    ang = ang * 1000.0
    return ang.cos().to(dtype), ang.sin().to(dtype)  # [T, P] each


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_rope_is_linear_then_rope_at_k26_q_b(dtype, interleave: bool) -> None:
    """q_b_proj (1536 -> 8 heads of 128 + 64; 64-column tiles, K split 2) with the RoPE in its
    epilogue: the bits of `invariant.linear` then torch's RoPE on the rope columns, every row
    count the same per row."""
    n = HEADS * (NOPE + ROPE)
    assert invariant.rope_tiles_fit(n, Q_LORA, dtype, NOPE, ROPE)
    x = rand(170, Q_LORA, dtype=dtype, seed=1)
    w = rand(n, Q_LORA, dtype=dtype, scale=Q_LORA**-0.5, seed=2)
    cos, sin = _rope_inputs(170, 3, dtype)
    got = invariant.linear_rope(x, w, cos, sin, NOPE, interleave)  # [170, N]
    want = invariant.linear(x, w).view(170, HEADS, NOPE + ROPE)
    want[..., NOPE:] = apply_rope(want[..., NOPE:], cos, sin, interleave)
    assert torch.equal(got.view(170, HEADS, NOPE + ROPE), want)
    bad = [t for t in T_LIST
           if not torch.equal(invariant.linear_rope(x[:t], w, cos[:t], sin[:t], NOPE, interleave),
                              got[:t])]  # fmt: skip
    assert bad == [], f"rows differ from the 170-row launch at T = {bad}"


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("t", [1, 10, 170])
def test_mla_latent_is_the_q_norm_and_the_cache_side(t: int, interleave: bool) -> None:
    """The latent kernel on column slices of the merged q_a | kv_a output: q_a_layernorm as
    `invariant.rms_norm`, the cache rows as `mla_rope_cache` writes them."""
    both = rand(t, Q_LORA + KV_LORA + ROPE, seed=4)  # [T, q_lora + R + P]
    q_a, kv = both[:, :Q_LORA], both[:, Q_LORA:]
    qw, w = rand(Q_LORA, seed=5), rand(KV_LORA, seed=6)
    cos, sin = _rope_inputs(t, 7)
    cache = rand(400, KV_LORA + ROPE, seed=8)  # [S, R + P] old contents
    slots = torch.randperm(400, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    slots = slots[:t]
    q = rand(t, HEADS, NOPE + ROPE, seed=10)
    want_cache, got_cache = cache.clone(), cache.clone()
    mla_rope_cache_ref(q, kv, w, 1e-6, cos, sin, want_cache, slots, interleave,
                       rms_norm=invariant.rms_norm)  # fmt: skip
    got = fused.mla_latent(q_a, qw, 1e-6, kv, w, 1e-6, cos, sin, got_cache, slots, interleave)
    assert torch.equal(got, invariant.rms_norm(q_a, qw, 1e-6)), "q_a_layernorm"
    assert torch.equal(got_cache, want_cache), "latent cache"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny INT4 checkpoint with K2.6's per-rank attention shapes, and its drafter."""
    out = write_tiny(tmp_path_factory.mktemp("k2_attention") / "m", int4=True, seed=0,
                     **K2_ATTENTION)  # fmt: skip
    write_tiny_drafter(out / "drafter", ModelConfig.from_hf(out), seed=0)
    return out


def _set_latent_fusion(runner: ModelRunner, on: bool) -> None:
    layers = [m for m in runner.model.modules() if isinstance(m, MLA)]
    assert layers
    for layer in layers:
        layer.latent_fusion = on


@pytest.fixture
def linear_rope_calls(monkeypatch) -> list:
    """Every `invariant.linear_rope` call from here on (the split latent path's q_b)."""
    calls, real = [], invariant.linear_rope
    monkeypatch.setattr(invariant, "linear_rope", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.mark.parametrize("graphs", [False, True])
def test_forwards_with_the_split_latent_path_equal_forwards_without(
    model_dir, graphs: bool, linear_rope_calls: list
) -> None:
    on = prefilled_runner(model_dir, graphs)
    off = prefilled_runner(model_dir, graphs)
    assert linear_rope_calls == [], "prompt chunks keep the unsplit path"
    _set_latent_fusion(off, False)
    for q, seed in [(1, 0), (9, 1), (1, 2), (9, 3), (9, 4)]:  # AR steps and verify-sized blocks
        before = len(linear_rope_calls)
        want = forward_logits(off, q, seed)
        assert len(linear_rope_calls) == before, "latent_fusion off still split the path"
        assert torch.equal(forward_logits(on, q, seed), want), (q, seed)
    assert linear_rope_calls, "the split path ran"
    if graphs:
        assert on._graphs is not None and off._graphs is not None
    on.close()
    off.close()


@pytest.mark.parametrize("graphs", [False, True])
def test_ddtree_with_the_split_latent_path_equals_plain_decoding(
    model_dir, graphs: bool, linear_rope_calls: list
) -> None:
    """Whole DDTree steps and AR steps with the split path (verify rows are AR rows bit for
    bit), and DDTree without it: the same greedy tokens on every stream."""
    from engine_helpers import run_all

    params = SamplingParams(max_tokens=20)
    outs = {}
    for on in (True, False):
        cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=graphs)
        runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=model_dir / "drafter",
                             device="cuda")  # fmt: skip
        assert runner.kernels.batch_invariant
        _set_latent_fusion(runner, on)
        outs[on] = run_all(runner, PROMPTS, params, speculative=True)
        if on:
            outs["ar"] = run_all(runner, PROMPTS, params, speculative=False)
            assert linear_rope_calls, "the split path ran"
        runner.close()
    assert outs[True] == outs["ar"] == outs[False]


def test_the_k26_attention_engine_splits_the_latent_path_in_decode_forwards(model_dir) -> None:
    """The rule the engine tests above rely on: q_b's decode configuration fits, the prompt
    chunks' does not."""
    q_a = torch.empty(1, Q_LORA, dtype=torch.bfloat16, device="cuda")
    cache = torch.empty(8, KV_LORA + ROPE, dtype=torch.bfloat16, device="cuda")
    q_b = torch.empty(HEADS * (NOPE + ROPE), Q_LORA, dtype=torch.bfloat16, device="cuda")
    with backend.invariant_mode(True):
        assert backend.fuses_mla_latent(q_a, cache, q_b, NOPE, ROPE)
        with backend.prefill_phase():
            assert not backend.fuses_mla_latent(q_a, cache, q_b, NOPE, ROPE)
    with backend.invariant_mode(False):
        assert not backend.fuses_mla_latent(q_a, cache, q_b, NOPE, ROPE)
