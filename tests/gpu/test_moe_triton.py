"""Triton W4A16 MoE == the torch reference (`moe_ref`) on fresh random inputs (CUDA only)."""

from __future__ import annotations

import math

import pytest
import torch

from ddserve.kernels.moe_ref import ExpertWeights, moe_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need CUDA")

TOL = 1e-2  # bf16 operands (activations, dequantized weights, h) with fp32 accumulation


def random_int4_experts(e: int, h: int, i: int, gen: torch.Generator) -> ExpertWeights:
    """Random packed words (every int32 is a valid packing) and scales giving O(1) activations."""

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        words = torch.randint(
            -(2**31), 2**31 - 1, (e, rows, cols // 8), generator=gen, dtype=torch.int32
        )
        scale = (torch.rand(e, rows, cols // 32, generator=gen) + 0.5) / (4.6 * math.sqrt(cols))
        return words.cuda(), scale.to(torch.bfloat16).cuda()

    w13p, s13 = packed(2 * i, h)
    w2p, s2 = packed(h, i)
    return ExpertWeights(w13_packed=w13p, w13_scale=s13, w2_packed=w2p, w2_scale=s2)


def random_routing(t: int, e: int, k: int, gen: torch.Generator, only: int | None = None):
    """Top-k distinct experts per token (restricted to the first `only` experts if given)."""
    pool = only or e
    ids = torch.rand(t, pool, generator=gen).topk(k, dim=1).indices
    weights = torch.rand(t, k, generator=gen) * 2.5
    return ids.cuda(), weights.cuda()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(weights: ExpertWeights, t: int, k: int, seed: int, only=None, config=None) -> None:
    from ddserve.kernels.moe_triton import fused_moe

    gen = torch.Generator().manual_seed(seed)
    h = (weights.w13_packed if weights.is_int4 else weights.w13).shape[-1]
    h = h * 8 if weights.is_int4 else h
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = random_routing(t, weights.num_experts, k, gen, only)
    out = fused_moe(x, ids, tw, weights, config=config)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, moe_ref(x, ids, tw, weights)) < TOL


@pytest.mark.parametrize("t", [1, 10, 48, 200, 777])
def test_k26_rank_shape_int4(t):
    """K2.6 per rank at tp=8: 384 experts, hidden 7168, expert width 2048 / 8 = 256, top-8."""
    check(random_int4_experts(384, 7168, 256, torch.Generator().manual_seed(t)), t, 8, seed=t)


def test_k26_unsplit_expert_width():
    """Full expert width 2048 (fewer experts to keep the reference quick)."""
    check(random_int4_experts(16, 7168, 2048, torch.Generator().manual_seed(1)), 33, 8, seed=2)


@pytest.mark.parametrize("t", [1, 5, 37])
def test_odd_sizes(t):
    """Hidden and width that are not multiples of the K block (160, 96), 7 experts, top-3."""
    weights = random_int4_experts(7, 160, 96, torch.Generator().manual_seed(3))
    check(weights, t, 3, seed=t, config=dict(KW1=16, KW2=16, BN1=16, BN2=16))
    check(weights, t, 3, seed=t + 1)


def test_empty_experts_and_one_hot_expert():
    """Most experts get no token; one expert gets more tokens than a block holds."""
    weights = random_int4_experts(64, 512, 128, torch.Generator().manual_seed(4))
    check(weights, 40, 2, seed=5, only=3)
    check(weights, 300, 1, seed=6, only=1, config=dict(BM=16))


@pytest.mark.parametrize(
    "config",
    [dict(BM=16), dict(BM=32), dict(BM=64), dict(BN1=128, BN2=64), dict(SWAP=False), dict(KW1=64)],
)
def test_tile_configs(config):
    check(
        random_int4_experts(32, 1024, 256, torch.Generator().manual_seed(7)),
        64,
        4,
        8,
        config=config,
    )


@pytest.mark.parametrize("t", [1, 19, 130])
def test_dense_bf16_weights(t):
    gen = torch.Generator().manual_seed(t)
    e, h, i = 12, 384, 160
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / math.sqrt(h)).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, h, i, generator=gen) / math.sqrt(i)).to(torch.bfloat16).cuda()
    check(ExpertWeights(w13=w13, w2=w2), t, 4, seed=t + 10)


def test_backend_picks_triton_on_cuda():
    from ddserve.kernels import backend
    from ddserve.kernels.moe_triton import fused_moe

    assert backend.moe("cuda") is fused_moe or backend.moe("cuda").__module__.endswith("marlin")
