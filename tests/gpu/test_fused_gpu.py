"""Fused elementwise ops (ddserve/kernels/fused.py) on a GPU at K2.6 rank shapes, bitwise.

Each fused kernel must give the bits of the unfused batch-invariant sequence it replaces (torch's
elementwise CUDA ops and `invariant.rms_norm`), and a row must not depend on how many rows share
the launch. The last test runs a small model's forward with and without the fused kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_utils import make_meta

from ddserve.config import ModelConfig
from ddserve.kernels import backend, fused, invariant
from ddserve.kernels.fused_ref import add_rms_norm_ref, mla_rope_cache_ref, silu_mul_ref
from ddserve.model.deepseek import DeepseekV3ForCausalLM
from ddserve.model.tiny import TINY_CONFIG

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
T_LIST = [1, 2, 3, 10, 17, 64, 170]
HIDDEN, Q_LORA, KV_LORA, ROPE, HEADS, NOPE = 7168, 1536, 512, 64, 8, 128


def rand(*shape, dtype=torch.bfloat16, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("d", [HIDDEN, Q_LORA, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rms_norm_is_the_add_then_invariant_rms_norm(d: int, dtype) -> None:
    x, r = rand(170, d, dtype=dtype, seed=1), rand(170, d, dtype=dtype, scale=4.0, seed=2)
    w = rand(d, dtype=dtype, seed=3)
    want_s, want_n = add_rms_norm_ref(x, r, w, 1e-6, rms_norm=invariant.rms_norm)
    s, n = fused.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, want_s) and torch.equal(n, want_n)
    bad = [
        t for t in T_LIST if not torch.equal(fused.add_rms_norm(x[:t], r[:t], w, 1e-6)[1], n[:t])
    ]
    assert bad == [], f"rows differ from the 170-row launch at T = {bad}"


def _rope_inputs(t: int, seed: int):
    ang = torch.rand(t, ROPE, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    ang = ang * 1000.0
    return ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)  # [T, P] each


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("t", [1, 10, 170])
def test_mla_rope_cache_is_the_unfused_latent_path(t: int, interleave: bool) -> None:
    q = rand(t, HEADS * (NOPE + ROPE), seed=4).view(t, HEADS, NOPE + ROPE)  # q_b_proj's output
    kv = rand(t, KV_LORA + ROPE, seed=5)  # kv_a_proj_with_mqa's output
    w = rand(KV_LORA, seed=6)
    cos, sin = _rope_inputs(t, 7)
    cache = rand(400, KV_LORA + ROPE, seed=8)  # [S, R + P] old contents
    slots = torch.randperm(400, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    slots = slots[:t]
    want_cache, got_cache = cache.clone(), cache.clone()
    want_q = mla_rope_cache_ref(
        q, kv, w, 1e-6, cos, sin, want_cache, slots, interleave, rms_norm=invariant.rms_norm
    )
    got_q = fused.mla_rope_cache(q, kv, w, 1e-6, cos, sin, got_cache, slots, interleave)
    assert torch.equal(got_q, want_q), "q_pe"
    assert torch.equal(got_cache, want_cache), "latent cache"


@pytest.mark.parametrize("inner", [2048, 256, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_is_torchs_silu_times_up(inner: int, dtype) -> None:
    gu = rand(170, 2 * inner, dtype=dtype, scale=3.0, seed=10)
    got = fused.silu_mul(gu)
    assert torch.equal(got, F.silu(gu[:, :inner]) * gu[:, inner:])
    assert torch.equal(got, silu_mul_ref(gu))
    assert torch.equal(fused.silu_mul(gu[:1]), got[:1])


def dense_tiny_model(device: str) -> DeepseekV3ForCausalLM:
    """The tiny architecture with 3 dense-MLP layers (no routed experts, so no MoE kernels to
    compile) and random bf16 weights."""
    cfg = ModelConfig.from_hf(dict(TINY_CONFIG, num_hidden_layers=3, first_k_dense_replace=3))
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, device=device)
        p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * p.shape[-1] ** -0.5)
    return model.eval()


def test_model_forward_is_bitwise_the_same_fused_or_not(monkeypatch) -> None:
    """The decoder's wiring (residual carried between layers, captured hidden states, latent
    cache, final norm) gives the unfused model's bits in batch-invariant bf16 on the GPU: a
    9-token prompt chunk, then one decode step."""
    model = dense_tiny_model("cuda")
    last = model.cfg.num_hidden_layers - 1
    ids = torch.tensor([5, 9, 33, 71, 2, 8, 100, 3, 4], device="cuda")
    pos = torch.arange(9, device="cuda")

    def run():
        cache = model.new_kv_cache(64)
        meta = make_meta([([], list(range(9)), None)]).to("cuda")
        out = model(ids, pos, cache, meta, capture_layers=(0, last))
        step_meta = make_meta([(list(range(9)), [20], None)]).to("cuda")
        step = model(ids[:1], pos[:1] + 9, cache, step_meta, capture_layers=(1,))
        return out.logits, out.hidden, step.logits, step.hidden, cache

    with backend.invariant_mode(True):
        fused_out = run()
        real = backend._triton_module
        no_fused = lambda name: None if name == "fused" else real(name)  # noqa: E731
        monkeypatch.setattr(backend, "_triton_module", no_fused)
        unfused_out = run()
    names = ["logits", "hidden", "step logits", "step hidden", "cache"]
    pairs = zip(names, fused_out, unfused_out, strict=True)
    assert [name for name, a, b in pairs if not torch.equal(a, b)] == []


def test_mla_down_projections_are_one_row_invariant_matmul() -> None:
    """q_a_proj and kv_a_proj_with_mqa as one matmul over their shared buffer (K2.6 widths):
    each row's outputs do not depend on the other rows, and they are the two separate matmuls'
    up to bf16 rounding (same K order, possibly other tiles)."""
    from ddserve.model.layers import Linear
    from ddserve.stacked import share_rows, stacked_rows

    q_a = Linear(HIDDEN, Q_LORA, torch.bfloat16, "cuda")
    kv_a = Linear(HIDDEN, KV_LORA + ROPE, torch.bfloat16, "cuda")
    share_rows(q_a, kv_a)
    with torch.no_grad():
        q_a.weight.copy_(rand(Q_LORA, HIDDEN, scale=HIDDEN**-0.5, seed=11))
        kv_a.weight.copy_(rand(KV_LORA + ROPE, HIDDEN, scale=HIDDEN**-0.5, seed=12))
    merged = stacked_rows(q_a.weight, kv_a.weight)
    x = rand(170, HIDDEN, seed=13)
    with backend.invariant_mode(True):
        both = backend.linear(x, merged)
        bad = [t for t in T_LIST if not torch.equal(backend.linear(x[:t], merged), both[:t])]
        apart = torch.cat([backend.linear(x, q_a.weight), backend.linear(x, kv_a.weight)], 1)
    assert bad == [], f"rows differ from the 170-row launch at T = {bad}"
    torch.testing.assert_close(both, apart, rtol=1.6e-2, atol=1e-3)
