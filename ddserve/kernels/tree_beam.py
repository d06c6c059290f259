"""The DDTree builder's second stage in one Triton launch: the draft tree from each depth's top-K
(`ddtree.tree.tree_from_topk_torch`'s tensors, bit for bit), one program per stream. No host
sync, launch shape fixed by (B, D, K, budget): CUDA-graph safe.

Inputs (the contract of `top_draft_tokens`): top_lp [B, D, K] float32, each depth's log-probs
sorted descending, in [MIN_LOGPROB, 0] (finite, <= 0, no NaN); top_tok [B, D, K] int64; K <=
budget, and at least `budget` paths of depth <= D' = min(D, budget) (`ddtree.tree._check_budget`).

Method: the paper's best-first pops, not the torch code's beam. Both take the `budget` first
nodes of one total order: score descending, then depth ascending, then, within a depth, the
parent's position and the child's draft rank (the torch beam's stable sorts on the flat indices
parent * K + rank, depth-major at the end). Under the contract a node never precedes its parent
(a log-prob <= 0 cannot raise the score; an equal score goes to the shallower node) nor its
next sibling its previous one (the log-probs are sorted), so the order's first `budget` nodes
come out of a frontier seeded with (depth 1, rank 0), where popping a node pushes its next
sibling and its first child. Popped nodes are rows 1.. in that order, and among nodes of one
depth a smaller row is an earlier beam position, so the frontier can break ties by the
parent's row. Scores are the same fp32 additions as the beam's: a depth-1 score is the log-prob
itself, a deeper one parent score + log-prob. The torch beam's -inf padding (depth-1 slots past
K and their children) sorts after every real path (each finite, >= D' * MIN_LOGPROB) and at
least `budget` real paths exist, so it is never selected there and never exists here.

Each pop is one round of max over the frontier's 2 * N_PAD slots (row r's first child at slot
r, its next sibling at N_PAD + r): unique int64 keys `_key(score, low)` (draft_topk's encoding:
the score's order-preserving bits, -0.0 as +0.0) with low = (LOW_MAX - index) << 1 | negative
zero, index = ((depth - 1) * N + parent row) * K + rank (the larger key is the earlier node; the
last bit keeps a -0.0 score's sign and never decides, the index being unique). The same reduction
carries the slot's base score (the parent's), from which the sibling's score is formed. Then the
visibility rows: each row's parent chain, D' steps of a gather.

Why one program per stream: the pops of a stream are a chain of `budget` dependent rounds over
at most 2 * budget keys (a warp's worth), so more programs per stream would only add cross-SM
traffic; streams run side by side on separate SMs. Cost: compiled offline for sm_90 at budget
64 a round is ~170 SASS instructions at 1 or 4 warps (a 5-level shuffle reduction carrying key
and base score; 3 barriers at 4 warps) plus three dependent loads from the stream's D' * K
inputs (L1 / L2 hits). Timed on an H200 (bench/bench_tree_build.py, BENCHMARKS.md "Tree
builder"): 11 us at budget 16 and 39-40 us at 64 for 1 to 16 streams, against the torch beam's
0.5-0.75 ms of small sorts and gathers in a graph.

Caps: budget <= MAX_BUDGET = 256, the largest compiled and tested (the keys' 30-bit index field
would hold D' * N * K up to budget ~1000; the [N+1, N+1] visibility is written in blocks of
VISIBLE_TILE elements); float32 log-probs, int64 tokens, both contiguous. Elsewhere `supports`
is False and the caller runs the torch beam. Outside the contract (unsorted or positive
log-probs, -inf or NaN) the two may differ: the kernel has no way to report it without a sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddserve.kernels import pdl
from ddserve.kernels.draft_topk import _gone, _key, _low, _unordered
from ddserve.kernels.pdl import begin as pdl_begin

MAX_BUDGET = 256  # larger budgets: the torch beam
LOW_MAX = tl.constexpr(2**30 - 1)  # the keys' node index field: D' * N * K <= MAX_BUDGET**3
VISIBLE_TILE = 2048  # elements of one block of visibility rows
# fastest on an H200 (--sweep, 16 streams, budget 64: 1 / 2 / 4 / 8 warps 69 / 49 / 39 / 42 us)
WARPS = 4


def supports(top_lp: torch.Tensor, top_tok: torch.Tensor, budget: int) -> bool:
    """Whether `tree_beam` takes these top-k tensors and budget (shapes, dtypes, layout; no
    sync)."""
    if top_lp.dim() != 3 or top_lp.shape != top_tok.shape or top_lp.shape[1] < 1:
        return False
    if top_lp.dtype != torch.float32 or top_tok.dtype != torch.int64:
        return False
    if not (top_lp.is_contiguous() and top_tok.is_contiguous()):
        return False
    k = top_lp.shape[2]
    return 1 <= k <= budget <= MAX_BUDGET and _enough_paths(top_lp.shape[1], k, budget)


def _enough_paths(d: int, k: int, budget: int) -> bool:
    """At least `budget` paths of depth <= min(d, budget) over k ranks (else the frontier
    empties before the last pop)."""
    total, level = 0, 1
    for _ in range(min(d, budget)):
        level *= k
        total += level
        if total >= budget:
            return True
    return False


@triton.jit
def _max_key(k1, s1, k2, s2):
    """Combine of the pop's reduction: the larger key and its slot's base score."""
    first = k1 > k2
    return tl.where(first, k1, k2), tl.where(first, s1, s2)


@triton.jit
def _node_key(score, depth, parent, rank, N: tl.constexpr, K: tl.constexpr):
    """The frontier key of node (depth, parent row, rank) scoring `score`."""
    index = ((depth - 1) * N + parent) * K + rank
    neg_zero = (score == 0.0) & (score.to(tl.int32, bitcast=True) < 0)
    return _key(score, neg_zero.to(tl.int32) | ((LOW_MAX - index) << 1))  # tensor first


@triton.jit
def _tree_beam_kernel(
    lp_ptr, tok_ptr, tokens_ptr, parents_ptr, depths_ptr, scores_ptr, visible_ptr,
    D: tl.constexpr, K: tl.constexpr, N: tl.constexpr, DEPTH: tl.constexpr,
    N_PAD: tl.constexpr, ROWS_PAD: tl.constexpr, ROW_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Stream b's N nodes (rows 1..N): tokens, parent rows, depths, scores [N]; visible
    [N+1, N+1] as bytes."""
    pdl_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    lp_row = lp_ptr + b * (D * K)
    tok_row = tok_ptr + b * (D * K)
    gone = _gone()
    slot = tl.arange(0, 2 * N_PAD)  # [2 * N_PAD]: row r's first child at r, next sibling N_PAD + r
    keys = tl.where(slot == 0, _node_key(tl.load(lp_row), 1, 0, 0, N, K), gone)
    base = tl.zeros((2 * N_PAD,), dtype=tl.float32)  # [2 * N_PAD] the parent's score
    rn = tl.arange(0, N_PAD)
    tokens = tl.zeros((N_PAD,), dtype=tl.int64)  # [N_PAD] node i = row i + 1
    parents = tl.zeros((N_PAD,), dtype=tl.int32)
    depths = tl.zeros((N_PAD,), dtype=tl.int32)
    scores = tl.zeros((N_PAD,), dtype=tl.float32)
    rr = tl.arange(0, ROWS_PAD)
    parent_of = tl.zeros((ROWS_PAD,), dtype=tl.int32)  # [ROWS_PAD] row -> parent row, 0 -> 0
    for i in range(N):  # one pop per round, not unrolled
        key, pscore = tl.reduce((keys, base), 0, _max_key)
        keys = tl.where(keys == key, gone, keys)
        low = _low(key)
        index = LOW_MAX - (low >> 1)
        rank, parent, depth = index % K, (index // K) % N, index // (K * N) + 1
        score = _unordered((key >> 32).to(tl.int32)).to(tl.int32, bitcast=True)
        score = (score | ((low & 1) << 31)).to(tl.float32, bitcast=True)  # -0.0: key has +0.0
        row = i + 1
        tokens = tl.where(rn == i, tl.load(tok_row + (depth - 1) * K + rank), tokens)
        parents = tl.where(rn == i, parent, parents)
        depths = tl.where(rn == i, depth, depths)
        scores = tl.where(rn == i, score, scores)
        parent_of = tl.where(rr == row, parent, parent_of)
        has_child = (row < N) & (depth < DEPTH)
        child_lp = tl.load(lp_row + depth * K, mask=has_child, other=0.0)
        child = _node_key(score + child_lp, depth + 1, row, 0, N, K)
        has_sib = (row < N) & (rank + 1 < K)
        sib_lp = tl.load(lp_row + (depth - 1) * K + rank + 1, mask=has_sib, other=0.0)
        sib = _node_key(tl.where(depth == 1, sib_lp, pscore + sib_lp), depth, parent, rank + 1,
                        N, K)  # fmt: skip
        keys = tl.where((slot == row) & has_child, child, keys)
        keys = tl.where((slot == N_PAD + row) & has_sib, sib, keys)
        base = tl.where(slot == row, score, base)
        base = tl.where(slot == N_PAD + row, pscore, base)
    out = b * N + rn
    tl.store(tokens_ptr + out, tokens, mask=rn < N)
    tl.store(parents_ptr + out, parents.to(tl.int64), mask=rn < N)
    tl.store(depths_ptr + out, depths.to(tl.int64), mask=rn < N)
    tl.store(scores_ptr + out, scores, mask=rn < N)
    vis_row = visible_ptr + b * (N + 1) * (N + 1)
    for r0 in range(0, N + 1, ROW_BLOCK):  # row j sees row i iff i is j or an ancestor of j
        rows = r0 + tl.arange(0, ROW_BLOCK)  # [ROW_BLOCK]
        seen = rows[:, None] == rr[None, :]  # [ROW_BLOCK, ROWS_PAD]
        cur = tl.gather(parent_of, rows, 0)
        for _ in range(DEPTH):
            seen = seen | (cur[:, None] == rr[None, :])
            cur = tl.gather(parent_of, cur, 0)
        ok = (rows[:, None] <= N) & (rr[None, :] <= N)
        tl.store(vis_row + rows[:, None] * (N + 1) + rr[None, :], seen.to(tl.uint8), mask=ok)


def tree_beam(
    top_lp: torch.Tensor, top_tok: torch.Tensor, budget: int, warps: int = WARPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, N] int64, parents [B, N] int64, depths [B, N] int64, visible [B, N+1, N+1]
    bool, scores [B, N] float32), N = budget: `DraftTree`'s tensors, those of
    `ddtree.tree.tree_from_topk_torch` bit for bit on inputs of the module's contract."""
    assert supports(top_lp, top_tok, budget), (tuple(top_lp.shape), top_lp.dtype, budget)
    b, d, k = top_lp.shape
    n, dev = budget, top_lp.device
    tokens, parents, depths = (torch.empty(b, n, dtype=torch.int64, device=dev) for _ in range(3))
    scores = torch.empty(b, n, dtype=torch.float32, device=dev)
    visible = torch.empty(b, n + 1, n + 1, dtype=torch.bool, device=dev)
    if b == 0:
        return tokens, parents, depths, visible, scores
    rows_pad = triton.next_power_of_2(n + 1)
    _tree_beam_kernel[(b,)](
        top_lp, top_tok, tokens, parents, depths, scores, visible.view(torch.uint8), D=d, K=k,
        N=n, DEPTH=min(d, n), N_PAD=triton.next_power_of_2(n), ROWS_PAD=rows_pad,
        ROW_BLOCK=max(1, min(rows_pad, VISIBLE_TILE // rows_pad)), num_warps=warps,
        **pdl.launch_options(dev),
    )  # fmt: skip
    return tokens, parents, depths, visible, scores
