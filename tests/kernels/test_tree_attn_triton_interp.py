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
output (a bf16 output hides most last-bit differences); the other AR cases are bfloat16. At
these small widths FUSED_MERGE="auto" merges decode calls' splits in the attention launch (the
AR twins'; the interpreter runs the programs one after another, the tickets included); the
merge-path checks force each way, and the two must give the same bits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interp import patch_interpreter, require_triton, run_cases

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
    """0 in the rows of tokens in no block: written by the launch's zero programs ("in_launch":
    the mixed batch, 4 splits merged in the attention launch) or the merge launch
    ("merge_launch"), or the output's fill where the kernel writes the rows itself ("one_split":
    blocks 0 and 1 of the mixed batch, 25 and 4 keys, a gap between them and a tail; their rows
    are those of the mixed batch)."""
    import torch
    from _tree_inputs import select_blocks

    q, qp, kv, padded, meta, rows, out = _mixed()
    if case != "one_split":
        out = _attn(q, qp, kv, padded, dict(SMALL, FUSED_MERGE=case == "in_launch"))
    else:
        sub, idx = select_blocks(meta, [0, 1])
        full = out[rows][idx]  # [T0, H, R] the two blocks' rows in the mixed batch
        q, qp, padded, rows = _with_rows_in_no_block(q[rows][idx], qp[rows][idx], sub, 1, GAP, TAIL)
        out = _attn(q, qp, kv, padded)
        assert torch.equal(out[rows], full)
    outside = torch.ones(len(q), dtype=torch.bool)
    outside[rows] = False
    assert int(outside.sum()) == GAP + TAIL and (out[outside] == 0).all()


def check_every_partial_the_merge_reads_is_written(in_launch: bool):
    """The mixed batch with its output and partials allocated holding 1e4 instead of NaN: the
    same bits, with the merge in the launch or in its own. A split past a block's keys must
    write its -inf lse: an unwritten one reads as a live split of weight 1 here (as NaN it would
    pass for an empty one); so must every row of the output (0 in no block)."""
    import torch

    q, qp, kv, meta, *_, out = _mixed()
    with _floats_from_empty_filled_with(1.0e4):
        again = _attn(q, qp, kv, meta, dict(SMALL, FUSED_MERGE=in_launch))
    assert torch.equal(again, out)


def _padded_table(meta, width: int):
    """meta with its prefix-slot table `width` wide, as the engine's graphs pad it: splits past
    every row's keys."""
    import torch

    pad = meta.prefix_slots.new_zeros(meta.num_blocks, width - meta.prefix_slots.shape[1])
    return type(meta)(**{**meta.__dict__, "prefix_slots": torch.cat([meta.prefix_slots, pad], 1)})


# heads, prefix lengths, tree lengths, prefix table width (0: the longest prefix), rows in no
# block after the last block (0: none; else also GAP before block 2)
MERGE_CASES = {
    "mixed": None,  # the mixed batch, rows in no block included
    # decode rows in 5 splits: every row's keys end in split 0, 1 or 2, the rest are empty; 52
    # rows in no block: 2 programs past the row tiles zero them
    "decode": (2, [0, 5, 33, 70, 64, 31], [1] * 6, 128, 50),
    # 9 row tiles per block: block 1's last 8 have no rows (no tickets), its split 1 is empty
    "8_heads": (8, [40, 3], [18, 2], 0, 0),
}


def check_merge_in_launch_gives_the_merge_launch_bits(case: str):
    """The same call with its splits merged in the attention launch and in a second launch: the
    same bits (float32 outputs), both close to the reference, and every ticket back at 0."""
    from ddserve.kernels import invariant
    from ddserve.kernels.tree_attn import tree_mla_attention_ref

    if case == "mixed":
        q, qp, kv, meta, *_ = _mixed()
    else:
        heads, pls, qls, width, tail = MERGE_CASES[case]
        q, qp, kv, meta = _case(pls, qls, heads, seed=len(pls), dtype="float32")
        meta = _padded_table(meta, width) if width else meta
        if tail:
            q, qp, meta, _ = _with_rows_in_no_block(q, qp, meta, 2, GAP, tail)
    merged = {f: _attn(q, qp, kv, meta, dict(SMALL, FUSED_MERGE=f)) for f in (True, False)}
    bad = (merged[True] != merged[False]).flatten(1).any(1)  # [T] rows that differ
    assert not bad.any(), dict(bad_rows=int(bad.sum()))
    ref = tree_mla_attention_ref(q, qp, kv, meta, SCALE)
    assert ((merged[True] - ref).norm() / ref.norm()).item() < 1e-2
    assert not invariant.scratch(q.device).tickets.any()


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
    [("invariant_mode_matches_the_reference", check_invariant_mode_matches_the_reference, ()),
     ("default_mode_matches_the_reference", check_default_mode_matches_the_reference, ())]
    + [(f"rows_in_no_block_are_zero[{c}]", check_rows_in_no_block_are_zero, (c,))
       for c in ("in_launch", "merge_launch", "one_split")]
    + [(f"every_partial_the_merge_reads_is_written[{m}]",
        check_every_partial_the_merge_reads_is_written, (m == "in_launch",))
       for m in ("in_launch", "merge_launch")]
    + [(f"merge_in_launch_gives_the_merge_launch_bits[{c}]",
        check_merge_in_launch_gives_the_merge_launch_bits, (c,)) for c in MERGE_CASES]
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


def test_merge_in_launch_for_decode_with_small_tiles_of_partials():
    """`merge_in_launch`: "auto" merges decode calls in the attention launch while a row tile's
    partials stay within MERGE_MAX_BYTES (K2.x widths: up to 9 splits), never verify calls;
    True and False force a way; one split merges nowhere."""
    from ddserve.kernels.tree_attn_invariant import merge_in_launch

    assert merge_in_launch(q_max=1, heads=8, nsplit=9, bm=16, r=512)  # decode, 2k slots
    assert merge_in_launch(q_max=1, heads=2, nsplit=4, bm=16, r=128)  # the interpreter's decode
    assert not merge_in_launch(q_max=1, heads=8, nsplit=33, bm=16, r=512)  # decode, 8k slots
    assert not merge_in_launch(q_max=17, heads=8, nsplit=2, bm=16, r=512)  # a tree
    assert merge_in_launch(q_max=17, heads=8, nsplit=33, bm=32, r=512, mode=True)
    assert not merge_in_launch(q_max=1, heads=8, nsplit=9, bm=16, r=512, mode=False)
    assert not merge_in_launch(q_max=1, heads=8, nsplit=1, bm=16, r=512, mode=True)
    with pytest.raises(ValueError):
        merge_in_launch(q_max=1, heads=8, nsplit=9, bm=16, r=512, mode="yes")


def test_merge_in_launch_ptx_touches_memory_after_its_wait():
    """The kernel with the merge in its launch, compiled for sm_90 under PDL (as
    tests/kernels/test_pdl.py compiles it without): it compiles, its zero programs and split
    programs store, take tickets and load partials only after the wait, and the tickets are
    acq_rel atomics at GPU scope."""
    import re

    pytest.importorskip("triton.backends.nvidia.compiler", reason="no CUDA backend in triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import tree_attn_invariant as ta

    kernel = ta._tree_attn_inv_kernel
    ptrs = dict(ql_ptr="*bf16", qr_ptr="*bf16", kv_ptr="*bf16", out_ptr="*bf16", po_ptr="*fp32",
                plse_ptr="*fp32", q_starts_ptr="*i64", q_lens_ptr="*i64", pslots_ptr="*i64",
                plens_ptr="*i64", bslots_ptr="*i64", mask_ptr="*u8", ticket_ptr="*i32")  # fmt: skip
    ints = ("tiles", "nsplit", "stride_qt", "stride_qh", "stride_rt", "stride_rh", "stride_kv",
            "stride_ot", "stride_oh", "stride_ps", "stride_mb", "stride_mq", "nblocks",
            "ntok")  # fmt: skip
    sig = {**ptrs, "scale_log2": "fp32", **dict.fromkeys(ints, "i32")}
    consts = dict(H=8, R=512, P=64, BM=16, BN=64, SPLIT=256, PDL=True, ROW_LINES=0, LINE_PAD=1,
                  LINE_STEP=64, OFF64=False, MERGE=True)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    aligned = [n for n in (*ptrs, *ints) if n not in kernel.do_not_specialize]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 8, "num_stages": 3, "launch_pdl": True}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]
    first_wait = ptx.find("griddepcontrol.wait")
    first_access = re.search(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.)", ptx)
    assert 0 <= first_wait < first_access.start()
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 2  # empty and full splits
