"""Tree-verify MLA attention (absorbed form) in Triton; semantics of `tree_mla_attention_ref`.

All heads of a rank share one key/value stream (the 576-wide latent: keys are [c_kv | k_rope],
values are c_kv), so a program takes a tile of BM (query row, head) pairs of one block and streams
that block's keys once: the prefix slots (all visible) and then the block's own slots under the
block mask. Softmax is online, in fp32 and base 2; P @ V uses bf16 operands, fp32 accumulation.

Long prefixes are split flash-decoding style: grid axis 1 cuts each block's prefix into NSPLIT
chunks (chunk bounds come from the device-side prefix length); the last split also takes the
block's own keys. Partial outputs and log-sum-exps go to fp32 buffers and a second launch merges
them. NSPLIT, the tile count and the grid come from host-known shapes only (T, B, Q_max, P_max),
so the launcher never reads device memory: no host sync, and it is CUDA-graph capturable.

`invariant=True` (batch-invariant engine mode) computes every row from its own key sequence in
position order (prefix slots, then its path root..itself, found from its block-mask row), with
key tiles and splits at fixed multiples of constants in position space and one fixed compiled
configuration. A row's arithmetic then depends on nothing but its query and its keys, so a
verify row equals the AR decode row of the same token bit for bit, whatever else is batched.
That mode lives in tree_attn_invariant.py (kernel, its one configuration, the split merge).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ddserve.kernels.tree_attn import TreeAttnMeta
from ddserve.kernels.tree_attn_invariant import (
    INVARIANT_CONFIG,
    MERGE_GROUPS,
    _combine_kernel,
    _online_update,
    tree_mla_attention_invariant,
)

__all__ = ["INVARIANT_CONFIG", "tree_mla_attention"]


@triton.jit
def _tree_attn_kernel(
    ql_ptr, qr_ptr, kv_ptr, out_ptr, po_ptr, plse_ptr,
    q_starts_ptr, q_lens_ptr, pslots_ptr, plens_ptr, bslots_ptr, mask_ptr,
    scale_log2, tiles,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kv, stride_ot, stride_oh,
    stride_ps, stride_mb, stride_mq,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    NSPLIT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
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
    q = tl.load(
        ql_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + dr[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BM, R]
    qp = tl.load(
        qr_ptr + t[:, None] * stride_rt + head[:, None] * stride_rh + dp[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BM, P]
    m = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, R], dtype=tl.float32)
    chunk = tl.cdiv(plen, NSPLIT)
    start = split * chunk
    end = tl.minimum(start + chunk, plen)
    for n0 in range(start, end, BN):  # prefix keys: all visible
        kidx = n0 + tl.arange(0, BN)
        kok = kidx < end
        slot = tl.load(pslots_ptr + b * stride_ps + kidx, mask=kok, other=0).to(tl.int64)
        c = tl.load(kv_ptr + slot[:, None] * stride_kv + dr[None, :], mask=kok[:, None], other=0.0)
        kp = tl.load(
            kv_ptr + slot[:, None] * stride_kv + R + dp[None, :], mask=kok[:, None], other=0.0
        )
        sc = tl.dot(q, tl.trans(c)) + tl.dot(qp, tl.trans(kp))  # [BM, BN]
        sc = tl.where(kok[None, :], sc * scale_log2, float("-inf"))
        m, l_sum, acc = _online_update(m, l_sum, acc, sc, c)
    if split == NSPLIT - 1:
        for n0 in range(0, qlen, BN):  # the block's own keys, under the block mask
            kidx = n0 + tl.arange(0, BN)
            kok = kidx < qlen
            slot = tl.load(bslots_ptr + q0 + kidx, mask=kok, other=0).to(tl.int64)
            c = tl.load(
                kv_ptr + slot[:, None] * stride_kv + dr[None, :], mask=kok[:, None], other=0.0
            )
            kp = tl.load(
                kv_ptr + slot[:, None] * stride_kv + R + dp[None, :], mask=kok[:, None], other=0.0
            )
            vis = tl.load(
                mask_ptr + b * stride_mb + qrow[:, None] * stride_mq + kidx[None, :],
                mask=row_ok[:, None] & kok[None, :],
                other=0,
            )
            sc = tl.dot(q, tl.trans(c)) + tl.dot(qp, tl.trans(kp))
            sc = tl.where(vis != 0, sc * scale_log2, float("-inf"))
            m, l_sum, acc = _online_update(m, l_sum, acc, sc, c)
    res = acc / tl.maximum(l_sum, 1.0e-30)[:, None]
    if NSPLIT == 1:
        o_ptrs = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + dr[None, :]
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        lse = tl.where(l_sum > 0, m + tl.log2(l_sum), float("-inf"))
        prow = (t * H + head) * NSPLIT + split  # partials are [T, H, NSPLIT, (R)]
        tl.store(po_ptr + prow[:, None] * R + dr[None, :], res, mask=row_ok[:, None])
        tl.store(plse_ptr + prow, lse, mask=row_ok)


def _num_splits(programs: int, max_prefix: int, device: torch.device) -> int:
    """Enough programs to fill the chip twice over, each split keeping >= 256 prefix keys."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    return max(1, min(triton.cdiv(2 * sms, programs), max_prefix // 256))


def tree_mla_attention(
    q_latent: torch.Tensor,  # [T, H, R]  query already multiplied by W_UK (absorbed)
    q_rope: torch.Tensor,  # [T, H, P]
    kv_cache: torch.Tensor,  # [S, R + P] this layer's latent pool: [c_kv | k_rope]
    meta: TreeAttnMeta,
    softmax_scale: float,
    *,
    config: dict | None = None,
    invariant: bool = False,
) -> torch.Tensor:  # [T, H, R]
    """`tree_mla_attention_ref`'s contract. `config` may override BM, BN, num_warps, num_stages,
    NSPLIT (SPLIT instead of NSPLIT when `invariant`). R and P must be powers of two (512 and 64
    for K2.x). `invariant`: every row is computed from its own ordered key list only (see
    tree_attn_invariant.py), so a verify row equals the AR decode row of the same token bit for
    bit."""
    t, h, r = q_latent.shape
    p = q_rope.shape[-1]
    assert kv_cache.shape[-1] == r + p and kv_cache.stride(-1) == 1
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    if invariant:
        return tree_mla_attention_invariant(q_latent, q_rope, kv_cache, meta, softmax_scale, config)
    nblocks, q_max = meta.block_mask.shape[0], meta.block_mask.shape[1]
    bm = 64 if q_max * h >= 64 else max(16, triton.next_power_of_2(q_max * h))
    # Tuned on an H200 (BENCHMARKS.md): wide key tiles for trees, deeper pipelining for decode.
    cfg = (
        dict(BM=bm, BN=64, num_warps=8, num_stages=2)
        if bm >= 64
        else dict(BM=bm, BN=32, num_warps=4, num_stages=3)
    )
    cfg.update(config or {})
    tiles = triton.cdiv(q_max * h, cfg["BM"])
    nsplit = cfg.get("NSPLIT") or _num_splits(
        nblocks * tiles, meta.prefix_slots.shape[1], q_latent.device
    )
    out = torch.zeros_like(q_latent)
    if t == 0 or nblocks == 0:
        return out
    po = plse = out  # placeholders when there is a single split
    if nsplit > 1:
        po = torch.empty(t, h, nsplit, r, dtype=torch.float32, device=q_latent.device)
        plse = torch.full((t, h, nsplit), float("-inf"), dtype=torch.float32, device=out.device)
    mask = meta.block_mask.view(torch.uint8)  # [B, Q_max, Q_max]
    pslots = meta.prefix_slots
    _tree_attn_kernel[(nblocks * tiles, nsplit)](
        q_latent, q_rope, kv_cache, out, po, plse,
        meta.q_starts, meta.q_lens, pslots, meta.prefix_lens, meta.block_slots, mask,
        softmax_scale * math.log2(math.e), tiles,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), out.stride(0), out.stride(1),
        pslots.stride(0), mask.stride(0), mask.stride(1),
        H=h, R=r, P=p, BM=cfg["BM"], BN=cfg["BN"], NSPLIT=nsplit,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if nsplit > 1:
        _combine_kernel[(t * h,)](  # each split a group of its own (normalised o, lse)
            po, plse, plse, out, meta.q_starts, meta.q_lens, nblocks, out.stride(0),
            out.stride(1), nsplit, H=h, R=r, PDL=False, LEAVES=1, GB=MERGE_GROUPS,
        )  # fmt: skip
    return out
