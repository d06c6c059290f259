"""Invariant tree attention with the per-token tail in its own launch (presets with TAIL=1).

Same canonical arithmetic as `_tree_attn_inv_kernel` (tree_attn_invariant.py): key tiles at
multiples of BN and splits at multiples of SPLIT in position space, one `_key_tile` code for every
tile. Only the work is cut in two launches:
- `_inv_shared_kernel` (row tile, split): the whole BN tiles below the prefix length (shared by
  the tile's rows). A split that ends inside the tail region (it holds pfull = plen // BN * BN,
  pfull not at its start) stores its raw state (acc in its partial slot, m and l beside: fp32,
  exact); other splits finish as before (partial + lse, or the output when there is one split).
- `_inv_tail_kernel` (row tile, split of the tail): the tail tiles from pfull on, per token
  with its own keys; the tail's first split continues from the stored state (or from zero when
  pfull is a split start), each split finishes its partial (or the output).
Why: in one kernel the per-token tail code doubles the register pressure of the whole program
(ptxas sm_90: BM=32 BN=32 8 warps 251 -> 171 registers without it; BM=64 BN=32 spills 976 -> 360
bytes), so the shared loop, nearly all of the work at long prefixes, runs starved. The shared
kernel also needs no block-mask pass (its tiles are below every row's key count).
Bitwise: a row's state after its shared tiles is the same numbers whether the tail continues in
the same program or after an fp32 store and load, and both kernels use the same `_key_tile`
with the same BM/BN/num_warps (the same MMA layouts): a decode row (prefix plen + depth) runs
some tiles in the shared kernel that a verify row runs in the tail kernel; the GPU tests check
that the two give the same bits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ddserve.kernels.tree_attn import TreeAttnMeta
from ddserve.kernels.tree_attn_invariant import _finish, _key_tile, _load_keys, _tail_tiles


@triton.jit(do_not_specialize=["tiles", "nsplit", "stride_ps"])
def _inv_shared_kernel(
    ql_ptr, qr_ptr, kv_ptr, out_ptr, po_ptr, plse_ptr, st_ptr,
    q_starts_ptr, q_lens_ptr, pslots_ptr, plens_ptr,
    scale_log2, tiles, nsplit,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kv, stride_ot, stride_oh, stride_ps,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // tiles
    tile = pid % tiles
    q0 = tl.load(q_starts_ptr + b)
    qlen = tl.load(q_lens_ptr + b)
    plen = tl.load(plens_ptr + b)
    pfull = (plen // BN) * BN
    s0 = split * SPLIT
    if (tile * BM >= qlen * H) | (s0 >= pfull):  # no rows, or no whole prefix tile here
        return
    r = tile * BM + tl.arange(0, BM)  # [BM] (row, head) pairs of this block
    qrow = r // H
    head = r % H
    row_ok = qrow < qlen
    t = q0 + qrow
    dr = tl.arange(0, R)
    dp = tl.arange(0, P)
    q_off = t[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(ql_ptr + q_off + dr[None, :], mask=row_ok[:, None], other=0.0)  # [BM, R]
    r_off = t[:, None] * stride_rt + head[:, None] * stride_rh
    qp = tl.load(qr_ptr + r_off + dp[None, :], mask=row_ok[:, None], other=0.0)  # [BM, P]
    m = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, R], dtype=tl.float32)
    n_end = tl.minimum(s0 + SPLIT, pfull)  # every row has > pfull keys: all of these visible
    ps_row = pslots_ptr + b * stride_ps
    if PREFETCH > 0:
        kf = s0 + tl.arange(0, BN)
        slot_f = tl.load(ps_row + kf, mask=kf < n_end, other=0).to(tl.int64)
    for n0 in range(s0, n_end, BN):
        kidx = n0 + tl.arange(0, BN)
        vis = row_ok[:, None] & (kidx < n_end)[None, :]
        if PREFETCH > 0:
            c, kp = _load_keys(kv_ptr, slot_f, kidx < plen, stride_kv, R, P)
            kn = kidx + BN
            slot_f = tl.load(ps_row + kn, mask=kn < n_end, other=0).to(tl.int64)
        else:
            slot_s = tl.load(ps_row + kidx).to(tl.int64)
            c, kp = _load_keys(kv_ptr, slot_s, kidx < plen, stride_kv, R, P)
        m, l_sum, acc = _key_tile(q, qp, c, kp, vis, m, l_sum, acc, scale_log2)
    # One [BM, R] store either way: a split that goes on into the tail (pfull inside it; always
    # the case when nsplit == 1) leaves its raw acc in its partial slot and (m, l) in the state
    # buffer for the tail kernel; a finished split stores its partial and lse.
    cont = n_end < s0 + SPLIT
    prow = (t.to(tl.int64) * H + head) * nsplit + split  # partials [T, H, nsplit, (R)], int64
    res = tl.where(cont, acc, acc / tl.maximum(l_sum, 1.0e-30)[:, None])  # [BM, R]
    tl.store(po_ptr + prow[:, None] * R + dr[None, :], res, mask=row_ok[:, None])
    if cont:
        srow = t.to(tl.int64) * H + head  # state is [T, H, 2] fp32: m, l
        tl.store(st_ptr + srow * 2, m, mask=row_ok)
        tl.store(st_ptr + srow * 2 + 1, l_sum, mask=row_ok)
    else:
        lse = tl.where(l_sum > 0, m + tl.log2(l_sum), float("-inf"))
        tl.store(plse_ptr + prow, lse, mask=row_ok)


@triton.jit(do_not_specialize=["tiles", "nsplit", "stride_ps", "stride_mb", "stride_mq"])
def _inv_tail_kernel(
    ql_ptr, qr_ptr, kv_ptr, out_ptr, po_ptr, plse_ptr, st_ptr,
    q_starts_ptr, q_lens_ptr, pslots_ptr, plens_ptr, bslots_ptr, mask_ptr,
    scale_log2, tiles, nsplit,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kv, stride_ot, stride_oh,
    stride_ps, stride_mb, stride_mq,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // tiles
    tile = pid % tiles
    q0 = tl.load(q_starts_ptr + b)
    qlen = tl.load(q_lens_ptr + b)
    plen = tl.load(plens_ptr + b)
    if tile * BM >= qlen * H:
        return
    r = tile * BM + tl.arange(0, BM)  # [BM] (row, head) pairs of this block
    qrow = r // H
    head = r % H
    row_ok = qrow < qlen
    t = q0 + qrow
    dr = tl.arange(0, R)
    dp = tl.arange(0, P)
    m_row = mask_ptr + b * stride_mb
    cnt = tl.zeros([BM], dtype=tl.int32)  # visible block tokens of each row = its depth + 1
    for i0 in range(0, qlen, BN):
        ii = i0 + tl.arange(0, BN)
        v = tl.load(
            m_row + qrow[:, None] * stride_mq + ii[None, :],
            mask=row_ok[:, None] & (ii < qlen)[None, :],
            other=0,
        )  # [BM, BN]
        cnt += tl.sum(v.to(tl.int32), 1)
    nrow = tl.where(row_ok, plen + cnt, 0)  # [BM] keys of each row
    n_all = tl.max(nrow, 0)
    pfull = (plen // BN) * BN
    split = pfull // SPLIT + tl.program_id(1)  # the tail's first split, or a later one
    n0s = tl.maximum(pfull, split * SPLIT)
    n1s = tl.minimum(split * SPLIT + SPLIT, n_all)
    if n0s >= n1s:  # the tail does not reach this split
        return
    q_off = t[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(ql_ptr + q_off + dr[None, :], mask=row_ok[:, None], other=0.0)  # [BM, R]
    r_off = t[:, None] * stride_rt + head[:, None] * stride_rh
    qp = tl.load(qr_ptr + r_off + dp[None, :], mask=row_ok[:, None], other=0.0)  # [BM, P]
    srow = t.to(tl.int64) * H + head  # int64: srow * nsplit * R can pass 2^31
    if pfull > split * SPLIT:  # the shared kernel stored this split's state so far
        prow = srow * nsplit + split
        acc = tl.load(po_ptr + prow[:, None] * R + dr[None, :], mask=row_ok[:, None], other=0.0)
        m = tl.load(st_ptr + srow * 2, mask=row_ok, other=-1.0e30)
        l_sum = tl.load(st_ptr + srow * 2 + 1, mask=row_ok, other=0.0)
    else:
        m = tl.full([BM], -1.0e30, dtype=tl.float32)
        l_sum = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, R], dtype=tl.float32)
    tok0 = (tile * BM) // H
    tok1 = tl.minimum((tile * BM + BM - 1) // H + 1, qlen)
    m, l_sum, acc = _tail_tiles(  # the tail tiles of this split: each token's own keys
        q, qp, m, l_sum, acc, n0s, n1s, tok0, tok1, qrow, cnt, b, q0, qlen, plen,
        mask_ptr, stride_mb, stride_mq, pslots_ptr, stride_ps, bslots_ptr, kv_ptr, stride_kv,
        scale_log2, R, P, BN,
    )  # fmt: skip
    _finish(out_ptr, po_ptr, plse_ptr, t, head, row_ok, m, l_sum, acc, split, nsplit,
            stride_ot, stride_oh, H, R)  # fmt: skip


def _launch_split_tail(
    q_latent: torch.Tensor,  # [T, H, R]
    q_rope: torch.Tensor,  # [T, H, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    out: torch.Tensor,  # [T, H, R]
    po: torch.Tensor,  # [T, H, nsplit, R] fp32 (a placeholder when nsplit == 1)
    plse: torch.Tensor,  # [T, H, nsplit] fp32, -inf
    meta: TreeAttnMeta,
    softmax_scale: float,
    cfg: dict,
    tiles: int,
    nsplit: int,
) -> None:
    """Both launches of a TAIL=1 preset (the caller merges the partials when nsplit > 1)."""
    t, h, r = q_latent.shape
    nblocks = meta.block_mask.shape[0]
    state = torch.empty(t, h, 2, dtype=torch.float32, device=q_latent.device)  # m, l
    if nsplit == 1:  # the shared kernel hands its raw acc over in a partial slot
        po = torch.empty(t, h, 1, r, dtype=torch.float32, device=q_latent.device)
    mask = meta.block_mask.view(torch.uint8)  # [B, Q_max, Q_max]
    pslots = meta.prefix_slots
    scale_log2 = softmax_scale * math.log2(math.e)
    strides = (
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), out.stride(0), out.stride(1), pslots.stride(0),
    )  # fmt: skip
    common = dict(H=h, R=r, P=q_rope.shape[-1], BM=cfg["BM"], BN=cfg["BN"], SPLIT=cfg["SPLIT"])
    common.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _inv_shared_kernel[(nblocks * tiles, nsplit)](
        q_latent, q_rope, kv_cache, out, po, plse, state,
        meta.q_starts, meta.q_lens, pslots, meta.prefix_lens,
        scale_log2, tiles, nsplit, *strides, PREFETCH=cfg.get("PREFETCH", 0), **common,
    )  # fmt: skip
    q_max = meta.block_mask.shape[1]
    tail_splits = (cfg["BN"] + q_max) // cfg["SPLIT"] + 2  # the tail spans < BN + Q_max keys
    _inv_tail_kernel[(nblocks * tiles, tail_splits)](
        q_latent, q_rope, kv_cache, out, po, plse, state,
        meta.q_starts, meta.q_lens, pslots, meta.prefix_lens, meta.block_slots, mask,
        scale_log2, tiles, nsplit, *strides, mask.stride(0), mask.stride(1), **common,
    )  # fmt: skip
