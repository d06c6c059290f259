"""Variant "v1" (first version, kept for comparison): W4A16 grouped MoE GEMM in Triton, on the
compressed-tensors INT4 layout as shipped (no repack).

Semantics are `moe_ref.moe_ref`'s. Two launches after a device-side grouping of (token, slot) pairs
by expert (torch ops, no host sync):

1. up:   h[p] = silu(x_t @ Wg_e^T) * (x_t @ Wu_e^T); gate and up rows of one column block share the
   activation loads; h is written in bf16.
2. down: out[t] += w_p * (h[p] @ W2_e^T), fp32 atomic adds into [T, H], then cast to x.dtype.

No repack: the words are packed along K (the reduction dimension), so a [BN, KW] tile of words is
a [BN, 8 KW] tile of weights. Each nibble plane is dequantized with the float magic-number trick
(no int->float conversion) and its group-32 scale (word j's scale is scale[j // 4] for all 8
nibbles), and the planes are interleaved in registers (join + reshape) into natural column order,
so one MMA per K step consumes them. SWAP puts the weights on the MMA's M side (the token count
of a block is small in decode). fp32 accumulation throughout.

Each m-block holds up to BM pairs of one expert; BM is chosen from the expected pairs per expert,
so in the small-batch regime an expert's weights are streamed once per launch (blocks of the same
expert and column block are adjacent in launch order, so a second block mostly hits L2).
Dense bf16 ExpertWeights take the same kernels with plain weight loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddserve.kernels.moe_ref import ExpertWeights

_MAGIC = 0x4B000000  # fp32 bits of 2^23: (n | magic) as fp32 == 2^23 + n for 0 <= n < 2^23


@triton.jit
def _dequant(words, scale, i: tl.constexpr):
    """Nibble i of each int32 word, times its scale: [BN, KW] int32 -> [BN, KW] bf16."""
    v = ((words >> (4 * i)) & 0xF) | 0x4B000000
    f = v.to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + 8: stored q + 8 -> q
    return (f * scale.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _unpack(words, scale):
    """[BN, KW] words and their scales -> [BN, 8 * KW] bf16 weights in natural column order.

    join() adds a minor dimension of size 2; joining (n0, n4), (n2, n6), (n1, n5), (n3, n7), then
    pairs of those, then the two halves puts nibble i at minor position i, so the reshape yields
    column 8 * j + i for nibble i of word j, without moving data between threads."""
    n0 = _dequant(words, scale, 0)
    n1 = _dequant(words, scale, 1)
    n2 = _dequant(words, scale, 2)
    n3 = _dequant(words, scale, 3)
    n4 = _dequant(words, scale, 4)
    n5 = _dequant(words, scale, 5)
    n6 = _dequant(words, scale, 6)
    n7 = _dequant(words, scale, 7)
    lo = tl.join(tl.join(n0, n4), tl.join(n2, n6))
    hi = tl.join(tl.join(n1, n5), tl.join(n3, n7))
    w = tl.join(lo, hi)  # [BN, KW, 2, 2, 2]
    return tl.reshape(w, (w.shape[0], w.shape[1] * 8))


@triton.jit
def _weight_tile(w_base, s_base, n, n_ok, kb, K, stride_wn, stride_sn, INT4: tl.constexpr,
                 KW: tl.constexpr):  # fmt: skip
    """Rows n, columns kb .. kb + 8 KW of one expert's weight: [BN, 8 KW] bf16 (0 outside)."""
    if INT4:
        wi = kb // 8 + tl.arange(0, KW)  # [KW] word index
        wm = n_ok[:, None] & (wi < K // 8)[None, :]
        words = tl.load(w_base + n[:, None] * stride_wn + wi[None, :], mask=wm, other=0)
        scale = tl.load(s_base + n[:, None] * stride_sn + (wi // 4)[None, :], mask=wm, other=0)
        return _unpack(words, scale)
    else:
        k = kb + tl.arange(0, 8 * KW)
        wm = n_ok[:, None] & (k < K)[None, :]
        return tl.load(w_base + n[:, None] * stride_wn + k[None, :], mask=wm, other=0.0).to(
            tl.bfloat16
        )


@triton.jit
def _moe_up_kernel(
    x_ptr, w_ptr, s_ptr, h_ptr, pairs_ptr, bexp_ptr,
    num_pairs, num_experts, num_mblocks, K, N_half,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    TOPK: tl.constexpr, INT4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    KW: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_m = pid % num_mblocks
    pid_n = pid // num_mblocks
    e = tl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    rows = pid_m * BM + tl.arange(0, BM)  # [BM]
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    tok = pair // TOPK
    n = pid_n * BN + tl.arange(0, BN)  # [BN] gate rows; up rows are n + N_half
    n_ok = n < N_half
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    if SWAP:  # weights are the MMA's M side: [BN, BM] accumulators
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
        acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, K, 8 * KW):
        wg = _weight_tile(w_base, s_base, n, n_ok, kb, K, stride_wn, stride_sn, INT4, KW)
        wu = _weight_tile(w_base, s_base, n + N_half, n_ok, kb, K, stride_wn, stride_sn, INT4, KW)
        k = kb + tl.arange(0, 8 * KW)
        if SWAP:
            xm = valid[None, :] & (k < K)[:, None]
            xk = tl.load(x_ptr + tok[None, :] * stride_x + k[:, None], mask=xm, other=0.0)
            acc_g += tl.dot(wg, xk)
            acc_u += tl.dot(wu, xk)
        else:
            xm = valid[:, None] & (k < K)[None, :]
            xk = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=xm, other=0.0)
            acc_g += tl.dot(xk, tl.trans(wg))
            acc_u += tl.dot(xk, tl.trans(wu))
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
    if SWAP:
        tl.store(
            h_ptr + rows[None, :] * stride_h + n[:, None], h.to(tl.bfloat16), mask=n_ok[:, None]
        )
    else:
        tl.store(
            h_ptr + rows[:, None] * stride_h + n[None, :], h.to(tl.bfloat16), mask=n_ok[None, :]
        )


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, tw_ptr,
    num_pairs, num_experts, num_mblocks, K, N,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, INT4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    KW: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_m = pid % num_mblocks
    pid_n = pid // num_mblocks
    e = tl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    tok = pair // TOPK
    wt = tl.load(tw_ptr + pair, mask=valid, other=0.0)  # [BM] top-k weight of each pair
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, K, 8 * KW):
        w = _weight_tile(w_base, s_base, n, n_ok, kb, K, stride_wn, stride_sn, INT4, KW)
        k = kb + tl.arange(0, 8 * KW)
        if SWAP:
            hk = tl.load(
                h_ptr + rows[None, :] * stride_h + k[:, None], mask=(k < K)[:, None], other=0.0
            )
            acc += tl.dot(w, hk)
        else:
            hk = tl.load(
                h_ptr + rows[:, None] * stride_h + k[None, :], mask=(k < K)[None, :], other=0.0
            )
            acc += tl.dot(hk, tl.trans(w))
    if SWAP:
        o_ptrs = out_ptr + tok[None, :] * stride_o + n[:, None]
        tl.atomic_add(o_ptrs, acc * wt[None, :], mask=valid[None, :] & n_ok[:, None])
    else:
        o_ptrs = out_ptr + tok[:, None] * stride_o + n[None, :]
        tl.atomic_add(o_ptrs, acc * wt[:, None], mask=valid[:, None] & n_ok[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, bm: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert into blocks of `bm`, on the device, no host sync.

    Returns sorted_pairs [NB * bm] (pair index t * k + j, or P = T * k for padding) and
    block_expert [NB] (the expert of each block, or num_experts past the last used block).
    NB is a host-side upper bound: every non-empty expert wastes at most bm - 1 slots.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    p = flat.numel()
    dev = flat.device
    nb = triton.cdiv(p + min(num_experts, p) * (bm - 1), bm)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    blocks = (counts + bm - 1) // bm  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    pair_start = torch.cumsum(counts, 0) - counts  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
    sorted_e = flat[order]
    rank = torch.arange(p, device=dev) - pair_start[sorted_e]  # position within its expert
    dest = (block_end - blocks)[sorted_e] * bm + rank
    sorted_pairs = torch.full((nb * bm,), p, dtype=torch.int64, device=dev)
    sorted_pairs[dest] = order
    block_expert = torch.searchsorted(block_end, torch.arange(nb, device=dev), right=True)
    return sorted_pairs, block_expert


def _pick_bm(num_pairs: int, num_experts: int) -> int:
    """Tokens per block: large enough that most experts fit in one block (weights read once)."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 5 else 32 if per_expert <= 14 else 64


def fused_moe_v1(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float32, routed_scaling_factor already applied
    weights: ExpertWeights,
    *,
    config: dict | None = None,
    invariant: bool = False,
) -> torch.Tensor:  # [T, H] in x.dtype
    """`moe_ref`'s contract on CUDA (or the Triton interpreter). `config` overrides tile sizes.
    Not batch invariant (shape-dependent tiles, fp32 atomics); `invariant` is ignored."""
    t, hidden = x.shape
    topk = topk_ids.shape[1]
    int4 = weights.is_int4
    w13 = weights.w13_packed if int4 else weights.w13
    w2 = weights.w2_packed if int4 else weights.w2
    s13 = weights.w13_scale if int4 else w13  # unused when dense
    s2 = weights.w2_scale if int4 else w2
    num_experts, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    p = t * topk
    # Defaults from the H200 sweep in BENCHMARKS.md: K steps of 128 columns, narrower column
    # blocks when very few pairs (more programs in flight). SWAP=False at BM=64 crashes Triton 3.6.
    bn1 = 32 if 4 * p < num_experts else 64
    cfg = dict(BM=_pick_bm(p, num_experts), BN1=bn1, BN2=128, W1=4, W2=4, S1=2, S2=2, SWAP=True)
    cfg.update(KW1=16, KW2=16) if int4 else cfg.update(KW1=8, KW2=8)
    cfg.update(config or {})
    bm = cfg["BM"]
    out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    if t == 0:
        return out.to(x.dtype)
    sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts, bm)
    nb = block_expert.numel()
    xin = x.to(torch.bfloat16).contiguous()  # [T, H]
    h = torch.empty(nb * bm, inter, dtype=torch.bfloat16, device=x.device)
    _moe_up_kernel[(nb * triton.cdiv(inter, cfg["BN1"]),)](
        xin, w13, s13, h, sorted_pairs, block_expert,
        p, num_experts, nb, hidden, inter,
        xin.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        TOPK=topk, INT4=int4, BM=bm, BN=cfg["BN1"], KW=cfg["KW1"], SWAP=cfg["SWAP"],
        num_warps=cfg["W1"], num_stages=cfg["S1"],
    )  # fmt: skip
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _moe_down_kernel[(nb * triton.cdiv(hidden, cfg["BN2"]),)](
        h, w2, s2, out, sorted_pairs, block_expert, tw,
        p, num_experts, nb, inter, hidden,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        TOPK=topk, INT4=int4, BM=bm, BN=cfg["BN2"], KW=cfg["KW2"], SWAP=cfg["SWAP"],
        num_warps=cfg["W2"], num_stages=cfg["S2"],
    )  # fmt: skip
    return out.to(x.dtype)
