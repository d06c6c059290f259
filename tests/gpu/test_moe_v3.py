"""MoE v3 (Gluon, `kernels/moe_v3.py`) beyond the shared paths of `test_moe_triton.py`: thread
layouts give the same bits, it is the default, the model's experts are rewritten in place, calls
past the 1024-token chunk, and SiLU-and-mul in the up launch (FUSED_SILU) gives the two-launch
bits, eager and in replayed CUDA graphs (CUDA only)."""

from __future__ import annotations

import pytest
import torch
from test_moe_triton import TOL, k26_experts, random_routing, rel_err

from ddserve.kernels.moe_ref import ExpertWeights, moe_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels need CUDA")


def test_v3_thread_layout_configs_are_bitwise_the_default():
    """v3's BM, NT, DEPTH, NREP and W only change which threads compute which outputs, not any
    sum's order (that is why BM and NT may be picked per call): at fixed SPLIT every such config
    gives the default's bits, at T = 1, 48, 200 (K2.6 shapes). Every pair is printed first."""
    from ddserve.kernels.moe_triton import fused_moe

    w = k26_experts()
    gen = torch.Generator().manual_seed(21)
    configs = [dict(BM=8), dict(BM=16), dict(BM=32), dict(NT=1), dict(NT=2), dict(NT=8),
               dict(DEPTH=2), dict(BM=8, DEPTH=2), dict(NREP=1), dict(NREP=4),
               dict(W=8, NREP=1), dict(UNROLL=False), dict(UNROLL=True, BM=16),
               dict(UNROLL=True, DEPTH=2, BM=8), dict(PFA=0), dict(PFA=2, BM=8, UNROLL=True),
               dict(PFA=3), dict(PFA=2, BM=16), dict(PFA=4, UNROLL=False)]  # fmt: skip
    bad = []
    for t in (1, 48, 200):
        x = torch.randn(t, 7168, generator=gen).to(torch.bfloat16).cuda()
        ids, tw = random_routing(t, 384, 8, gen)
        ref = fused_moe(x, ids, tw, w, config={"variant": "v3"})
        for c in configs:
            out = fused_moe(x, ids, tw, w, config={"variant": "v3", **c})
            diff = (out.float() - ref.float()).abs().max().item()
            line = f"T={t} {c}: equal {torch.equal(out, ref)} max diff {diff:.3e}"
            print(line)
            if not torch.equal(out, ref):
                bad.append(line)
    assert not bad, "\n".join(bad)


def test_default_variant_is_v3_for_int4_on_cuda():
    """No variant named: INT4 weights with bf16 scales on CUDA run v3 (bitwise the explicit call);
    V3_ERROR stays None (no fallback to v2 happened)."""
    from ddserve.kernels import moe_triton
    from ddserve.kernels.moe_triton import default_variant, fused_moe

    w = k26_experts()
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(30, 7168, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = random_routing(30, 384, 8, gen)
    assert default_variant(x, w) == "v3"
    out = fused_moe(x, ids, tw, w, invariant=True)
    assert moe_triton.V3_ERROR is None
    assert torch.equal(out, fused_moe(x, ids, tw, w, config={"variant": "v3"}))


def test_v3_in_place_repack_is_the_copy_path_without_the_copy():
    """The model's experts (`repack_in_place=True`, K2.6 shapes): v3 overwrites them with its
    stream (allocated memory does not grow by the ~1.2 GB a copy takes), gives bitwise the copy
    path's output, the torch reference still reads them (decoding), and v2 refuses them."""
    from ddserve.kernels.moe_triton import fused_moe
    from ddserve.kernels.moe_w4_repack import in_place_config

    src = k26_experts()
    w = ExpertWeights(
        w13_packed=src.w13_packed.clone(), w13_scale=src.w13_scale.clone(),
        w2_packed=src.w2_packed.clone(), w2_scale=src.w2_scale.clone(), repack_in_place=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(40, 7168, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = random_routing(40, 384, 8, gen)
    copy_out = fused_moe(x, ids, tw, src, config={"variant": "v3"})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fused_moe(x, ids, tw, w, invariant=True)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    print(f"in-place: allocated grew {grown / 2**20:.1f} MiB; equal to copy path "
          f"{torch.equal(out, copy_out)}")  # fmt: skip
    assert in_place_config(w.w13_packed) == (4, 2) and in_place_config(w.w2_packed) == (4, 2)
    assert grown < 256 * 2**20
    assert torch.equal(out, copy_out)
    assert torch.equal(fused_moe(x, ids, tw, w), out)  # later calls reuse the stream
    few = ids[:3] % 8  # the reference decodes experts 0..7 only (fast)
    assert rel_err(moe_ref(x[:3], few, tw[:3], w), moe_ref(x[:3], few, tw[:3], src)) == 0.0
    with pytest.raises(RuntimeError, match="repacked in place"):
        fused_moe(x, ids, tw, w, config={"variant": "v2"}, invariant=True)


def test_v3_past_one_chunk():
    """T = 1500 > CHUNK (1024): two launch sets; the rows equal the reference and, bitwise, the
    two halves computed by separate calls (per-token invariance across the chunk boundary)."""
    from ddserve.kernels.moe_triton import fused_moe

    w = k26_experts()
    gen = torch.Generator().manual_seed(24)
    x = torch.randn(1500, 7168, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = random_routing(1500, 384, 8, gen)
    out = fused_moe(x, ids, tw, w, config={"variant": "v3"})
    assert rel_err(out, moe_ref(x, ids, tw, w)) < TOL
    halves = [fused_moe(x[a:b], ids[a:b], tw[a:b], w, config={"variant": "v3"})
              for a, b in ((0, 700), (700, 1500))]  # fmt: skip
    assert torch.equal(out, torch.cat(halves))


def test_v3_rejects_unknown_config_keys():
    from ddserve.kernels.moe_triton import fused_moe

    w = k26_experts()
    x = torch.zeros(1, 7168, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(1, 8, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="BN2"):
        fused_moe(x, ids, torch.ones(1, 8, device="cuda"), w, config={"variant": "v3", "BN2": 32})


def test_moe_layer_folds_the_combine_into_the_shared_down_matmul():
    """`MoE.forward` on CUDA in batch-invariant mode: the first call runs v3 with its combine
    launch (and repacks the experts in place); later calls of up to PAIRS_MAX_TOKENS tokens
    take the pair outputs (`backend.moe_pairs`) and sum them in the shared expert's down
    matmul. Either way the bits are those of the separate launches, at 1, 10, 17 and 170
    tokens (K2.6 rank shapes at tp = 8, random weights)."""
    from ddserve.config import ModelConfig
    from ddserve.distributed import LocalComm
    from ddserve.kernels import backend
    from ddserve.kernels.config import KernelConfig
    from ddserve.kernels.fused import silu_mul
    from ddserve.kernels.invariant import linear
    from ddserve.kernels.moe_triton import PAIRS_MAX_TOKENS
    from ddserve.model.moe import MoE

    quant = dict(quant_method="compressed-tensors", format="pack-quantized", config_groups=dict(
        group_0=dict(targets=["Linear"], weights=dict(num_bits=4, type="int", symmetric=True,
                     group_size=32, strategy="group"))))  # fmt: skip
    cfg = ModelConfig.from_hf(dict(
        model_type="kimi_k2", vocab_size=1024, hidden_size=7168, intermediate_size=2304,
        moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=8,
        n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid",
        topk_method="noaux_tc", num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        quantization_config=quant,
    ))  # fmt: skip
    layer = MoE(cfg, LocalComm(), torch.bfloat16, "cuda")
    w = k26_experts()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            getattr(layer.experts, name).copy_(getattr(w, name))
        for p in (*layer.shared_experts.parameters(), layer.gate.weight):
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        layer.gate.e_score_correction_bias.zero_()
    host = torch.Generator().manual_seed(23)
    with backend.kernel_mode(KernelConfig(batch_invariant=True)):
        for t in (1, 10, 17, 170):
            x = torch.randn(t, 7168, generator=host).to(torch.bfloat16).cuda()
            ids, tw = layer.gate(x)
            experts = layer.experts.weights()
            combined = backend.moe("cuda")(x, ids, tw, experts)  # (the first call repacks)
            pairs = backend.moe_pairs(x, ids, tw, experts)
            assert (pairs is not None) == (t <= PAIRS_MAX_TOKENS), t
            mlp = layer.shared_experts
            gu = linear(x, mlp.gate_up_weight())
            want = linear(silu_mul(gu), mlp.down_proj.weight, combined)
            assert torch.equal(layer(x), want), t


def test_one_token_without_alignment_equals_its_row_in_a_batch():
    """A one-token call skips the expert alignment (one block per slot, in slot order); its
    output is bitwise the token's row in calls of 2 and 5 tokens, which align (K2.6 shapes)."""
    from ddserve.kernels.moe_triton import fused_moe

    w = k26_experts()
    gen = torch.Generator().manual_seed(24)
    x = torch.randn(5, 7168, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = random_routing(5, 384, 8, gen)
    five = fused_moe(x, ids, tw, w, config={"variant": "v3"})
    two = fused_moe(x[3:], ids[3:], tw[3:], w, config={"variant": "v3"})
    for t in range(5):
        one = fused_moe(x[t : t + 1], ids[t : t + 1], tw[t : t + 1], w, config={"variant": "v3"})
        assert torch.equal(one, five[t : t + 1]), t
        if t >= 3:
            assert torch.equal(one, two[t - 3 : t - 2]), t


FUSED = dict(FUSED_SILU=True)
TWO_LAUNCH = dict(FUSED_SILU=False)
FUSED_TOKENS = [1, 2, 10, 17, 170]


@pytest.fixture(scope="module")
def k26():
    """K2.6 rank experts, made (and repacked for v3) once for the fused-SiLU tests."""
    return k26_experts()


def _routed(t: int, gen: torch.Generator):
    x = torch.randn(t, 7168, generator=gen).to(torch.bfloat16).cuda()
    return (x, *random_routing(t, 384, 8, gen))


def _assert_tickets_clean() -> None:
    from ddserve.kernels import moe_v3

    for tickets in moe_v3._TICKETS.values():
        for buf in (tickets.live, *tickets.retired):
            assert buf is None or not bool(buf.any()), "a ticket was left non-zero"


@pytest.mark.parametrize("t", FUSED_TOKENS)
def test_fused_silu_is_bitwise_the_two_launch_path(k26, t):
    """FUSED_SILU (SiLU-and-mul by the last program of each unit of the up launch) gives the
    two-launch path's bits: the MoE output and, with combine=False, every pair's output (K2.6
    rank shapes, eager). Every ticket is back to 0 afterwards."""
    from ddserve.kernels import moe_v3
    from ddserve.kernels.moe_v3 import fused_moe_v3

    x, ids, tw = _routed(t, torch.Generator().manual_seed(300 + t))
    for combine in (True, False):
        two = fused_moe_v3(x, ids, tw, k26, config=TWO_LAUNCH, combine=combine)
        assert moe_v3.LAST_LAUNCH["up"]["fused_silu"] is False
        fused = fused_moe_v3(x, ids, tw, k26, config=FUSED, combine=combine)
        assert moe_v3.LAST_LAUNCH["up"]["fused_silu"] is True
        diff = (fused.float() - two.float()).abs().max().item()
        print(f"T={t} combine={combine}: equal {torch.equal(fused, two)} max diff {diff:.3e}")
        assert torch.equal(fused, two), (t, combine)
        again = fused_moe_v3(x, ids, tw, k26, config=FUSED, combine=combine)
        assert torch.equal(again, fused), (t, combine)
    torch.cuda.synchronize()
    _assert_tickets_clean()


def test_fused_silu_is_bitwise_the_two_launch_path_for_every_tile_config(k26):
    """Other tiles change the unit size (BN = 16 W NREP: 64, 128, 256 columns), the rows per
    unit (BM) and the arrivals per unit (2 SPLIT); at each, fused and two-launch agree bitwise
    (T = 48, K2.6 shapes; SPLIT 8 and 2 give other sums than the default, at both)."""
    from ddserve.kernels import moe_v3
    from ddserve.kernels.moe_v3 import fused_moe_v3

    x, ids, tw = _routed(48, torch.Generator().manual_seed(31))
    configs = [dict(BM=8), dict(BM=16), dict(BM=32), dict(DEPTH=2), dict(NREP=1),
               dict(NREP=4), dict(W=8, NREP=1), dict(SPLIT=8), dict(SPLIT=2)]  # fmt: skip
    bad = []
    for c in configs:
        two = fused_moe_v3(x, ids, tw, k26, config={**c, **TWO_LAUNCH})
        fused = fused_moe_v3(x, ids, tw, k26, config={**c, **FUSED})
        assert moe_v3.LAST_LAUNCH["up"]["fused_silu"] is True, c
        print(f"{c}: equal {torch.equal(fused, two)} launch {moe_v3.LAST_LAUNCH['up']}")
        if not torch.equal(fused, two):
            bad.append(str(c))
    assert not bad, bad
    torch.cuda.synchronize()
    _assert_tickets_clean()


@pytest.mark.parametrize("t", FUSED_TOKENS)
def test_fused_silu_in_a_cuda_graph_replays_bitwise(k26, t):
    """A captured step of two fused MoE calls (pair outputs, then the combined output: two up
    launches sharing the tickets back to back, as consecutive layers do), replayed twice on
    new inputs: each replay equals the eager two-launch path on those inputs, and an eager
    fused call between the replays (the same tickets outside the graph) does too."""
    from ddserve.kernels.moe_v3 import fused_moe_v3

    gen = torch.Generator().manual_seed(400 + t)
    x, ids, tw = _routed(t, gen)

    def step():
        pairs = fused_moe_v3(x, ids, tw, k26, config=FUSED, combine=False)
        return pairs, fused_moe_v3(x, ids, tw, k26, config=FUSED)

    side = torch.cuda.Stream()  # warm-up outside the capture (one-token blocks, tickets)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pairs, out = step()
    for replay in range(2):
        new_x, new_ids, new_tw = _routed(t, gen)
        x.copy_(new_x)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        graph.replay()
        want_pairs = fused_moe_v3(new_x, new_ids, new_tw, k26, config=TWO_LAUNCH, combine=False)
        want = fused_moe_v3(new_x, new_ids, new_tw, k26, config=TWO_LAUNCH)
        eager = fused_moe_v3(new_x, new_ids, new_tw, k26, config=FUSED)
        torch.cuda.synchronize()
        same = [torch.equal(pairs, want_pairs), torch.equal(out, want), torch.equal(eager, want)]
        print(f"T={t} replay {replay}: pairs, output, eager fused equal {same}")
        assert torch.equal(pairs, want_pairs), (t, replay)
        assert torch.equal(out, want), (t, replay)
        assert torch.equal(eager, want), (t, replay)
    _assert_tickets_clean()


@pytest.mark.parametrize("t", [1, 10, 170])
def test_bf16_pairs_are_the_fp32_pairs_rounded_once(k26, t):
    """PAIRS "bf16" (the default) stores each weighted pair output rounded once (to nearest even)
    from the fp32 value that PAIRS "fp32" stores: bitwise the fp32 pairs cast to bf16. The
    combine sums either in fp32 in slot order (`invariant_ref.combine_ref`), and the bf16
    path's output stays within the kernels' tolerance of the reference (K2.6 rank shapes)."""
    from ddserve.kernels.invariant_ref import combine_ref
    from ddserve.kernels.moe_v3 import CONFIG, fused_moe_v3

    assert CONFIG["PAIRS"] == "bf16"
    x, ids, tw = _routed(t, torch.Generator().manual_seed(500 + t))
    p16 = fused_moe_v3(x, ids, tw, k26, combine=False)
    p32 = fused_moe_v3(x, ids, tw, k26, config=dict(PAIRS="fp32"), combine=False)
    assert p16.dtype == torch.bfloat16 and p32.dtype == torch.float32
    assert torch.equal(p16, p32.to(torch.bfloat16)), t
    out16 = fused_moe_v3(x, ids, tw, k26)
    out32 = fused_moe_v3(x, ids, tw, k26, config=dict(PAIRS="fp32"))
    assert torch.equal(out16, combine_ref(p16, 8, x.dtype)), t
    assert torch.equal(out32, combine_ref(p32, 8, x.dtype)), t
    few = slice(0, min(t, 3))  # the reference decodes every expert it touches (slow): 3 tokens
    ref = moe_ref(x[few], ids[few], tw[few], k26)
    err16, err32 = rel_err(out16[few], ref), rel_err(out32[few], ref)
    print(f"T={t}: rel err vs reference, bf16 pairs {err16:.2e}, fp32 pairs {err32:.2e}; "
          f"outputs differ in {(out16 != out32).float().mean().item():.2%} of values")  # fmt: skip
    assert err16 < TOL and err32 < TOL
