"""Host-side choices of the MoE v3 (`kernels/moe_v3.py`) that need no GPU: per-call tiles and the
config check. The kernel itself is tested on the GPU (`tests/gpu/test_moe_v3.py`)."""

from __future__ import annotations

import pytest

from ddserve.kernels import moe_v3


def test_tokens_per_block_follow_tokens_per_expert() -> None:
    assert moe_v3.pick_bm(8, 384) == 8  # one decode token, top-8
    assert moe_v3.pick_bm(192 * 8, 384) == 8  # 4 tokens per expert
    assert moe_v3.pick_bm(288 * 8, 384) == 8  # 6
    assert moe_v3.pick_bm(384 * 8, 384) == 16  # 8
    assert moe_v3.pick_bm(768 * 8, 384) == 16  # 16


def test_down_tiles_per_program_keep_two_programs_per_sm() -> None:
    # K2.6 down projection: 7168 rows = 56 tiles of 128
    assert moe_v3.pick_nt(56, 8, 132) == 1  # T = 1: 8 blocks, 448 programs at 1 tile each
    assert moe_v3.pick_nt(56, 12, 132) == 2  # 336 programs at 2 tiles
    assert moe_v3.pick_nt(56, 300, 132) == 4
    assert moe_v3.pick_nt(57, 300, 132) == 1  # 4 and 2 do not divide the tiles


def test_config_keys_and_values_are_checked() -> None:
    assert moe_v3._config(None) == moe_v3.CONFIG
    assert moe_v3._config({"BM": 16})["BM"] == 16
    with pytest.raises(ValueError, match="unknown keys"):
        moe_v3._config({"BN2": 32})
    with pytest.raises(ValueError, match="BM=12"):
        moe_v3._config({"BM": 12})
    with pytest.raises(ValueError, match="W=3"):
        moe_v3._config({"W": 3})


def test_cpu_tensors_get_a_clear_error() -> None:
    import torch

    from ddserve.kernels.moe_ref import ExpertWeights, quantize_int4

    p13, s13 = quantize_int4(torch.randn(2, 256, 128).to(torch.bfloat16))
    p2, s2 = quantize_int4(torch.randn(2, 128, 128).to(torch.bfloat16))
    w = ExpertWeights(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="CUDA"):
        moe_v3.fused_moe_v3(x, torch.tensor([[0], [1]]), torch.ones(2, 1), w)
