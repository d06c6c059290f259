"""Batch-invariant, AR-consistent tree-verify MLA attention (`tree_mla_attention(invariant=True)`).

Every row is computed from its own key sequence in position order: positions p < plen are its
block's prefix slots, position plen + k is the k-th visible block token of its block-mask row (its
path root..itself). Key tiles (BN) and splits (SPLIT) sit at fixed multiples in position space and
one configuration per device (`device_config`) serves every call, except the height of the row
tiles (BM), which small calls lower (`SMALL_BM`): no step of a row depends on it (scores and
values are MMAs over keys, the softmax denominator too (`_row_sum`), the rest is per row). So a
row's arithmetic depends on nothing but its query and its ordered keys: a verify row equals the
AR decode row of the same token bit for bit, whatever else is batched.

The arithmetic of a row: each BN-key tile gives its own softmax state (its max, the sum of its
16-bit weights, their product with the values; `_leaf_fold`); the tiles of a group (SPLIT keys,
at multiples of SPLIT) are folded in position order from the empty state (`_fold`: explicit
FMAs); the groups are merged by `_combine_kernel` (weights exp2(lse - max lse); the weighted
values summed MERGE_GROUPS groups at a time by a fixed pairwise tree, those sums in group order).
Who folds a group's tiles is a per-call choice that leaves the bits alone (`part_keys`): its
program (one program per group) or, for small decode calls, the merge (one program per tile,
each writing its raw state), so those calls use SPLIT / BN times the programs. When the host shapes
fit one split (P_max + Q_max <= keys per program) the kernel writes the output itself, which is
bitwise what the merge of one split gives (o * 1 + 0, then o / 1).

Cost notes (ptxas sm_90, K2.x widths R=512, P=64, H=8): the [BN, 512] key tile and the [BM, 512]
fp32 accumulator share 255 registers per thread; BM=32 BN=32 at 8 warps spills 20-40 B, every
BM=64 tile spills (>= 2 KB). SPLIT trades parallelism at small batches (short splits: more
programs, fewer serial key tiles each) against partial-output traffic at large ones ([BM, R]
fp32 per program and split, merged by a second launch). A split's key tiles run one after
another (~3-4 us each on an H200), so at one stream SPLIT sets the latency, while at ten streams
verifying 17-row trees the partials dominate. Timed on an H200 with engine-shaped prefix tables
(`bench_tree_attn.py --splits`, BENCHMARKS.md), SPLIT=256 against 512: decode at 1 stream and a
1k prefix 43 vs 71 us, 1 stream verifying 17 rows 43 vs 72 us, 10 streams decoding 44 vs 73 us,
10 streams verifying 17 rows each 80 vs 76 us (8k prefixes: 48 vs 75, 82 vs 76, 122 vs 142,
466 vs 440 us). SPLIT=128 is faster still at one stream (29-32 us) and 25% slower at ten.
64-key tiles in 3 stages (`LARGE_SMEM_CONFIG`, where the shared memory allows) take fewer serial
steps per split: the same cases, 256-key splits, 32-key tiles in 2 stages -> 64-key tiles in 3
(bench/results/step/tree_attn_tiles_h200_2026-12-01.json): 43 -> 32, 44 -> 45, 44 -> 34,
80 -> 73 us (8k: 48 -> 38, 81 -> 74, 120 -> 93, 463 -> 363 us).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ddserve.kernels import backend, pdl
from ddserve.kernels.pdl import begin as pdl_begin
from ddserve.kernels.pdl import prefetch_l2
from ddserve.kernels.tree_attn import TreeAttnMeta


@triton.jit
def _row_sum(p):
    """Row sums of p [BM, BN] (16-bit) as one tensor-core product with a ones matrix: each row
    summed in the MMA's K order, the same for every tile height and warp layout (a tl.sum across
    threads follows the layout, which changes with BM). Every column of the product is the row
    sum, so their max is it exactly."""
    ones = tl.full((p.shape[1], 16), 1.0, tl.float32).to(p.dtype)
    return tl.max(tl.dot(p, ones), 1)


@triton.jit
def _online_update(m, l_sum, acc, sc, c):
    """Fold a [BM, BN] tile of base-2 scores and its values c [BN, R] into (m, l, acc), online
    (the plain kernel's arithmetic, `tree_attn_triton`); the denominator sums the same 16-bit
    weights the values are multiplied by."""
    m_new = tl.maximum(m, tl.max(sc, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(sc - m_new[:, None]).to(c.dtype)
    l_sum = l_sum * alpha + _row_sum(p)
    acc = acc * alpha[:, None] + tl.dot(p, c)
    return m_new, l_sum, acc


@triton.jit
def _fold(m, l_sum, acc, m_t, l_t, o_t):
    """(m, l, acc) folded with a tile's state (m_t, l_t, o_t): the larger max, each side scaled
    to it, explicit FMAs (no contraction choice left to the compiler), so a program folding its
    tiles and the split merge folding their partials get the same bits. Folding an empty state
    (max -1e30, sum and values 0) changes nothing; folding into one gives the other exactly."""
    m_new, a, b = _fold_scales(m, m_t)
    return m_new, tl.fma(l_sum, a, l_t * b), tl.fma(acc, a[:, None], o_t * b[:, None])


@triton.jit
def _fold_scales(m, m_t):
    """A fold's larger max and the scales of its two sides (`_fold`; the merge's, per group)."""
    m_new = tl.maximum(m, m_t)
    return m_new, tl.exp2(m - m_new), tl.exp2(m_t - m_new)


@triton.jit
def _lse(m, l_sum):
    """A group's log-sum-exp from its max and sum: -inf when it saw no key."""
    return tl.where(l_sum > 0, m + tl.log2(l_sum), float("-inf"))


@triton.jit
def _leaf_fold(m, l_sum, acc, sc, c):
    """A [BM, BN] tile of base-2 scores with its values c [BN, R]: the tile's own softmax state
    (its row max, the 16-bit weights' sum, their product with the values, from zero) folded into
    (m, l, acc). The denominator sums the same 16-bit weights the values are multiplied by."""
    m_t = tl.maximum(tl.max(sc, 1), -1.0e30)
    p = tl.exp2(sc - m_t[:, None]).to(c.dtype)
    return _fold(m, l_sum, acc, m_t, _row_sum(p), tl.dot(p, c))


@triton.jit
def _load_keys(kv_ptr, slot, kok, stride_kv, R: tl.constexpr, P: tl.constexpr):
    """Latent [BN, R] and rope [BN, P] keys at `slot` [BN] (0 where not `kok`)."""
    dr = tl.arange(0, R)
    dp = tl.arange(0, P)
    c = tl.load(kv_ptr + slot[:, None] * stride_kv + dr[None, :], mask=kok[:, None], other=0.0)
    kp = tl.load(kv_ptr + slot[:, None] * stride_kv + R + dp[None, :], mask=kok[:, None], other=0.0)
    return c, kp


@triton.jit
def _key_tile(q, qp, c, kp, vis, m, l_sum, acc, scale_log2):
    """Fold keys c [BN, R], kp [BN, P] into the rows' state where `vis` [BM, BN]. The one score +
    update code of the invariant mode: per-token tiles call it, shared tiles `_shared_key_tile`
    (the same arithmetic where every key is visible)."""
    sc = tl.dot(q, tl.trans(c)) + tl.dot(qp, tl.trans(kp))  # [BM, BN]
    sc = tl.where(vis, sc * scale_log2, float("-inf"))
    return _leaf_fold(m, l_sum, acc, sc, c)


@triton.jit
def _shared_key_tile(q, qp, kv_ptr, slot, row_ok, m, l_sum, acc, scale_log2, stride_kv,
                     R: tl.constexpr, P: tl.constexpr, OFF64: tl.constexpr):  # fmt: skip
    """`_key_tile` for a whole tile of prefix keys, which every row of the tile sees: no masks
    on the loads, and the scores' `where` is on the row alone (padding rows see nothing, as in
    `_key_tile`). The `where` must stay: without it the compiler contracts `sc * scale - m`
    into one FMA, and this tile's bits would differ from the same keys in a per-token tile
    (a row whose last prefix tile is shared in its AR decode but per-token in its verify call).
    Key offsets are 32-bit unless the cache has 2^31 elements or more (OFF64). At decode a
    tile's time is its instruction stream's (Nsight Compute on an H200: a warp issues every
    ~7.5 cycles, stalled mostly on fixed-latency dependencies and shared-memory operands, little
    on memory), so every instruction counts."""
    dr = tl.arange(0, R)
    dp = tl.arange(0, P)
    if OFF64:
        slot = slot.to(tl.int64)
    row = kv_ptr + slot * stride_kv  # [BN] row pointers
    c = tl.load(row[:, None] + dr[None, :])
    kp = tl.load(row[:, None] + R + dp[None, :])
    sc = tl.dot(q, tl.trans(c)) + tl.dot(qp, tl.trans(kp))  # [BM, BN]
    sc = tl.where(row_ok[:, None], sc * scale_log2, float("-inf"))
    return _leaf_fold(m, l_sum, acc, sc, c)


@triton.jit
def _path_index(mask_ptr, row_off, rank, qlen, BN: tl.constexpr):
    """[BN] block index of the rank-th (0-based) visible block token of one row (0 if none)."""
    idx = tl.zeros([BN], dtype=tl.int32)
    base = tl.zeros([], dtype=tl.int32)
    for i0 in range(0, qlen, BN):
        ii = i0 + tl.arange(0, BN)
        v = tl.load(mask_ptr + row_off + ii, mask=ii < qlen, other=0).to(tl.int32)  # [BN]
        cum = tl.cumsum(v, 0) + base  # inclusive visible count up to each block token
        hit = (cum[None, :] == rank[:, None] + 1) & (v[None, :] != 0)  # [BN keys, BN tokens]
        idx += tl.sum(tl.where(hit, ii[None, :], 0), 1).to(tl.int32)
        base += tl.sum(v, 0)
    return idx


# No value specialisation of the shape-dependent integers: one binary per device and keys per
# program (a group, or a tile: LEAVES), whose tile arithmetic is the same code.
@triton.jit
def _finish(out_ptr, po_ptr, plse_ptr, pl_ptr, t, head, row_ok, m, l_sum, acc, split, nsplit,
            stride_ot, stride_oh, H: tl.constexpr, R: tl.constexpr,
            LEAVES: tl.constexpr):  # fmt: skip
    """A split's result: the output itself when it is the only split (runtime branch, one
    binary: the merge of a single split is the result itself); else, when the split is a whole
    group (LEAVES 1), its normalised partial + lse, or, when it is one of the
    group's LEAVES parts, its raw state (values, max, sum) for the merge to fold."""
    dr = tl.arange(0, R)
    if nsplit == 1:
        res = acc / tl.maximum(l_sum, 1.0e-30)[:, None]
        o_ptrs = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + dr[None, :]
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        prow = (t * H + head) * nsplit + split  # partials [T, H, nsplit, (R)]
        if LEAVES == 1:  # as the merge normalises a group it folded from parts
            res = acc / tl.maximum(l_sum, 1.0e-30)[:, None]
            lse = _lse(m, l_sum)
            tl.store(po_ptr + prow[:, None] * R + dr[None, :], res, mask=row_ok[:, None])
            tl.store(plse_ptr + prow, lse, mask=row_ok)
        else:
            tl.store(po_ptr + prow[:, None] * R + dr[None, :], acc, mask=row_ok[:, None])
            tl.store(plse_ptr + prow, m, mask=row_ok)
            tl.store(pl_ptr + prow, l_sum, mask=row_ok)


@triton.jit
def _tail_tiles(
    q, qp, m, l_sum, acc, n_lo, n_hi, tok0, tok1, qrow, cnt, b, q0, qlen, plen,
    mask_ptr, stride_mb, stride_mq, pslots_ptr, stride_ps, bslots_ptr, kv_ptr, stride_kv,
    scale_log2, R: tl.constexpr, P: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Key tiles [n_lo, n_hi) past the shared prefix tiles, once per token j of the row tile with
    j's own keys (prefix slots below plen, then its path), updating only j's rows; cnt[row] =
    the row's visible block tokens (its depth + 1)."""
    for n0 in range(n_lo, n_hi, BN):
        kidx = n0 + tl.arange(0, BN)
        for j in range(tok0, tok1):
            nj = plen + tl.max(tl.where(qrow == j, cnt, 0), 0)
            if nj > n0:
                kok = kidx < nj
                in_pre = kidx < plen
                blk = _path_index(mask_ptr, b * stride_mb + j * stride_mq, kidx - plen, qlen, BN)
                ps = tl.load(pslots_ptr + b * stride_ps + kidx, mask=in_pre, other=0)
                bs = tl.load(bslots_ptr + q0 + blk, mask=kok & ~in_pre, other=0)
                slot_t = tl.where(in_pre, ps, bs).to(tl.int64)
                vis = (qrow == j)[:, None] & kok[None, :]
                c_t, kp_t = _load_keys(kv_ptr, slot_t, kok, stride_kv, R, P)
                m, l_sum, acc = _key_tile(q, qp, c_t, kp_t, vis, m, l_sum, acc, scale_log2)
    return m, l_sum, acc


@triton.jit
def prefetch_prefix_keys(
    kv_ptr, pslots_ptr, plens_ptr, b, s0, stride_ps, stride_kv,
    ROW_LINES: tl.constexpr, LINE_PAD: tl.constexpr, LINE_STEP: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Before the PDL wait: ask L2 for the 128-byte lines (LINE_STEP values each) of block b's
    prefix keys in the split starting at key s0 (ROW_LINES lines per cache row). Prefix
    slots, their count and the prefix keys are written before the forward's first kernel, never
    by one of its kernels (and a prefetch returns nothing: a stale address costs bandwidth)."""
    plen = tl.load(plens_ptr + b)
    kidx = s0 + tl.arange(0, SPLIT)  # [SPLIT]
    ok = kidx < plen
    slot = tl.load(pslots_ptr + b * stride_ps + kidx, mask=ok, other=0).to(tl.int64)
    line = tl.arange(0, LINE_PAD)  # [L] (LINE_PAD: ROW_LINES' power of two)
    addr = kv_ptr + slot[:, None] * stride_kv + line[None, :] * LINE_STEP  # [SPLIT, L]
    prefetch_l2(tl.where(ok[:, None] & (line < ROW_LINES)[None, :], addr, kv_ptr))


@triton.jit
def read_meta_block(q_starts_ptr, q_lens_ptr, plens_ptr, mask_ptr, b, qrow, stride_mb, stride_mq,
                    BN: tl.constexpr):  # fmt: skip
    """Block b's first token row, tree length and prefix length (32-bit), and per row of `qrow`
    (token indices in the block) its visible block tokens, i.e. its depth + 1 (0 past the
    block). Metadata that no layer of the forward writes (copied in before it, or built by the
    kernels that start it), so PDL kernels read it before their wait (`pdl`)."""
    q0 = tl.load(q_starts_ptr + b).to(tl.int32)
    qlen = tl.load(q_lens_ptr + b).to(tl.int32)
    plen = tl.load(plens_ptr + b).to(tl.int32)
    row_ok = qrow < qlen
    m_row = mask_ptr + b * stride_mb
    cnt = tl.zeros(qrow.shape, dtype=tl.int32)
    for i0 in range(0, qlen, BN):
        ii = i0 + tl.arange(0, BN)
        v = tl.load(
            m_row + qrow[:, None] * stride_mq + ii[None, :],
            mask=row_ok[:, None] & (ii < qlen)[None, :],
            other=0,
        )  # [BM, BN]
        cnt += tl.sum(v.to(tl.int32), 1)
    return q0, qlen, plen, cnt


@triton.jit
def read_meta_in_blocks(q_starts_ptr, q_lens_ptr, nblocks, t):
    """1 if token row t is in one of the call's blocks, else 0 (metadata: read before the PDL
    wait, as `read_meta_block`)."""
    inside = tl.zeros([], dtype=tl.int32)
    for b in range(0, nblocks):  # a few blocks per call (the batch); O(blocks) per program
        q0 = tl.load(q_starts_ptr + b)
        inside += ((q0 <= t) & (t < q0 + tl.load(q_lens_ptr + b))).to(tl.int32)
    return inside


@triton.jit(do_not_specialize=["tiles", "nsplit", "stride_ps", "stride_mb", "stride_mq"])
def _tree_attn_inv_kernel(
    ql_ptr, qr_ptr, kv_ptr, out_ptr, po_ptr, plse_ptr, pl_ptr,
    q_starts_ptr, q_lens_ptr, pslots_ptr, plens_ptr, bslots_ptr, mask_ptr,
    scale_log2, tiles, nsplit,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kv, stride_ot, stride_oh,
    stride_ps, stride_mb, stride_mq,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr, ROW_LINES: tl.constexpr, LINE_PAD: tl.constexpr,
    LINE_STEP: tl.constexpr, OFF64: tl.constexpr, LEAVES: tl.constexpr,
):  # fmt: skip
    """Program (row tile, split): whole BN tiles below the prefix length are shared by the tile's
    rows (`_shared_key_tile`); the tail tiles are done once per token with that token's keys
    (`_key_tile`, the same arithmetic). SPLIT: the call's keys per program, a whole group, or one
    tile of a group of LEAVES (its raw state then goes to the merge, `_finish`).
    ROW_LINES > 0 (PDL launches of verify calls): the first row tile's program of each split
    prefetches the split's prefix keys into L2 before waiting for the previous kernel."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // tiles
    tile = pid % tiles
    if ROW_LINES > 0:
        if tile == 0:
            prefetch_prefix_keys(kv_ptr, pslots_ptr, plens_ptr, b, split * SPLIT, stride_ps,
                                 stride_kv, ROW_LINES, LINE_PAD, LINE_STEP, SPLIT)  # fmt: skip
    r = tile * BM + tl.arange(0, BM)  # [BM] (row, head) pairs of this block
    qrow = r // H
    head = r % H
    q0, qlen, plen, cnt = read_meta_block(q_starts_ptr, q_lens_ptr, plens_ptr, mask_ptr, b, qrow,
                                          stride_mb, stride_mq, BN)  # fmt: skip
    pdl_begin(PDL)
    s0 = split * SPLIT
    row_ok = qrow < qlen
    t = (q0 + qrow).to(tl.int64)  # token rows: 64-bit offsets into q and out
    if tile * BM >= qlen * H:  # no rows of this block in this tile
        return
    if s0 >= plen + qlen:  # the split starts past every row's keys: an empty partial
        if nsplit > 1:  # an empty group: lse -inf; an empty part: max -1e30, sum 0
            prow = (t * H + head) * nsplit + split
            empty = float("-inf") if LEAVES == 1 else -1.0e30
            tl.store(plse_ptr + prow, tl.full([BM], empty, tl.float32), mask=row_ok)
            if LEAVES > 1:
                tl.store(pl_ptr + prow, tl.zeros([BM], tl.float32), mask=row_ok)
        return
    dr = tl.arange(0, R)
    dp = tl.arange(0, P)
    q_off = t[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(ql_ptr + q_off + dr[None, :], mask=row_ok[:, None], other=0.0)  # [BM, R]
    r_off = t[:, None] * stride_rt + head[:, None] * stride_rh
    qp = tl.load(qr_ptr + r_off + dp[None, :], mask=row_ok[:, None], other=0.0)  # [BM, P]
    nrow = tl.where(row_ok, plen + cnt, 0)  # [BM] keys of each row
    s1 = tl.minimum(s0 + SPLIT, tl.max(nrow, 0))
    pfull = (plen // BN) * BN
    m = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, R], dtype=tl.float32)
    n_end = tl.minimum(s1, pfull)
    ps_row = pslots_ptr + b * stride_ps
    for n0 in range(s0, n_end, BN):  # whole tiles of prefix keys: shared, every key visible
        slot_s = tl.load(ps_row + n0 + tl.arange(0, BN)).to(tl.int32)
        m, l_sum, acc = _shared_key_tile(q, qp, kv_ptr, slot_s, row_ok, m, l_sum, acc, scale_log2,
                                         stride_kv, R, P, OFF64)  # fmt: skip
    tok0 = (tile * BM) // H
    tok1 = tl.minimum((tile * BM + BM - 1) // H + 1, qlen)
    m, l_sum, acc = _tail_tiles(  # tail tiles: each token's own keys
        q, qp, m, l_sum, acc, tl.maximum(s0, pfull), s1, tok0, tok1, qrow, cnt, b, q0, qlen, plen,
        mask_ptr, stride_mb, stride_mq, pslots_ptr, stride_ps, bslots_ptr, kv_ptr, stride_kv,
        scale_log2, R, P, BN,
    )  # fmt: skip
    _finish(out_ptr, po_ptr, plse_ptr, pl_ptr, t, head, row_ok, m, l_sum, acc, split, nsplit,
            stride_ot, stride_oh, H, R, LEAVES)  # fmt: skip


@triton.jit(do_not_specialize=["NSPLIT", "nblocks"])
def _combine_kernel(
    po_ptr, plse_ptr, pl_ptr, out_ptr, q_starts_ptr, q_lens_ptr, nblocks, stride_ot, stride_oh,
    NSPLIT, H: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr, LEAVES: tl.constexpr,
    GB: tl.constexpr, BS: tl.constexpr = 64,
):  # fmt: skip
    """Merge a row's split partials into its output. A group (SPLIT keys) is a partial itself
    (LEAVES 1: its normalised values and lse), or the fold of its LEAVES parts' raw states in
    order (`_fold`'s arithmetic), normalised as the attention kernel normalises a group
    (`_groups`). The groups are then merged: m = the max of their log-sum-exps (exact in any
    order); weights w = exp2(lse - m); the values times their weights (rounded products: FMAs
    with a zero addend, so the compiler cannot contract them into the additions), and the
    weights, summed GB groups at a time by a fixed pairwise tree (`_tree_sum`: group i + group
    i + GB / 2, ...; single additions, so the bits do not depend on the layout), the GB-group
    sums added in group order. Only groups up to the row's last with keys take part (a row's
    keys are a prefix of its positions), so NSPLIT, the table's width, does not change the
    bits; empty groups (lse -inf) and empty parts (sum 0) weigh 0 and contribute no values
    (theirs may be garbage); one group gives its values exactly (o * 1 + 0 ..., then / 1). A
    row in no block (q_starts / q_lens) has no partials written: it gets 0. The block metadata
    is read before the wait (written before the forward's first layer).
    A run's loads are one tensor load per part position of its GB groups, all in the source
    before any value is used (ptxas still spreads them over about three waves: `sass_loop.py
    --kernel merge`), so the merge's memory round trips grow with the row's groups / GB, not
    its parts."""
    row = tl.program_id(0).to(tl.int64)  # t * H + head (int64: row * NSPLIT * R can pass 2^31)
    t = row // H
    head = row % H
    dr = tl.arange(0, R)
    inside = read_meta_in_blocks(q_starts_ptr, q_lens_ptr, nblocks, t)
    pdl_begin(PDL)
    if inside == 0:
        tl.store(out_ptr + t * stride_ot + head * stride_oh + dr, tl.zeros([R], tl.float32).to(
            out_ptr.dtype.element_ty))  # fmt: skip
        return
    base = row * NSPLIT
    ngroups = tl.cdiv(NSPLIT, LEAVES)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    last = tl.full([], -1, dtype=tl.int32)  # the row's last group with keys
    for g0 in range(0, ngroups, BS):  # the groups' log-sum-exps: their max (exact in any order)
        gs = g0 + tl.arange(0, BS)
        lse, _ = _groups(po_ptr, plse_ptr, pl_ptr, base, gs, ngroups - 1, NSPLIT, R, LEAVES,
                         False)  # fmt: skip
        m = tl.maximum(m, tl.max(lse, 0))
        last = tl.maximum(last, tl.max(tl.where(lse > float("-inf"), gs, -1), 0))
    m = tl.where(m > float("-inf"), m, 0.0)  # a row with no keys at all: every weight 0
    den = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([R], dtype=tl.float32)
    for g0 in range(0, last + 1, GB):
        gs = g0 + tl.arange(0, GB)
        lse, o = _groups(po_ptr, plse_ptr, pl_ptr, base, gs, last, NSPLIT, R, LEAVES, True)
        w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)  # [GB]
        acc += _tree_sum(tl.fma(o, w[:, None], 0.0), GB)  # rounded products: nothing to contract
        den += tl.sum(_tree_sum(w[:, None], GB), 0)  # [1] -> scalar
    res = acc / tl.maximum(den, 1.0e-30)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + dr, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _groups(po_ptr, plse_ptr, pl_ptr, base, g, last, NSPLIT, R: tl.constexpr,
            LEAVES: tl.constexpr, VALUES: tl.constexpr):  # fmt: skip
    """Groups g (a vector) of a row's partials (at base = row * NSPLIT): their lses [G] and,
    with VALUES, normalised values [G, R] (else 0). A group's own (LEAVES
    1), or the fold of its parts' states in order (`_fold`'s arithmetic, group by group).
    Groups past `last`: lse -inf, values 0. Values are loaded without waiting for the lse or
    sum that selects them: an empty group's or part's (within the partials' buffer, possibly
    garbage) are replaced by 0."""
    dr = tl.arange(0, R)
    in_row = g <= last
    if LEAVES == 1:
        lse = tl.load(plse_ptr + base + g, mask=in_row, other=float("-inf"))
        o = tl.zeros([g.shape[0], R], dtype=tl.float32)
        if VALUES:
            o = tl.load(po_ptr + (base + g)[:, None] * R + dr[None, :], mask=in_row[:, None],
                        other=0.0)  # fmt: skip
            o = tl.where((lse > float("-inf"))[:, None], o, 0.0)
    else:
        gm = tl.full(g.shape, -1.0e30, dtype=tl.float32)
        gl = tl.zeros(g.shape, dtype=tl.float32)
        o = tl.zeros([g.shape[0], R], dtype=tl.float32)
        for i in tl.static_range(LEAVES):
            s = g * LEAVES + i
            ok = in_row & (s < NSPLIT)
            m_t = tl.load(plse_ptr + base + s, mask=ok, other=-1.0e30)
            l_t = tl.load(pl_ptr + base + s, mask=ok, other=0.0)
            gm, a, b = _fold_scales(gm, m_t)
            gl = tl.fma(gl, a, l_t * b)
            if VALUES:
                o_t = tl.load(po_ptr + (base + s)[:, None] * R + dr[None, :], mask=ok[:, None],
                              other=0.0)  # fmt: skip
                o_t = tl.where((l_t > 0)[:, None], o_t, 0.0)
                o = tl.fma(o, a[:, None], o_t * b[:, None])
        if VALUES:
            o = o / tl.maximum(gl, 1.0e-30)[:, None]
        lse = _lse(gm, gl)
    return lse, o


@triton.jit
def _tree_sum(v, N: tl.constexpr):
    """The rows of v [N, C] (N a power of two) summed by a fixed pairwise tree: row i + row
    i + n / 2 at each halving. Each step adds two values (commutative, exact in either order),
    so the result does not depend on the layout that holds v."""
    for k in tl.static_range(N.bit_length() - 1):
        v = tl.sum(tl.reshape(v, (2, N >> (k + 1), v.shape[1])), axis=0)
    return tl.reshape(v, (v.shape[1],))


# The one configuration of a device (SPLIT: keys per group, a multiple of BN): a row's arithmetic
# then depends on nothing but its query and its keys. 64-key tiles in 3 stages need ~164 KiB of
# shared memory per program (H100 / H200); devices with less (A100: 163 KiB) take 32-key tiles.
INVARIANT_CONFIG = dict(
    BM=32, BN=32, num_warps=8, num_stages=2, SPLIT=256, PART=None, MERGE_GROUPS=None
)
LARGE_SMEM_CONFIG = dict(INVARIANT_CONFIG, BN=64, num_stages=3)
LARGE_SMEM_BYTES = 168 * 1024  # shared memory per block (opt-in) that LARGE_SMEM_CONFIG takes
# Row tiles of SMALL_BM rows (a row's bits do not depend on BM: `_row_sum`, and every other step
# is per row or an MMA over keys) for decode calls (one token per block: as many programs either
# way, each cheaper) and for calls whose SMALL_BM grid stays within SMALL_BM_PROGRAMS programs;
# elsewhere twice the row tiles, each reading the prefix, cost more than they gain. On an H200
# (64-key tiles; bench/results/step/tree_attn_tiles_bm16_h200_2026-12-01.json and
# tree_attn_bm_threshold_h200_2026-12-01.json; prefix tables padded as the engine's graphs pad
# them), us per call, BM 16 vs 32, 1k / 8k prefixes: decoding, 1 stream 28 vs 33 / 33 vs 39,
# 10 streams 30 vs 36 / 80 vs 96; verifying 17-row trees, 1 stream 28 vs 45 / 69 vs 75, 2
# streams 29 vs 49 / 112 vs 108, 3 streams 36 vs 49 / 154 vs 137, 5 streams 48 vs 50 / 247 vs
# 215, 10 streams 84 vs 73 / 457 vs 363. The SMALL_BM grid of these verify calls (prefix tables
# of 2k / 16k slots): 1 stream 81 / 585 programs, 2: 162 / 1170, 3: 243, 5: 405, 10: 810.
SMALL_BM = 16
SMALL_BM_PROGRAMS = 640
# Keys per program (PART): a whole group (SPLIT keys, folded by its program), or one BN tile per
# program (the merge folds a group's tiles in the same order with the same arithmetic, so the
# bits are the same) for decode calls (one token per block) whose group grid has at most
# PART_PROGRAMS programs: those calls then spread their keys over SPLIT / BN times the
# programs. On an H200 (64-key tiles, 256-key groups, tables padded to a power of two as the
# engine's graphs pad them; bench/results/step/tree_attn_merge_h200_2026-12-03.json), us per
# decode call, a tile / a group per program, by group grid: one stream over 1k / 4k / 8k keys (9
# / 33 / 65 programs) 17.1 / 22.7, 20.7 / 24.8, 26.8 / 28.2; four over 2k (68) 20.4 / 25.0; six
# over 1k (54) 18.1 / 24.1; against ten over 1k (90) 26.1 / 25.1, six over 2k (102) 27.4 / 26.2,
# two over 8k (130) 35.2 / 30.4. Verify calls lose with tiles at every grid measured (one
# stream's 17-token tree over 1k keys, 81 programs: 29.3 / 23.3 us; with 45 programs in the
# profiler's forward, whose table is narrower, 2.9 us more per layer).
PART_PROGRAMS = 72
# Groups the merge sums per run by its pairwise tree (part of a row's arithmetic: the default of
# every call). 4 against 8 and 16: one stream decoding over 8k keys with a tile per program 26.8
# / 29.2 / 36.6 us; with a group per program the same within 0.6 us.
MERGE_GROUPS = 4


def part_keys(programs: int, q_max: int, bn: int, split: int) -> int:
    """The call's keys per program from its group grid (`programs`) and tokens per block: one
    tile for decode calls with small grids, else the whole group."""
    return bn if q_max == 1 and programs <= PART_PROGRAMS else split


def row_tile(nblocks: int, q_max: int, heads: int, nsplit: int, bm: int) -> int:
    """The call's BM from its host shapes: SMALL_BM for decode calls and small grids, else `bm`."""
    rows = q_max * heads  # padded rows per block
    grid = nblocks * triton.cdiv(rows, SMALL_BM) * nsplit
    return min(bm, SMALL_BM) if rows <= SMALL_BM or grid <= SMALL_BM_PROGRAMS else bm


@functools.lru_cache(maxsize=16)
def device_config(device: torch.device) -> dict:
    """The configuration every call on `device` runs (a function of the device only)."""
    if device.type != "cuda":
        return INVARIANT_CONFIG
    smem = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return LARGE_SMEM_CONFIG if smem >= LARGE_SMEM_BYTES else INVARIANT_CONFIG


def tree_mla_attention_invariant(
    q_latent: torch.Tensor,  # [T, H, R]
    q_rope: torch.Tensor,  # [T, H, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    meta: TreeAttnMeta,
    softmax_scale: float,
    config: dict | None = None,
) -> torch.Tensor:  # [T, H, R]
    """`tree_mla_attention_ref`'s contract, canonical per-row arithmetic (module docstring).
    `config` overrides keys of the device's configuration (`device_config`; tests use small
    tiles); rows are only comparable between calls with the same BN, SPLIT, MERGE_GROUPS, warps
    and stages.
    Without a BM in `config`, `row_tile` picks it from the call's shapes; without a PART (keys
    per program: BN or SPLIT), `part_keys`."""
    t, h, r = q_latent.shape
    unknown = set(config or {}) - set(INVARIANT_CONFIG)
    if unknown:
        raise ValueError(f"invariant tree attention config: unknown keys {sorted(unknown)}")
    cfg = {**device_config(q_latent.device), **(config or {})}
    assert cfg["SPLIT"] % cfg["BN"] == 0
    nblocks, q_max = meta.block_mask.shape[0], meta.block_mask.shape[1]
    groups = triton.cdiv(meta.prefix_slots.shape[1] + q_max, cfg["SPLIT"])  # host shapes only
    if "BM" not in (config or {}):
        cfg["BM"] = row_tile(nblocks, q_max, h, groups, cfg["BM"])
    tiles = triton.cdiv(q_max * h, cfg["BM"])
    part = cfg["PART"]
    if part is None:
        part = part_keys(nblocks * tiles * groups, q_max, cfg["BN"], cfg["SPLIT"])
    if part not in (cfg["BN"], cfg["SPLIT"]):
        raise ValueError(f"invariant tree attention: PART {part} is neither BN nor SPLIT")
    leaves = cfg["SPLIT"] // part  # programs per group
    gb = MERGE_GROUPS if cfg["MERGE_GROUPS"] is None else cfg["MERGE_GROUPS"]
    if gb < 1 or gb & (gb - 1):
        raise ValueError(f"invariant tree attention: MERGE_GROUPS {gb} is not a power of two")
    nsplit = triton.cdiv(meta.prefix_slots.shape[1] + q_max, part)  # programs per row tile
    if nsplit == 1 or t == 0 or nblocks == 0:
        out = torch.zeros_like(q_latent)  # rows outside every block stay 0, as in the reference
        po = plse = pl = out  # unused placeholders
    else:
        # the merge writes every row (0 in no block); every (row, split) of a block gets its
        # partial's lse (a group: -inf when empty) or max and sum (a tile: -1e30 and 0 when
        # empty) from its program, so no fill launch
        out = torch.empty_like(q_latent)
        po = torch.empty(t, h, nsplit, r, dtype=torch.float32, device=q_latent.device)
        plse = torch.empty(t, h, nsplit, dtype=torch.float32, device=out.device)
        pl = plse if leaves == 1 else torch.empty_like(plse)  # the parts' sums
    if t == 0 or nblocks == 0:
        return out
    mask = meta.block_mask.view(torch.uint8)  # [B, Q_max, Q_max]
    pslots = meta.prefix_slots
    launch = pdl.launch_options(q_latent.device)
    # Verify calls (q_max > 1, not a prompt chunk) under PDL prefetch their prefix keys (cache
    # rows that start on 128-byte lines). Decode calls do not: on an H200 (profile_step
    # --variants, K2.6 rank slice) the prefetch took a 10-stream decode forward from 9.90 to
    # 10.35 ms and left one stream's unchanged, while 10 streams verifying gained 0.15 ms.
    # Prompt chunks do not either: their prefixes can be far larger than L2.
    lines = 0
    esize = kv_cache.element_size()
    verify = q_max > 1 and not backend.in_prefill_phase()
    aligned = kv_cache.data_ptr() % 128 == 0 and kv_cache.stride(0) * esize % 128 == 0
    if launch["PDL"] and "attention" in pdl.PREFETCH and verify and aligned:
        lines = triton.cdiv(kv_cache.shape[1] * esize, 128)
    _tree_attn_inv_kernel[(nblocks * tiles, nsplit)](
        q_latent, q_rope, kv_cache, out, po, plse, pl,
        meta.q_starts, meta.q_lens, pslots, meta.prefix_lens, meta.block_slots, mask,
        softmax_scale * math.log2(math.e), tiles, nsplit,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), out.stride(0), out.stride(1), pslots.stride(0), mask.stride(0),
        mask.stride(1),
        H=h, R=r, P=q_rope.shape[-1], BM=cfg["BM"], BN=cfg["BN"], SPLIT=part,
        ROW_LINES=lines, LINE_PAD=triton.next_power_of_2(max(lines, 1)), LINE_STEP=128 // esize,
        OFF64=kv_cache.shape[0] * kv_cache.stride(0) >= 2**31, LEAVES=leaves,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )  # fmt: skip
    if nsplit > 1:
        _combine_kernel[(t * h,)](
            po, plse, pl, out, meta.q_starts, meta.q_lens, nblocks, out.stride(0), out.stride(1),
            nsplit, H=h, R=r, LEAVES=leaves, GB=gb, **launch,
        )  # fmt: skip
    return out
