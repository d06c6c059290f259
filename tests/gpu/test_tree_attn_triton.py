"""Triton tree-verify MLA attention == `tree_mla_attention_ref` on fresh random inputs (CUDA)."""

from __future__ import annotations

import pytest
import torch
from _tree_inputs import random_meta

from ddserve.kernels.tree_attn import causal_mask, tree_mla_attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need CUDA")

TOL = 1e-2  # bf16 inputs, bf16 P @ V operands, fp32 softmax and accumulation
SCALE = 0.144680  # Kimi K2's softmax scale


def check(prefix_lens, q_lens, heads=8, seed=0, config=None, meta=None) -> None:
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    gen = torch.Generator().manual_seed(seed)
    slots = sum(prefix_lens) + sum(q_lens) + 13
    meta = (meta or random_meta(prefix_lens, q_lens, slots, seed)).to("cuda")
    t = sum(q_lens)
    q_lat = torch.randn(t, heads, 512, generator=gen).to(torch.bfloat16).cuda()
    q_pe = torch.randn(t, heads, 64, generator=gen).to(torch.bfloat16).cuda()
    kv = torch.randn(slots, 576, generator=gen).to(torch.bfloat16).cuda()
    out = tree_mla_attention(q_lat, q_pe, kv, meta, SCALE, config=config)
    ref = tree_mla_attention_ref(q_lat, q_pe, kv, meta, SCALE)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL, err


@pytest.mark.parametrize("prefix", [[0], [1], [777], [4100], [0, 1, 2000, 33]])
def test_decode_q_len_1(prefix):
    check(prefix, [1] * len(prefix), seed=len(prefix))


@pytest.mark.parametrize("q_len", [1, 2, 9, 10, 17, 33, 64, 65, 100, 128, 129])
def test_tree_sizes(q_len):
    check([300], [q_len], seed=q_len)


def test_mixed_batch_with_empty_prefix():
    check([0, 1500, 5, 9000, 0], [17, 129, 1, 65, 33], seed=3)


@pytest.mark.parametrize(
    "config",
    [dict(NSPLIT=1), dict(NSPLIT=3), dict(NSPLIT=7, BM=16, BN=16), dict(BM=32, BN=64), dict(BM=64)],
)
def test_split_and_tile_configs(config):
    check([2500, 40], [65, 9], seed=4, config=config)


def test_causal_prefill_chunk():
    meta = random_meta([700], [100], 813, seed=5)
    meta = type(meta)(**{**meta.__dict__, "block_mask": causal_mask(100)[None]})
    check([700], [100], seed=5, meta=meta)


def test_all_64_heads_unsplit():
    check([1000, 3], [17, 5], heads=64, seed=6)


def test_long_prefix_32k():
    check([32768, 8192], [65, 1], seed=7)
