"""Triton counting-sort expert alignment (ddserve/kernels/moe_align.py) on the CPU, Triton
interpreter.

The kernels run in a subprocess with TRITON_INTERPRET=1 (read when a kernel is decorated); the
child prints one JSON record per routing and the tests assert on them. Every record compares
`align_by_expert_triton` with the plain-torch `moe_align.align_by_expert`: same dtypes, shapes
and values (pair order inside an expert, padding value P = T * k, block_expert = E past the last
used block). Routings: random top-k (T in 1, 2, 7, 48, 200; k in 1, 2, 8; E in 8, 64, 384; bm 8
and 16, P kept at most 400), taking turns over the chunk size (the default: one launch up to 256
pairs; 16 and 64: two launches, many chunks) and the two ways a pair reads its expert's base row
(tl.gather, or through memory); and skewed ones, each run both ways: every token on the same
experts, most experts empty, every expert used (also over 20 chunks), the first and last expert
only, int32 ids, P a power of two, P = 256 (the largest one-launch size) and 257, 1000 pairs in
63 chunks, the DDTree decode size (1360), P across the chunk-size switch (4097), P near and at
the maximum (8191, 8192, and 8192 pairs on one expert), E = 1024, bm 8 / 16 / 32 / 64.
"""

from __future__ import annotations

import json

import pytest

from tests.triton_interp import interpreter_run, require_triton

require_triton()
RANDOM = [
    (t, k, e, bm)
    for t in (1, 2, 7, 48, 200)
    for k in (1, 2, 8)
    for e in (8, 64, 384)
    for bm in (8, 16)
    if t * k <= 400 and k <= e
]


def _topk(t: int, k: int, e: int, gen):
    """Random routing: k distinct experts per token, [T, k] int64."""
    import torch

    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]


def _skewed(gen):
    """(name, topk_ids, num_experts, bm[, chunk]) for routings the random ones rarely hit."""
    import torch

    cover = torch.stack([torch.randperm(64, generator=gen)[:8] for _ in range(40)])
    cover[:8] = torch.arange(64).reshape(8, 8)  # every expert used
    return [
        ("all_one_expert", torch.full((37, 1), 5), 64, 16),
        ("all_same_k_experts", torch.tensor([[3, 60, 17]]).repeat(30, 1), 64, 8),
        ("all_last_expert", torch.full((20, 1), 383), 384, 8),
        ("first_and_last", torch.tensor([[0, 383]]).repeat(9, 1), 384, 16),
        ("every_expert_e8", _topk(25, 8, 8, gen), 8, 16),
        ("every_expert_e64", cover, 64, 8),
        ("mostly_empty", _topk(3, 2, 384, gen), 384, 16),
        ("int32_ids", _topk(11, 8, 64, gen).to(torch.int32), 64, 16),
        ("pow2_pairs", _topk(16, 8, 384, gen), 384, 16),
        ("one_pair", torch.tensor([[7]]), 8, 8),
        ("bm32", _topk(20, 8, 64, gen), 64, 32),
        ("bm64", _topk(20, 8, 8, gen), 8, 64),
        ("bm64_one_expert", torch.full((70, 1), 2), 8, 64),
        ("p1000", _topk(125, 8, 384, gen), 384, 16),
        ("p256_one_launch", _topk(32, 8, 384, gen), 384, 16),
        ("p257_two_launches", _topk(257, 1, 384, gen), 384, 16),
        ("every_expert_20_chunks", cover, 64, 8, 16),
        ("p1000_63_chunks", _topk(125, 8, 384, gen), 384, 32, 16),
        ("p1360_ddtree_decode", _topk(170, 8, 384, gen), 384, 8),
        ("p4097", _topk(4097, 1, 384, gen), 384, 32),
        ("p8191", _topk(8191, 1, 384, gen), 384, 8),
        ("p8192", _topk(1024, 8, 384, gen), 384, 16),
        ("p8192_one_expert", torch.full((8192, 1), 7), 384, 64),
        ("e1024", _topk(100, 8, 1024, gen), 1024, 16),
    ]


def _compare(name: str, ids, e: int, bm: int, gather: bool, chunk: int | None = None) -> dict:
    import torch

    from ddserve.kernels.moe_align import align_by_expert, align_by_expert_triton

    want = align_by_expert(ids, e, bm)
    got = align_by_expert_triton(ids, e, bm, gather=gather, chunk=chunk)
    bad = []
    for what, g, w in zip(("sorted_pairs", "block_expert"), got, want, strict=True):
        if g.dtype != w.dtype or g.shape != w.shape:
            bad.append(f"{what}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}")
        elif not torch.equal(g, w):
            i = int((g != w).nonzero()[0])
            bad.append(f"{what}[{i}] = {int(g[i])}, want {int(w[i])}")
    rec = {"name": name, "p": ids.numel(), "e": e, "bm": bm, "gather": gather, "chunk": chunk}
    return dict(rec, bad=bad)


def _child() -> None:
    """Runs under TRITON_INTERPRET=1: print one JSON line per routing."""
    import torch

    gen = torch.Generator().manual_seed(0)
    cases = [
        (f"random_t{t}_k{k}_e{e}_bm{bm}", _topk(t, k, e, gen), e, bm) for t, k, e, bm in RANDOM
    ]
    for n, (name, ids, e, bm) in enumerate(cases):  # chunk sizes and base-row paths take turns
        rec = _compare(name, ids, e, bm, gather=n % 2 == 0, chunk=(None, 16, 64)[n % 3])
        print(json.dumps(rec), flush=True)
    for name, ids, e, bm, *chunk in _skewed(gen):  # both paths
        for gather, suffix in ((True, ""), (False, "_memory")):
            rec = _compare(name + suffix, ids, e, bm, gather=gather, chunk=(chunk or [None])[0])
            print(json.dumps(rec), flush=True)


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    lines = interpreter_run(__file__).stdout.splitlines()
    recs = [json.loads(line) for line in lines if line.startswith("{")]
    return {r["name"]: r for r in recs}


@pytest.mark.interpreter
def test_random_routings_match_torch(records):
    rand = [r for n, r in records.items() if n.startswith("random_")]
    assert len(rand) == len(RANDOM)
    assert {r["gather"] for r in rand} == {True, False}
    assert {r["chunk"] for r in rand} == {None, 16, 64}
    assert [(r["name"], r["bad"]) for r in rand if r["bad"]] == []


@pytest.mark.parametrize(
    "name",
    ["all_one_expert", "all_same_k_experts", "all_last_expert", "first_and_last", "every_expert_e8",
     "every_expert_e64", "mostly_empty", "int32_ids", "pow2_pairs", "one_pair", "bm32", "bm64",
     "bm64_one_expert", "p1000", "p256_one_launch", "p257_two_launches", "every_expert_20_chunks",
     "p1000_63_chunks", "p1360_ddtree_decode", "p4097", "p8191", "p8192", "p8192_one_expert",
     "e1024"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["gather", "memory"])
@pytest.mark.interpreter
def test_skewed_routing_matches_torch(records, name, path):
    rec = records[name if path == "gather" else f"{name}_memory"]
    assert rec["gather"] == (path == "gather")
    assert rec["bad"] == []


def test_one_launch_up_to_one_chunk_and_at_most_32_chunks():
    import triton

    from ddserve.kernels.moe_align import MAX_PAIRS, ONE_CHUNK, chunk_size

    chunks = {p: triton.cdiv(p, chunk_size(p)) for p in range(1, MAX_PAIRS + 1)}
    assert [p for p, n in chunks.items() if (n == 1) != (p <= ONE_CHUNK)] == []
    assert max(chunks.values()) == 32


def test_too_many_pairs_is_refused():
    import torch

    from ddserve.kernels.moe_align import align_by_expert_triton

    with pytest.raises(AssertionError, match="chunk"):  # asserted on the host, before any launch
        align_by_expert_triton(torch.zeros(1025, 8, dtype=torch.int64), 384, 16)


if __name__ == "__main__":
    _child()
