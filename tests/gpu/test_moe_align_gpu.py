"""Triton counting-sort expert alignment == the torch `align_by_expert` on the GPU (CUDA only).

Covers P = T * k from 1 to 8192 (one launch up to 256 pairs, two past that), E up to 1024, bm
8 .. 64, every chunk size and num_warps the bench may pick, both base-row paths (tl.gather and
through memory), skewed routings, and CUDA-graph capture + replay with new routings copied into
the captured input (the pre-fill must be redone on every replay). Each test collects all
mismatches and prints them before asserting, so one run tells everything.
"""

from __future__ import annotations

import pytest
import torch

from ddserve.kernels.moe_align import align_by_expert, align_by_expert_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need CUDA")

TOKENS = [1, 2, 3, 7, 48, 100, 384, 1000, 1024]
TOPK = [1, 8]


def _topk(t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Random routing with k distinct experts per token: [T, k] int64 on the GPU."""
    scores = torch.rand(t, e, generator=gen, device="cuda")  # [T, E]
    return scores.topk(k, dim=1).indices  # [T, k]


def _mismatch(ids: torch.Tensor, e: int, bm: int, **kw) -> str | None:
    want = align_by_expert(ids, e, bm)
    got = align_by_expert_triton(ids, e, bm, **kw)
    torch.cuda.synchronize()
    for what, g, w in zip(("sorted_pairs", "block_expert"), got, want, strict=True):
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{what}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
        if not torch.equal(g, w):
            i = int((g != w).nonzero()[0])
            n = int((g != w).sum())
            return f"{what}: {n} differ, first [{i}] = {int(g[i])}, want {int(w[i])}"
    return None


def _report(bad: list[str]) -> None:
    for line in bad:
        print("MISMATCH", line)
    assert bad == []


@pytest.mark.parametrize("e", [8, 64, 384, 512])
@pytest.mark.parametrize("bm", [8, 16, 32, 64])
def test_random_routings_match_torch(e: int, bm: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(e * 100 + bm)
    bad = []
    for t in TOKENS:
        for k in TOPK:
            if k <= e and (msg := _mismatch(_topk(t, k, e, gen), e, bm)):
                bad.append(f"T={t} k={k} E={e} bm={bm}: {msg}")
    _report(bad)


@pytest.mark.parametrize("bm", [8, 16])
def test_memory_base_row_path_matches_torch(bm: int) -> None:
    """The fallback kernel (each pair's base row through a scratch buffer, not tl.gather)."""
    gen = torch.Generator(device="cuda").manual_seed(bm)
    bad = []
    for t in TOKENS:
        for k in TOPK:
            if msg := _mismatch(_topk(t, k, 384, gen), 384, bm, gather=False):
                bad.append(f"T={t} k={k} bm={bm} memory path: {msg}")
    _report(bad)


@pytest.mark.parametrize("chunk", [16, 64, 128, 256])
def test_every_chunk_size_matches_torch(chunk: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(chunk)
    bad = []
    for t in TOKENS:
        if 8 * t <= 64 * chunk and (msg := _mismatch(_topk(t, 8, 384, gen), 384, 8, chunk=chunk)):
            bad.append(f"T={t} chunk={chunk}: {msg}")
    _report(bad)


def test_gather_path_compiles_and_is_the_default() -> None:
    """tl.gather explicitly (no fallback): an error here is the one the default path would log."""
    from ddserve.kernels import moe_align

    ids = _topk(1024, 8, 384, torch.Generator(device="cuda").manual_seed(5))
    _report([f"gather path: {m}" for m in [_mismatch(ids, 384, 16, gather=True)] if m])
    assert moe_align.GATHER_ERROR is None


def test_skewed_routings_match_torch() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    cases = [
        ("8192 pairs on one expert", torch.full((8192, 1), 7, device="cuda"), 384, 64),
        ("1024 tokens on the same 8", torch.arange(8, device="cuda").repeat(1024, 1), 384, 16),
        ("last expert only", torch.full((1000, 1), 511, device="cuda"), 512, 8),
        ("every expert of 8", _topk(1024, 8, 8, gen), 8, 64),
        ("int32 ids", _topk(1024, 8, 384, gen).to(torch.int32), 384, 16),
        ("one pair", torch.tensor([[3]], device="cuda"), 384, 16),
        ("1024 experts", _topk(1024, 8, 1024, gen), 1024, 16),
        ("8191 pairs", _topk(8191, 1, 384, gen), 384, 32),
    ]
    _report([f"{name}: {m}" for name, ids, e, bm in cases if (m := _mismatch(ids, e, bm))])


@pytest.mark.parametrize("num_warps", [1, 2, 4, 8, 16])
def test_every_num_warps_matches_torch(num_warps: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(num_warps)
    bad = []
    for t in (1, 17, 48, 384, 1024):
        if t == 1024 and num_warps < 8:  # a [32, 512] counts tile: > 64 registers per thread
            continue
        ids = _topk(t, 8, 384, gen)
        if msg := _mismatch(ids, 384, 16, num_warps=num_warps):
            bad.append(f"T={t} num_warps={num_warps}: {msg}")
    _report(bad)


def test_too_many_pairs_is_refused() -> None:
    with pytest.raises(AssertionError, match="chunk"):
        align_by_expert_triton(torch.zeros(1025, 8, dtype=torch.int64, device="cuda"), 384, 16)


@pytest.mark.parametrize("t", [1, 48, 1024])
def test_graph_replay_with_new_routings(t: int) -> None:
    """Captured once; each replay after copying a new routing in equals the torch result on it,
    including routings with fewer used blocks than the one before (stale rows must be reset)."""
    e, k, bm = 384, 8, 16
    gen = torch.Generator(device="cuda").manual_seed(t)
    ids = _topk(t, k, e, gen)  # [T, k] the captured input
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        align_by_expert_triton(ids, e, bm)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pairs, bexp = align_by_expert_triton(ids, e, bm)
    routings = [_topk(t, k, e, gen) for _ in range(3)]
    routings.insert(1, torch.arange(k, device="cuda").repeat(t, 1))  # few blocks after many
    routings.append(torch.full((t, k), e - 1, device="cuda"))  # one expert (repeated ids)
    bad = []
    for n, new in enumerate(routings):
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = align_by_expert(new, e, bm)
        for what, g, w in zip(("sorted_pairs", "block_expert"), (pairs, bexp), want, strict=True):
            if not torch.equal(g, w):
                bad.append(f"T={t} replay {n}: {what} {int((g != w).sum())} differ")
    _report(bad)
