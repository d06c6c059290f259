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


@pytest.mark.parametrize("bm", [8, 16])
def test_one_token_blocks_hold_the_aligned_pairs_in_slot_order(bm: int) -> None:
    """One token skips the alignment: its k blocks hold the same (expert, pair) sets as
    `align_by_expert`'s, one pair in each block's first row, padding (P = k) elsewhere, in slot
    order instead of expert order."""
    import torch

    from ddserve.kernels.moe_align import align_by_expert

    ids = torch.tensor([[17, 3, 250, 99, 0, 383, 42, 7]])  # [1, k]: distinct experts
    k = ids.shape[1]
    pairs, experts = moe_v3._one_token_blocks(ids, bm)
    assert pairs.dtype == torch.int64 and pairs.shape == (k * bm,)
    assert experts.tolist() == ids[0].tolist()  # block j: slot j's expert
    rows = pairs.view(k, bm)
    assert rows[:, 0].tolist() == list(range(k)) and bool((rows[:, 1:] == k).all())
    ref_pairs, ref_experts = align_by_expert(ids, 384, bm)
    ref = {
        int(e): sorted(int(p) for p in ref_pairs.view(-1, bm)[b] if p < k)
        for b, e in enumerate(ref_experts) if e < 384
    }  # fmt: skip
    assert {int(e): [j] for j, e in enumerate(ids[0])} == ref
    assert moe_v3._one_token_blocks(ids, bm)[0] is pairs  # made once, kept (graphs hold it)


def test_pair_outputs_are_refused_past_one_chunk() -> None:
    """combine=False returns the per-pair buffer that CHUNK bounds: a longer call is refused
    (before anything runs)."""
    import torch

    from ddserve.kernels.moe_ref import ExpertWeights

    t = moe_v3.CHUNK + 1
    weights = ExpertWeights(w13_packed=torch.zeros(1, 2, 1, dtype=torch.int32),
                            w13_scale=torch.zeros(1, 2, 1, dtype=torch.bfloat16))  # fmt: skip
    args = (torch.zeros(t, 8), torch.zeros(t, 2, dtype=torch.long), torch.ones(t, 2), weights)
    with pytest.raises(ValueError, match=f"at most {moe_v3.CHUNK} tokens"):
        moe_v3.fused_moe_v3(*args, combine=False)
    with pytest.raises(RuntimeError, match="CUDA GPUs only"):  # with its combine: chunked
        moe_v3.fused_moe_v3(*args)
