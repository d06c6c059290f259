"""Triton tree-verify MLA attention == `tree_mla_attention_ref` on fresh random inputs (CUDA)."""

from __future__ import annotations

import pytest
import torch
from _tree_inputs import ar_meta, random_meta, select_blocks

from ddserve.kernels.tree_attn import causal_mask, tree_mla_attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need CUDA")

TOL = 1e-2  # bf16 inputs, bf16 P @ V operands, fp32 softmax and accumulation
SCALE = 0.144680  # Kimi K2's softmax scale


def inputs(prefix_lens, q_lens, heads=8, seed=0, meta=None):
    """(q_latent, q_rope, kv, meta) on CUDA, bf16, K2.x widths."""
    gen = torch.Generator().manual_seed(seed)
    slots = sum(prefix_lens) + sum(q_lens) + 13
    meta = meta or random_meta(prefix_lens, q_lens, slots, seed)
    t = sum(q_lens)
    q_lat = torch.randn(t, heads, 512, generator=gen).to(torch.bfloat16).cuda()
    q_pe = torch.randn(t, heads, 64, generator=gen).to(torch.bfloat16).cuda()
    kv = torch.randn(slots, 576, generator=gen).to(torch.bfloat16).cuda()
    return q_lat, q_pe, kv, meta


def check(prefix_lens, q_lens, heads=8, seed=0, config=None, meta=None, invariant=False) -> None:
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    q_lat, q_pe, kv, meta = inputs(prefix_lens, q_lens, heads, seed, meta)
    meta = meta.to("cuda")
    out = tree_mla_attention(q_lat, q_pe, kv, meta, SCALE, config=config, invariant=invariant)
    ref = tree_mla_attention_ref(q_lat, q_pe, kv, meta, SCALE)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL, err


@pytest.mark.parametrize("prefix", [[0], [1], [777], [4100], [0, 1, 2000, 33]])
@pytest.mark.parametrize("invariant", [False, True])
def test_decode_q_len_1(prefix, invariant):
    check(prefix, [1] * len(prefix), seed=len(prefix), invariant=invariant)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("q_len", [1, 2, 9, 10, 17, 33, 64, 65, 100, 128, 129])
def test_tree_sizes(q_len, invariant):
    check([300], [q_len], seed=q_len, invariant=invariant)


@pytest.mark.parametrize("invariant", [False, True])
def test_mixed_batch_with_empty_prefix(invariant):
    check([0, 1500, 5, 9000, 0], [17, 129, 1, 65, 33], seed=3, invariant=invariant)


@pytest.mark.parametrize(
    "config",
    [dict(NSPLIT=1), dict(NSPLIT=3), dict(NSPLIT=7, BM=16, BN=16), dict(BM=32, BN=64), dict(BM=64)],
)
def test_split_and_tile_configs(config):
    check([2500, 40], [65, 9], seed=4, config=config)


@pytest.mark.parametrize("invariant", [False, True])
def test_causal_prefill_chunk(invariant):
    meta = random_meta([700], [100], 813, seed=5)
    meta = type(meta)(**{**meta.__dict__, "block_mask": causal_mask(100)[None]})
    check([700], [100], seed=5, meta=meta, invariant=invariant)


@pytest.mark.parametrize("invariant", [False, True])
def test_all_64_heads_unsplit(invariant):
    check([1000, 3], [17, 5], heads=64, seed=6, invariant=invariant)


@pytest.mark.parametrize("invariant", [False, True])
def test_long_prefix_32k(invariant):
    check([32768, 8192], [65, 1], seed=7, invariant=invariant)


# ---- invariant mode: bit-for-bit AR consistency and batch invariance (tensor-core math) -------
# Prefixes and trees around the key tiles (32) and splits (256) of the invariant configuration.
AR_CASES = [
    ([0], [1]),
    ([0], [65]),
    ([31], [2]),
    ([63], [17]),
    ([64], [33]),
    ([255], [40]),
    ([500], [20]),
    ([512], [1]),
    ([1000], [129]),
    ([1023], [9]),
    ([1024], [2]),
    ([2047], [65]),
    ([4100], [64]),
    ([9000], [129]),
    ([0, 1500, 5, 9000, 0], [17, 129, 1, 65, 33]),
]


def _diff_report(a: torch.Tensor, b: torch.Tensor) -> dict:
    bad = (a != b).any(-1).any(-1)  # [T]
    return dict(bad_rows=int(bad.sum()), rows=a.shape[0], max_diff=(a - b).abs().max().item())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", AR_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_invariant_tree_rows_equal_ar_rows(case, causal, config=None):
    """Each verify row == the row of the same token decoded autoregressively (q_len 1 with its
    path in the prefix), bit for bit; the AR rows batched together, as the engine would."""
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    pls, qls = case
    q_lat, q_pe, kv, meta = inputs(pls, qls, seed=sum(pls) + sum(qls))
    if causal:
        q_max = meta.block_mask.shape[1]
        mask = torch.stack([causal_mask(q_max) for _ in qls])  # prefill chunks
        meta = type(meta)(**{**meta.__dict__, "block_mask": mask})
    kw = dict(invariant=True, config=config)
    tree = tree_mla_attention(q_lat, q_pe, kv, meta.to("cuda"), SCALE, **kw)
    ar = tree_mla_attention(q_lat, q_pe, kv, ar_meta(meta).to("cuda"), SCALE, **kw)
    rep = _diff_report(tree, ar)
    print(config, case, "causal" if causal else "tree", rep)
    assert rep["bad_rows"] == 0, rep


def test_invariant_rows_do_not_depend_on_the_batch(config=None):
    """A stream's rows alone == in the batch == in other batches (other shapes, orders)."""
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    pls, qls = [0, 1500, 5, 9000, 0, 63], [17, 129, 1, 65, 33, 1]
    q_lat, q_pe, kv, meta = inputs(pls, qls, seed=11)
    kw = dict(invariant=True, config=config)
    full = tree_mla_attention(q_lat, q_pe, kv, meta.to("cuda"), SCALE, **kw)
    reps = {}
    for blocks in ([0], [1], [2], [3], [4], [5], [3, 0], [5, 2, 1], [4, 3, 2, 1, 0]):
        sub, rows = select_blocks(meta, blocks)
        rows = rows.cuda()
        part = tree_mla_attention(q_lat[rows], q_pe[rows], kv, sub.to("cuda"), SCALE, **kw)
        reps[str(blocks)] = _diff_report(part, full[rows])
    print(config, reps)
    assert all(r["bad_rows"] == 0 for r in reps.values()), reps


@pytest.mark.parametrize(
    "case",
    [([1000], [17]), ([0, 1500, 5], [17, 1, 65]), ([8000] * 10, [1] * 10)],
    ids=["one-tree", "mixed", "decode-10"],
)
def test_invariant_rows_do_not_depend_on_the_row_tile_height(case):
    """Small calls take 16-row tiles, large ones 32: a row's bits must be the same in both."""
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    pls, qls = case
    q_lat, q_pe, kv, meta = inputs(pls, qls, seed=len(pls) + sum(qls))
    meta = meta.to("cuda")
    outs = {bm: tree_mla_attention(q_lat, q_pe, kv, meta, SCALE, invariant=True,
                                   config=dict(BM=bm)) for bm in (16, 32)}  # fmt: skip
    auto = tree_mla_attention(q_lat, q_pe, kv, meta, SCALE, invariant=True)
    reps = {bm: _diff_report(o, outs[16]) for bm, o in outs.items()}
    reps["auto"] = _diff_report(auto, outs[16])
    assert all(r["bad_rows"] == 0 for r in reps.values()), reps


@pytest.mark.parametrize(
    "case",
    [([1000], [1]), ([1000], [17]), ([0, 1500, 5], [17, 1, 65]), ([8000] * 10, [1] * 10)],
    ids=["decode", "one-tree", "mixed", "decode-10"],
)
def test_invariant_rows_do_not_depend_on_the_keys_per_program(case):
    """Small calls give each program one key tile (the merge folds a group's tiles), others a
    whole group of tiles: a row's bits must be the same either way."""
    from ddserve.kernels.tree_attn_invariant import device_config
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    pls, qls = case
    q_lat, q_pe, kv, meta = inputs(pls, qls, seed=len(pls) + sum(qls) + 1)
    meta = meta.to("cuda")
    cfg = device_config(q_lat.device)
    outs = {part: tree_mla_attention(q_lat, q_pe, kv, meta, SCALE, invariant=True,
                                     config=dict(PART=part))
            for part in (cfg["BN"], cfg["SPLIT"])}  # fmt: skip
    outs["auto"] = tree_mla_attention(q_lat, q_pe, kv, meta, SCALE, invariant=True)
    reps = {part: _diff_report(o, outs[cfg["SPLIT"]]) for part, o in outs.items()}
    assert all(r["bad_rows"] == 0 for r in reps.values()), reps


def test_invariant_mode_accurate_across_tiles_and_splits():
    """The invariant configuration: accurate, AR rows bitwise on trees and a causal chunk whose
    tail spans several splits."""
    checks = [
        lambda: check([2047, 5, 600], [65, 1, 9], seed=8, invariant=True),
        lambda: test_invariant_tree_rows_equal_ar_rows(([0, 1023, 300], [33, 9, 2]), False),
        lambda: test_invariant_tree_rows_equal_ar_rows(([2100], [129]), False),
        lambda: test_invariant_tree_rows_equal_ar_rows(([1000, 40], [129, 300]), True),
    ]
    failed = []
    for i, fn in enumerate(checks):  # run all, report every failure
        try:
            fn()
        except AssertionError as e:
            failed.append(f"check {i}: {str(e)[:300]}")
    assert not failed, failed
