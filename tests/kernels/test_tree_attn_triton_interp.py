"""Triton tree attention on the CPU (Triton interpreter, tiny shapes): matches the reference, and
the invariant mode is AR-consistent and batch-invariant bit for bit.

The kernels run in one subprocess with TRITON_INTERPRET=1 (it must be set before triton is
imported); that process runs this file as a script and prints one JSON line of check results.
The interpreter is patched there (tests/triton_interp.py, test-side only): loop bounds loaded from
memory, `tl.dot` on bf16, and a `tl.dot` whose every element gets the same arithmetic wherever its
row sits in the tile (numpy's BLAS does not on AVX2 CPUs), so the bitwise claims test the kernel's
own promise on any CPU; the GPU test repeats them for tensor-core math. torch.empty returns
NaN-filled memory there, so an output row or a partial the kernels leave unwritten shows up; an
unwritten lse would not (the merge's max and its `lse > -inf` pass over NaN, as an empty split),
so one check fills the scratch with a finite value instead.

Most checks share one batch (`_mixed`, computed once): 2 heads, 16-row tiles, 16-key tiles,
32-key splits, blocks whose keys fill 1, 2, 3 and all 4 of the call's splits (a block without
prefix, a decode row alone in its last split, a tree whose tail crosses a split), and rows in no
block (a gap and a tail). It is float32, so that every bit of the fp32 split merge reaches the
output (a bf16 output hides most last-bit differences); the other AR cases are bfloat16.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path

import pytest

from tests.triton_interp import interpreter_results, patch_interpreter, require_triton, run_cases

require_triton()
ROOT = Path(__file__).resolve().parents[2]
R, P, SCALE = 128, 16, 0.144680
SMALL = dict(BM=16, BN=16, SPLIT=32)  # 2 key tiles per split: tiles and splits crossed cheaply
MIXED = ([20, 0, 64, 90, 27], [5, 4, 1, 8, 6])  # prefixes, trees: 25 / 4 / 65 / 98 / 33 keys
GAP, TAIL = 2, 3  # rows in no block: before block 2, after the last


def _case(pls, qls, heads, seed, dtype):
    """(q, qp, kv, meta) of blocks laid end to end, random values in `dtype` (a string)."""
    import torch
    from _tree_inputs import random_meta

    slots = sum(pls) + sum(qls) + 3
    meta = random_meta(pls, qls, slots, seed=seed)
    gen, dt, t = torch.Generator().manual_seed(seed), getattr(torch, dtype), sum(qls)
    q = torch.randn(t, heads, R, generator=gen).to(dt)  # [T, H, R]
    qp = torch.randn(t, heads, P, generator=gen).to(dt)  # [T, H, P]
    kv = torch.randn(slots, R + P, generator=gen).to(dt)  # [S, R+P]
    return q, qp, kv, meta


def _with_rows_in_no_block(q, qp, meta, before: int, gap: int, tail: int):
    """q, qp, meta with `gap` rows in no block before block `before` and `tail` after the last
    (random queries), and where each original row went."""
    import torch

    n = len(q)
    rows = torch.arange(n) + gap * (torch.arange(n) >= int(meta.q_starts[before]))  # [T]
    slots = torch.zeros(n + gap + tail, dtype=meta.block_slots.dtype)
    slots[rows] = meta.block_slots
    starts = meta.q_starts + gap * (torch.arange(meta.num_blocks) >= before)
    meta = type(meta)(**{**meta.__dict__, "q_starts": starts, "block_slots": slots})
    gen = torch.Generator().manual_seed(n)
    q2 = torch.randn(n + gap + tail, *q.shape[1:], generator=gen).to(q.dtype)  # [T', H, R]
    qp2 = torch.randn(n + gap + tail, *qp.shape[1:], generator=gen).to(qp.dtype)  # [T', H, P]
    q2[rows], qp2[rows] = q, qp
    return q2, qp2, meta, rows


def _attn(q, qp, kv, meta, config=SMALL):
    from ddserve.kernels.tree_attn_invariant import tree_mla_attention_invariant

    return tree_mla_attention_invariant(q, qp, kv, meta, SCALE, config)


@contextlib.contextmanager
def _floats_from_empty_filled_with(value: float):
    """torch.empty / torch.empty_like return floating tensors filled with `value`."""
    import torch

    empty, empty_like = torch.empty, torch.empty_like

    def filled(t):
        return t.fill_(value) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: filled(empty(*a, **k))
    torch.empty_like = lambda *a, **k: filled(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@functools.cache
def _mixed():
    """The shared batch: (q, qp, kv, meta) with rows in no block, the meta without them, where
    its rows went, and the invariant kernel's output."""
    q, qp, kv, meta = _case(*MIXED, heads=2, seed=1, dtype="float32")
    q2, qp2, padded, rows = _with_rows_in_no_block(q, qp, meta, 2, GAP, TAIL)
    return q2, qp2, kv, padded, meta, rows, _attn(q2, qp2, kv, padded)


@functools.cache
def _ar_pair(case: str):
    """(tree rows, their AR decode twins, the twins' (q, qp, kv, meta))."""
    from _tree_inputs import ar_meta

    heads, pls, qls, seed, config, dtype = AR_CASES[case]
    if case == "mixed":
        q, qp, kv, _, meta, rows, out = _mixed()
        tree, q, qp = out[rows], q[rows], qp[rows]
    else:
        q, qp, kv, meta = _case(pls, qls, heads, seed, dtype)
        tree = _attn(q, qp, kv, meta, config)
    ar = ar_meta(meta)
    return tree, _attn(q, qp, kv, ar, config), (q, qp, kv, ar)


AR_CASES = {  # heads, prefix lengths, tree lengths, seed, config (None: the device's), dtype
    "mixed": (2, *MIXED, 1, SMALL, "float32"),  # the twins: decode rows over 1 to 4 splits
    # 2 tokens per 16-row tile; an 18-row tree: its mask rows span two 16-token chunks
    "8_heads": (8, [40, 3], [18, 2], 2, SMALL, "bfloat16"),
    "default_config": (2, [270], [5], 3, None, "bfloat16"),  # 32-key tiles, 256-key splits
}


def check_invariant_mode_matches_the_reference():
    import torch

    from ddserve.kernels.tree_attn import tree_mla_attention_ref

    q, qp, kv, meta, *_, out = _mixed()
    ref = tree_mla_attention_ref(q.float(), qp.float(), kv.float(), meta, SCALE)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def check_default_mode_matches_the_reference():
    from ddserve.kernels.tree_attn import tree_mla_attention_ref
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    q, qp, kv, meta, *_ = _mixed()
    ref = tree_mla_attention_ref(q.float(), qp.float(), kv.float(), meta, SCALE)
    out = tree_mla_attention(q, qp, kv, meta, SCALE).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def check_rows_in_no_block_are_zero(case: str):
    """0 in the rows of tokens in no block: written by the split merge ("splits": the mixed
    batch, 4 splits), or the output's fill where the kernel writes the rows itself ("one_split":
    blocks 0 and 1 of the mixed batch, 25 and 4 keys, a gap between them and a tail, a group per
    program; their rows are those of the mixed batch)."""
    import torch
    from _tree_inputs import select_blocks

    q, qp, kv, _, meta, rows, out = _mixed()
    if case == "one_split":
        sub, idx = select_blocks(meta, [0, 1])
        full = out[rows][idx]  # [T0, H, R] the two blocks' rows in the mixed batch
        q, qp, padded, rows = _with_rows_in_no_block(q[rows][idx], qp[rows][idx], sub, 1, GAP, TAIL)
        out = _attn(q, qp, kv, padded, dict(SMALL, PART=SMALL["SPLIT"]))  # one split: no merge
        assert torch.equal(out[rows], full)
    outside = torch.ones(len(q), dtype=torch.bool)
    outside[rows] = False
    assert int(outside.sum()) == GAP + TAIL and (out[outside] == 0).all()


def check_every_partial_the_merge_reads_is_written():
    """The mixed batch with its output and partials allocated holding 1e4 instead of NaN: the
    same bits, with a group or a tile per program. A split past a block's keys must write its
    -inf lse (a group) or its -1e30 max and 0 sum (a tile): an unwritten one reads as a live
    split here (as NaN it would pass for an empty one)."""
    import torch

    q, qp, kv, meta, *_, out = _mixed()
    for part in (SMALL["BN"], SMALL["SPLIT"]):
        with _floats_from_empty_filled_with(1.0e4):
            again = _attn(q, qp, kv, meta, dict(SMALL, PART=part))
        assert torch.equal(again, out), part


def check_tree_rows_equal_ar_rows(case: str):
    tree, ar, _ = _ar_pair(case)
    bad = (tree != ar).flatten(1).any(1)  # [T] rows that differ
    assert not bad.any(), dict(bad_rows=int(bad.sum()), max_diff=(tree - ar).abs().max().item())


def check_rows_do_not_depend_on_the_batch():
    """A stream's rows alone (1 split: no merge; or 3 or 4 splits) and in other batches, in
    other orders == in the mixed batch (with its rows in no block)."""
    import torch
    from _tree_inputs import select_blocks

    q, qp, kv, _, meta, rows, out = _mixed()
    q, qp, full = q[rows], qp[rows], out[rows]  # the rows of the blocks, in block order
    for blocks in ([3], [1], [2, 0], [4, 2]):
        sub, idx = select_blocks(meta, blocks)
        assert torch.equal(_attn(q[idx], qp[idx], kv, sub), full[idx]), blocks


def check_rows_do_not_depend_on_the_row_tile_height():
    import torch

    q, qp, kv, meta, *_, out = _mixed()
    for bm in (32, 64):
        assert torch.equal(_attn(q, qp, kv, meta, dict(SMALL, BM=bm)), out), bm


def check_rows_do_not_depend_on_the_keys_per_program():
    """A tile or a group per program: the same bits, with the merge's tree over 4 groups (the
    default: one run per row here) and over 2 (runs of 2 added in order; rows of 1-4 groups)."""
    import torch

    q, qp, kv, meta, *_, out = _mixed()
    for gb in (4, 2):
        ref = out if gb == 4 else _attn(q, qp, kv, meta, dict(SMALL, MERGE_GROUPS=gb))
        for part in (SMALL["BN"], SMALL["SPLIT"]):  # a tile per program; a group per program
            cfg = dict(SMALL, PART=part, MERGE_GROUPS=gb)
            assert torch.equal(_attn(q, qp, kv, meta, cfg), ref), (part, gb)


CASES = (
    [("invariant_mode_matches_the_reference", check_invariant_mode_matches_the_reference, ()),
     ("default_mode_matches_the_reference", check_default_mode_matches_the_reference, ())]
    + [(f"rows_in_no_block_are_zero[{c}]", check_rows_in_no_block_are_zero, (c,))
       for c in ("splits", "one_split")]
    + [("every_partial_the_merge_reads_is_written",
        check_every_partial_the_merge_reads_is_written, ())]
    + [(f"tree_rows_equal_ar_rows[{c}]", check_tree_rows_equal_ar_rows, (c,)) for c in AR_CASES]
    + [("rows_do_not_depend_on_the_batch", check_rows_do_not_depend_on_the_batch, ()),
       ("rows_do_not_depend_on_the_row_tile_height",
        check_rows_do_not_depend_on_the_row_tile_height, ()),
       ("rows_do_not_depend_on_the_keys_per_program",
        check_rows_do_not_depend_on_the_keys_per_program, ())]
)  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_in_interpreter(name: str) -> None:
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


if __name__ == "__main__":
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # _tree_inputs
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    patch_interpreter()
    print(json.dumps(run_cases(CASES)))


def test_row_tile_is_small_for_decode_and_small_grids():
    """`row_tile`: 16-row tiles for decode calls at any prefix and for small verify grids."""
    from ddserve.kernels.tree_attn_invariant import row_tile

    assert row_tile(nblocks=10, q_max=1, heads=8, nsplit=65, bm=32) == 16  # decode, 16k slots
    assert row_tile(nblocks=1, q_max=17, heads=8, nsplit=9, bm=32) == 16  # one tree, 2k slots
    assert row_tile(nblocks=3, q_max=17, heads=8, nsplit=9, bm=32) == 16
    assert row_tile(nblocks=5, q_max=17, heads=8, nsplit=9, bm=32) == 16
    assert row_tile(nblocks=10, q_max=17, heads=8, nsplit=9, bm=32) == 32
    assert row_tile(nblocks=1, q_max=17, heads=8, nsplit=65, bm=32) == 16  # 16k slots
    assert row_tile(nblocks=2, q_max=17, heads=8, nsplit=65, bm=32) == 32
    assert row_tile(nblocks=1, q_max=1, heads=8, nsplit=9, bm=16) == 16


def test_small_decode_grids_take_a_tile_per_program():
    """`part_keys`: one key tile per program for decode calls while the group grid is small,
    else a group; verify calls always a group."""
    from ddserve.kernels.tree_attn_invariant import PART_PROGRAMS, part_keys

    assert part_keys(9, 1, 64, 256) == 64  # one stream decoding, 2k prefix slots
    assert part_keys(65, 1, 64, 256) == 64  # one stream decoding, 16k prefix slots
    assert part_keys(PART_PROGRAMS, 1, 64, 256) == 64
    assert part_keys(90, 1, 64, 256) == 256  # ten streams decoding, 2k prefix slots
    assert part_keys(45, 17, 64, 256) == 256  # one stream verifying a 17-token tree, 1k slots
