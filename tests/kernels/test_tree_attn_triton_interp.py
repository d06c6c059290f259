"""Triton tree attention on the CPU (Triton interpreter, tiny shapes): matches the reference, the
invariant mode is AR-consistent and batch-invariant bit for bit, and its in-kernel split merge
gives the bits of the two-launch merge whatever order the programs run in.

The kernels run in one subprocess with TRITON_INTERPRET=1 (it must be set before triton is
imported); that process runs this file as a script and prints one JSON line of check results.
The interpreter is patched there (tests/triton_interp.py, test-side only): loop bounds loaded from
memory, `tl.dot` on bf16, and a `tl.dot` whose every element gets the same arithmetic wherever its
row sits in the tile (numpy's BLAS does not on AVX2 CPUs), so the bitwise claims test the kernel's
own promise on any CPU; the GPU test repeats them for tensor-core math. torch.empty returns
NaN-filled memory there, so a partial, lse or output row the kernels leave unwritten shows up.

Most checks share one batch (`_mixed`, computed once): 2 heads, 16-row tiles, 16-key tiles,
32-key splits, blocks whose keys fill 1, 2, 3 and all 4 of the call's splits (a block without
prefix, a decode row alone in its last split, a tree whose tail crosses a split), and rows in no
block (a gap and a tail). It is float32, so that every bit of the fp32 merge reaches the output
(a bf16 output hides most last-bit differences); the other AR cases are bfloat16. The
interpreter runs programs one after another, where a merge that fires too early is redone by a
later one; so the merge checks also shuffle the program order (any split may draw a row tile's
last ticket) and count the stores to each output element.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interp import patch_interpreter, require_triton, run_cases

require_triton()
ROOT = Path(__file__).resolve().parents[2]
R, P, SCALE = 128, 16, 0.144680  # R: two 64-column passes of the merge
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


def _attn(q, qp, kv, meta, config=SMALL, two_launch=False):
    """The invariant kernel; every call must leave every ticket 0."""
    import torch

    from ddserve.kernels.tree_attn_invariant import _TICKETS, tree_mla_attention_invariant

    out = tree_mla_attention_invariant(q, qp, kv, meta, SCALE, config, two_launch=two_launch)
    tickets = _TICKETS.get(torch.device("cpu"))
    assert tickets is None or not tickets.tickets.any(), "a ticket is left nonzero"
    return out


@contextlib.contextmanager
def _shuffled_programs(seed: int):
    """The interpreter runs a grid's programs in a seeded random order instead of row-major."""
    import triton.runtime.interpreter as ti

    b, rng, state = ti.interpreter_builder, random.Random(seed), {}

    def set_grid_dim(nx, ny, nz):
        order = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        rng.shuffle(order)
        state.update(order=order, dims=(ny, nz))
        type(b).set_grid_dim(b, nx, ny, nz)

    def set_grid_idx(x, y, z):
        ny, nz = state["dims"]
        type(b).set_grid_idx(b, *state["order"][(x * ny + y) * nz + z])

    b.set_grid_dim, b.set_grid_idx = set_grid_dim, set_grid_idx
    try:
        yield
    finally:
        del b.set_grid_dim, b.set_grid_idx


@contextlib.contextmanager
def _recorded_stores():
    """Yields a list that collects the address of every element the interpreter stores."""
    import numpy as np
    import triton.runtime.interpreter as ti

    b, seen = ti.interpreter_builder, []

    def store(ptrs, value, mask, cache_modifier, eviction_policy):
        seen.append(ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.int64))
        return type(b).create_masked_store(b, ptrs, value, mask, cache_modifier, eviction_policy)

    b.create_masked_store = store
    try:
        yield seen
    finally:
        del b.create_masked_store


def _stores_per_element(out, seen):
    """How many of the recorded stores hit each element of `out` (flat)."""
    import numpy as np

    addr = np.concatenate(seen)
    lo, size = out.data_ptr(), out.element_size()
    hit = addr[(addr >= lo) & (addr < lo + out.numel() * size)]
    return np.bincount((hit - lo) // size, minlength=out.numel())


@functools.cache
def _mixed():
    """The shared batch: (q, qp, kv, meta) with rows in no block, the meta without them, where
    its rows went, and the one-launch output."""
    q, qp, kv, meta = _case(*MIXED, heads=2, seed=1, dtype="float32")
    q2, qp2, padded, rows = _with_rows_in_no_block(q, qp, meta, 2, GAP, TAIL)
    return q2, qp2, kv, padded, meta, rows, _attn(q2, qp2, kv, padded)


@functools.cache
def _ar_pair(case: str):
    """(tree rows, their AR decode twins, the twins' (q, qp, kv, meta)), one launch each."""
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


def check_one_launch_matches_the_reference():
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


def check_one_launch_equals_two_launch(case: str):
    """Bit for bit, rows in no block included: the mixed batch ("trees") and its AR twins
    ("decode": one row per block)."""
    if case == "trees":
        q, qp, kv, meta, *_, out = _mixed()
    else:
        _, out, (q, qp, kv, meta) = _ar_pair("mixed")
    two = _attn(q, qp, kv, meta, two_launch=True)
    bad = (out != two).flatten(1).any(1)  # [T]
    assert not bad.any(), f"rows {bad.nonzero().flatten().tolist()} differ"


def check_each_output_is_written_once_in_any_program_order(case: str):
    """Programs run in a shuffled order (any split may draw a row tile's last ticket, the zero
    column may run first): the same bits, one store to each output element (one merge per row
    tile, none early), every ticket back to 0."""
    import torch

    if case == "trees":
        q, qp, kv, meta, *_, out = _mixed()
    else:
        _, out, (q, qp, kv, meta) = _ar_pair("mixed")
    with _shuffled_programs(len(q)), _recorded_stores() as seen:
        again = _attn(q, qp, kv, meta)
    assert torch.equal(again, out)
    counts = _stores_per_element(again, seen)
    assert (counts == 1).all(), f"stores per element: {sorted(set(counts.tolist()))}"


def check_tickets_are_zero_after_a_call():
    import torch

    from ddserve.kernels.tree_attn_invariant import _TICKETS

    _mixed()
    tickets = _TICKETS[torch.device("cpu")].tickets
    assert tickets.numel() >= len(MIXED[0]) and not tickets.any()


def check_rows_in_no_block_are_zero():
    import torch

    q, *_, rows, out = _mixed()
    outside = torch.ones(len(q), dtype=torch.bool)
    outside[rows] = False
    assert int(outside.sum()) == GAP + TAIL and (out[outside] == 0).all()


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


CASES = (
    [("one_launch_matches_the_reference", check_one_launch_matches_the_reference, ()),
     ("default_mode_matches_the_reference", check_default_mode_matches_the_reference, ())]
    + [(f"one_launch_equals_two_launch[{c}]", check_one_launch_equals_two_launch, (c,))
       for c in ("trees", "decode")]
    + [(f"each_output_is_written_once_in_any_program_order[{c}]",
        check_each_output_is_written_once_in_any_program_order, (c,)) for c in ("trees", "decode")]
    + [("tickets_are_zero_after_a_call", check_tickets_are_zero_after_a_call, ()),
       ("rows_in_no_block_are_zero", check_rows_in_no_block_are_zero, ())]
    + [(f"tree_rows_equal_ar_rows[{c}]", check_tree_rows_equal_ar_rows, (c,)) for c in AR_CASES]
    + [("rows_do_not_depend_on_the_batch", check_rows_do_not_depend_on_the_batch, ()),
       ("rows_do_not_depend_on_the_row_tile_height",
        check_rows_do_not_depend_on_the_row_tile_height, ())]
)  # fmt: skip


@functools.cache
def _results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'gpu'}"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_in_interpreter(name: str) -> None:
    result = _results()[name]
    assert result == "ok", result


if __name__ == "__main__":
    import torch

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
