"""Triton tree attention on the CPU (Triton interpreter, tiny shapes): matches the reference, and
the invariant mode is AR-consistent and batch-invariant bit for bit.

The kernels run in one subprocess with TRITON_INTERPRET=1 (it must be set before triton is
imported); that process runs this file as a script and prints one JSON line of check results.
The interpreter is patched there (tests/triton_interp.py, test-side only): loop bounds loaded from
memory, `tl.dot` on bf16, and a `tl.dot` whose every element gets the same arithmetic wherever its
row sits in the tile (numpy's BLAS does not on AVX2 CPUs), so the bitwise claims test the kernel's
own promise on any CPU; the GPU test repeats them for tensor-core math.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interp import patch_interpreter, require_triton

require_triton()
ROOT = Path(__file__).resolve().parents[2]
H, R, P, SCALE = 4, 64, 16, 0.144680
SMALL = dict(BM=16, BN=16, SPLIT=48)  # tiles and splits small enough to cross them cheaply


def _inputs(meta, heads, slots, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    t = int(meta.q_lens.sum())
    q = torch.randn(t, heads, R, generator=gen).to(torch.bfloat16)  # [T, H, R]
    qp = torch.randn(t, heads, P, generator=gen).to(torch.bfloat16)  # [T, H, P]
    kv = torch.randn(slots, R + P, generator=gen).to(torch.bfloat16)  # [S, R+P]
    return q, qp, kv


def _run_checks() -> dict:
    from _tree_inputs import ar_meta, random_meta, select_blocks

    from ddserve.kernels.tree_attn import tree_mla_attention_ref
    from ddserve.kernels.tree_attn_triton import tree_mla_attention

    res = {}

    def attn(q, qp, kv, meta, **kw):
        return tree_mla_attention(q, qp, kv, meta, SCALE, **kw)

    # 1) both modes vs the fp32 reference, mixed batch (empty prefix, decode row, trees)
    pls, qls = [0, 5, 40, 100], [9, 1, 17, 30]
    slots = sum(pls) + sum(qls) + 7
    meta = random_meta(pls, qls, slots, seed=1)
    q, qp, kv = _inputs(meta, H, slots, 1)
    ref = tree_mla_attention_ref(q.float(), qp.float(), kv.float(), meta, SCALE)
    for name, kw in [("default", {}), ("invariant", dict(invariant=True, config=SMALL))]:
        out = attn(q, qp, kv, meta, **kw).float()
        res[f"ref_{name}"] = ((out - ref).norm() / ref.norm()).item()

    # 2) AR consistency: each tree row == its AR decode twin, bit for bit
    cases = [
        (2, [0, 3, 15], [12, 20, 5]),
        (4, [16, 30, 47], [33, 9, 17]),
        (8, [70, 95], [25, 1]),
        (4, [1100], [20]),  # default configuration: crosses 32-key tiles and the 256-key splits
    ]
    for i, (heads, pls, qls) in enumerate(cases):
        cfg = None if i == 3 else SMALL
        slots = sum(pls) + sum(qls) + 3
        meta = random_meta(pls, qls, slots, seed=10 + i)
        q, qp, kv = _inputs(meta, heads, slots, 10 + i)
        tree = attn(q, qp, kv, meta, invariant=True, config=cfg)
        ar = attn(q, qp, kv, ar_meta(meta), invariant=True, config=cfg)
        bad = (tree != ar).any(-1).any(-1)  # [T] rows that differ
        res[f"ar_{heads}h_{pls}"] = dict(
            bad_rows=int(bad.sum()), max_diff=(tree - ar).abs().max().item()
        )

    # 3) batch invariance: a stream's rows alone, in the batch, and in another batch order
    # block 4's long prefix makes the full batch 4 splits; subsets run 1 (no merge) or 2 splits
    pls, qls = [20, 0, 61, 33, 150], [17, 6, 1, 29, 3]
    slots = sum(pls) + sum(qls) + 3
    meta = random_meta(pls, qls, slots, seed=30)
    q, qp, kv = _inputs(meta, H, slots, 30)
    full = attn(q, qp, kv, meta, invariant=True, config=SMALL)
    bad = 0
    for blocks in ([0], [1], [2], [3], [3, 0], [2, 1, 0]):
        sub, rows = select_blocks(meta, blocks)
        part = attn(q[rows], qp[rows], kv, sub, invariant=True, config=SMALL)
        bad += int((part != full[rows]).any(-1).any(-1).sum())
    res["batch_bad_rows"] = bad

    # 4) a row's bits do not depend on the row-tile height BM (small calls take a lower one)
    pls, qls = [40, 7, 90], [17, 1, 30]
    slots = sum(pls) + sum(qls) + 3
    meta = random_meta(pls, qls, slots, seed=40)
    q, qp, kv = _inputs(meta, H, slots, 40)
    outs = [attn(q, qp, kv, meta, invariant=True, config=dict(SMALL, BM=bm)) for bm in (16, 32, 64)]
    res["bm_bad_rows"] = sum(int((o != outs[0]).any(-1).any(-1).sum()) for o in outs[1:])

    # 5) rows after the last block belong to none: 0 in the output, the others unchanged
    # (several splits: no launch fills the partials, each block's programs write their own)
    import torch

    pls, qls = [100, 3], [5, 1]
    slots = sum(pls) + sum(qls) + 3
    meta = random_meta(pls, qls, slots, seed=50)
    q, qp, kv = _inputs(meta, H, slots, 50)
    q2 = torch.cat([q, torch.randn(3, H, R).to(q.dtype)])  # [T + 3, H, R]
    qp2 = torch.cat([qp, torch.randn(3, H, P).to(qp.dtype)])
    base = attn(q, qp, kv, meta, invariant=True, config=SMALL)
    out = attn(q2, qp2, kv, meta, invariant=True, config=SMALL)
    res["outside_rows_zero"] = bool((out[len(q) :] == 0).all())
    res["inside_rows_same"] = bool(torch.equal(out[: len(q)], base))
    return res


@functools.cache
def _results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'gpu'}"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("mode", ["default", "invariant"])
def test_matches_reference(mode):
    assert _results()[f"ref_{mode}"] < 1e-2


def test_tree_rows_equal_ar_rows_bitwise():
    ar = {k: v for k, v in _results().items() if k.startswith("ar_")}
    assert len(ar) == 4 and all(v["bad_rows"] == 0 for v in ar.values()), ar


def test_rows_do_not_depend_on_the_row_tile_height():
    assert _results()["bm_bad_rows"] == 0


def test_rows_do_not_depend_on_the_batch():
    assert _results()["batch_bad_rows"] == 0


def test_rows_in_no_block_are_zero_and_leave_the_others_unchanged():
    assert _results()["outside_rows_zero"] and _results()["inside_rows_same"]


if __name__ == "__main__":
    import torch

    # torch.empty returns NaN-filled memory here, so a partial the kernels leave unwritten (an
    # empty split's log-sum-exp, a row in no block) shows up in the results, whatever the
    # allocator hands out
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    patch_interpreter()
    print(json.dumps(_run_checks()))


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
