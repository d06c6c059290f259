"""CUDA-core (no tl.dot) up-projection for the W4A16 MoE v2: config={"GEMV": True}.

Same grid, operands and outputs as `moe_triton_v2._up_kernel` (program = (block, K split, BN
columns)), but each valid row (pair) of the block is done on its own: per K step the weight tile
[BN, 8 KW] is dequantized and multiplied elementwise by the token's activations in fp32, then
summed along K. Meant for the decode regime (a few tokens per expert: an MMA tile of BM = 16
rows wastes most of its work there); rows past the first reload the tile from L1/L2.

Batch invariance: a row's arithmetic (K order, split, reduction tree) does not depend on the other
rows of its block, so the path is invariant when it is used for every call (a fixed choice,
never picked from T). Its sums are in a different order from the MMA path: results differ from
it within rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddserve.kernels.moe_w4_tiles import _convert, _load_raw


@triton.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _up_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr,
    num_pairs, num_experts, num_mblocks, N_half,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_or,
    K: tl.constexpr, K_CHUNK: tl.constexpr, TOPK: tl.constexpr, INT4: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    SV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_m = pid % num_mblocks
    rest = pid // num_mblocks
    pid_s = rest % SPLIT
    pid_n = rest // SPLIT
    e = tl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    n = pid_n * BN + tl.arange(0, BN)  # [BN] gate rows; up rows are n + N_half
    n_ok = n < N_half
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    k_lo = pid_s * K_CHUNK
    k_end = tl.minimum(k_lo + K_CHUNK, K)
    STEP: tl.constexpr = 8 * KW
    for r in range(BM):  # valid rows come first in a block; padding rows are skipped
        row = pid_m * BM + r
        pair = tl.load(pairs_ptr + row)
        if pair < num_pairs:
            tok = (pair // TOPK).to(tl.int64)
            acc_g = tl.zeros([BN], dtype=tl.float32)
            acc_u = tl.zeros([BN], dtype=tl.float32)
            for kk in range(0, K_CHUNK, STEP):
                kb = k_lo + kk
                k = kb + tl.arange(0, STEP)  # [8 KW]
                xk = tl.load(x_ptr + tok * stride_x + k, mask=k < k_end, other=0.0)
                xk = xk.to(tl.float32)[None, :]  # [1, 8 KW]
                gw, gs = _load_raw(w_base, s_base, n, n_ok, kb, k_end, stride_wn, stride_sn,
                                   INT4, KW, SV)  # fmt: skip
                uw, us = _load_raw(w_base, s_base, n + N_half, n_ok, kb, k_end, stride_wn,
                                   stride_sn, INT4, KW, SV)  # fmt: skip
                acc_g += tl.sum(_convert(gw, gs, INT4, ASM).to(tl.float32) * xk, axis=1)
                acc_u += tl.sum(_convert(uw, us, INT4, ASM).to(tl.float32) * xk, axis=1)
            o_ptrs = out_ptr + pid_s * stride_os + row.to(tl.int64) * stride_or + n
            if SPLIT == 1:  # out is h [rows, N_half] bf16
                h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
                tl.store(o_ptrs, h.to(tl.bfloat16), mask=n_ok)
            else:  # out is part [SPLIT, rows, 2 N_half] fp32
                tl.store(o_ptrs, acc_g, mask=n_ok)
                tl.store(o_ptrs + N_half, acc_u, mask=n_ok)
