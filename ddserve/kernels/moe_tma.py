"""TMA up-projection for the W4A16 MoE v2: config={"TMA": True} (INT4 weights only).

Same grid, operands, K order and arithmetic as `moe_triton_v2._up_kernel` (so the same bits), but
the weight words come through a host-side tensor descriptor (`TensorDescriptor` over w13 viewed
as [E * 2I, K / 8] int32 words, block [BN, KW]): on sm_90 the loads become TMA bulk copies into
shared memory, which Triton's software pipeliner issues `num_stages` (S1) K steps ahead, instead
of register loads one step ahead (PREFETCH). Round 2's ablations say the loads bound the up
kernel (too few weight bytes in flight per SM); this moves them off the register file.

Why the bits are the same: the words of a row are the same words (TMA zero-fills past K / 8,
where the pointer path masks to 0; K chunks of the splits are whole STEP multiples, so no step
crosses a split's end inside K); rows past N_half (a tail block) read other rows' words, but
their scales are masked to 0 and those rows are never stored, and an MMA output element only
depends on its own row. Scales stay pointer loads (a [BN, KW / 4] bf16 box is 8 bytes wide at
KW = 16, below TMA's 16-byte minimum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ddserve.kernels.moe_triton_v1 import _unpack
from ddserve.kernels.moe_w4_tiles import _acc_step, _mma, _unpack_asm


@triton.jit
def _scales(s_base, n, n_ok, kb, k_end, stride_sn, KW: tl.constexpr, SV: tl.constexpr):
    """[BN, KW] scale of each word of rows n, words kb / 8 .. (as `moe_w4_tiles._load_raw`)."""
    if SV:
        gi = kb // 32 + tl.arange(0, KW // 4)  # [KW / 4] group index
        gm = n_ok[:, None] & (gi < k_end // 32)[None, :]
        sg = tl.load(s_base + n[:, None] * stride_sn + gi[None, :], mask=gm, other=0)
        sg = tl.broadcast_to(sg[:, :, None], (sg.shape[0], KW // 4, 4))  # [BN, KW / 4, 4]
        return tl.reshape(sg, (sg.shape[0], KW))
    else:
        wi = kb // 8 + tl.arange(0, KW)  # [KW]
        wm = n_ok[:, None] & (wi < k_end // 8)[None, :]
        return tl.load(s_base + n[:, None] * stride_sn + (wi // 4)[None, :], mask=wm, other=0)


@triton.jit
def _tile(words, scale, ASM: tl.constexpr):
    if ASM:
        return _unpack_asm(words, scale)
    else:
        return _unpack(words, scale)


@triton.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _up_tma_kernel(
    x_ptr, w_desc, s_ptr, out_ptr, pairs_ptr, bexp_ptr,
    num_pairs, num_experts, num_mblocks, N_half,
    stride_x, stride_se, stride_sn, stride_os, stride_or,
    K: tl.constexpr, K_CHUNK: tl.constexpr, TOPK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    F32: tl.constexpr, SV: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_m = pid % num_mblocks
    rest = pid // num_mblocks
    pid_s = rest % SPLIT
    pid_n = rest // SPLIT
    e = tl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    rows = pid_m * BM + tl.arange(0, BM)  # [BM]
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    tok = (pair // TOPK).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)  # [BN] gate rows; up rows are n + N_half
    n_ok = n < N_half
    row_g = (e * (2 * N_half) + pid_n * BN).to(tl.int32)  # first gate row, [E * 2I] view
    row_u = row_g + N_half
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)  # weights on the MMA's M side
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    k_lo = pid_s * K_CHUNK
    k_end = tl.minimum(k_lo + K_CHUNK, K)
    STEP: tl.constexpr = 8 * KW
    for kk in range(0, K_CHUNK, STEP):  # constexpr bounds; pipelined num_stages deep
        kb = k_lo + kk
        wk = (kb // 8).to(tl.int32)
        gw = w_desc.load([row_g, wk])  # [BN, KW] int32
        uw = w_desc.load([row_u, wk])
        gs = _scales(s_base, n, n_ok, kb, k_end, stride_sn, KW, SV)
        us = _scales(s_base, n + N_half, n_ok, kb, k_end, stride_sn, KW, SV)
        k = kb + tl.arange(0, STEP)
        xm = valid[None, :] & (k < K)[:, None]
        xk = tl.load(x_ptr + tok[None, :] * stride_x + k[:, None], mask=xm, other=0.0)  # [STEP, BM]
        acc_g = _acc_step(acc_g, gw, gs, xk, True, ASM, F32, MODE)  # MODE 0: += tile(gw) @ xk
        acc_u = _acc_step(acc_u, uw, us, xk, True, ASM, F32, MODE)
    o_ptrs = out_ptr + pid_s * stride_os + rows[None, :].to(tl.int64) * stride_or + n[:, None]
    if SPLIT == 1:  # out is h [rows, N_half] bf16
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(o_ptrs, h.to(tl.bfloat16), mask=n_ok[:, None])
    else:  # out is part [SPLIT, rows, 2 N_half] fp32
        tl.store(o_ptrs, acc_g, mask=n_ok[:, None])
        tl.store(o_ptrs + N_half, acc_u, mask=n_ok[:, None])


@triton.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _down_tma_kernel(
    h_ptr, w_desc, s_ptr, out_ptr, pairs_ptr, bexp_ptr, tw_ptr,
    num_pairs, num_experts, num_mblocks, N,
    stride_h, stride_se, stride_sn, stride_o,
    K: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr,
    ASM: tl.constexpr, ATOMIC: tl.constexpr, F32: tl.constexpr, SV: tl.constexpr,
):  # fmt: skip
    """`moe_triton_v2._down_kernel` for K = 8 KW (all of K in one step, K2.6: I = 256): each
    program does NT column tiles of BN in turn, their weight words through the descriptor
    (pipelined num_stages tiles deep); h is loaded once. Per tile: the same operands and one MMA
    of the same shape as the pointer kernel."""
    KW: tl.constexpr = K // 8
    pid = tl.program_id(0)
    pid_m = pid % num_mblocks
    pid_n = pid // num_mblocks
    e = tl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    wt = tl.load(tw_ptr + pair, mask=valid, other=0.0)  # [BM] top-k weight of each pair
    s_base = s_ptr + e.to(tl.int64) * stride_se
    k = tl.arange(0, K)
    hk = tl.load(h_ptr + rows[None, :] * stride_h + k[:, None])  # [K, BM]
    if ATOMIC:
        o_row = (pair // TOPK)[None, :] * stride_o
    else:
        o_row = pair[None, :] * stride_o
    for j in range(0, NT):
        n0 = (pid_n * NT + j) * BN
        n = n0 + tl.arange(0, BN)
        n_ok = n < N
        a = w_desc.load([(e * N + n0).to(tl.int32), 0])  # [BN, KW] int32
        b = _scales(s_base, n, n_ok, 0, K, stride_sn, KW, SV)
        acc = _mma(_tile(a, b, ASM), hk, F32)  # [BN, BM]
        y = acc * wt[None, :]
        m = valid[None, :] & n_ok[:, None]
        if ATOMIC:  # out [T, N] fp32
            tl.atomic_add(out_ptr + o_row + n[:, None], y, mask=m)
        else:  # out [P, N] fp32, one row per (token, slot) pair
            tl.store(out_ptr + o_row + n[:, None], y, mask=m)


def down_tma_ok(w2: torch.Tensor, kw: int) -> bool:
    """`tma_ok` and all of K (I) in one KW step."""
    return tma_ok(w2, kw) and w2.shape[2] == kw


def down_tma(args: tuple, nt: int, cfg: dict, meta: dict):
    """Launch `_down_tma_kernel` with `moe_triton_v2._launch`'s down-kernel arguments."""
    (h, w2, s2, y, pairs, bexp, tw, p, ne, nb, hidden, sh, _swe, _swn, sse, ssn, so) = args
    desc = TensorDescriptor.from_tensor(w2.view(-1, w2.shape[2]), [cfg["BN2"], w2.shape[2]])
    grid = (nb * triton.cdiv(hidden, cfg["BN2"] * nt),)
    return _down_tma_kernel[grid](
        h, desc, s2, y, pairs, bexp, tw, p, ne, nb, hidden, sh, sse, ssn, so,
        K=w2.shape[2] * 8, BN=cfg["BN2"], NT=nt, **meta,
    )  # fmt: skip


def tma_ok(w13: torch.Tensor, kw: int) -> bool:
    """Whether the descriptor path can run: contiguous int32 words, 16-byte aligned base and
    rows, a box at least 16 bytes wide."""
    return (
        w13.dtype == torch.int32
        and w13.is_contiguous()
        and w13.data_ptr() % 16 == 0
        and (w13.shape[2] * 4) % 16 == 0
        and kw * 4 >= 16
    )


def up_tma(up_args: tuple, up_kw: dict, interp: bool, mode: int = 0):
    """Launch `_up_tma_kernel` with `moe_triton_v2._launch`'s up-kernel arguments (pointer w13,
    its strides) turned into the descriptor form. Returns the compiled kernel."""
    (xin, w13, s13, part, pairs, bexp, p, ne, nb, inter, sx, _swe, _swn, sse, ssn, sos, sor) = (
        up_args
    )
    w2d = w13.view(w13.shape[0] * w13.shape[1], w13.shape[2])  # [E * 2I, K / 8]
    desc = TensorDescriptor.from_tensor(w2d, [up_kw["BN"], up_kw["KW"]])
    kw = {k: v for k, v in up_kw.items() if k != "INT4"}
    grid = (nb * up_kw["SPLIT"] * triton.cdiv(inter, up_kw["BN"]),)
    return _up_tma_kernel[grid](
        xin, desc, s13, part, pairs, bexp, p, ne, nb, inter, sx, sse, ssn, sos, sor,
        **kw, F32=interp, MODE=mode,
    )  # fmt: skip
