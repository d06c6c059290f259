"""Variant "v2" of the W4A16 grouped MoE: split-K up-projection, optional bf16x2 asm dequant, and a
batch-invariant mode. Same INT4 layout and grouping as v1 (`moe_triton_v1`, no repack).

Launches after the expert alignment (`moe_align`: one Triton launch up to 2048 pairs, else the
torch ops of `align_by_expert`; no host sync):

1. up:      part[s, r] = x_t @ W13_e[:, K-split s]^T (fp32), SPLIT programs per (block, columns),
            each walking K / SPLIT columns (more loads in flight when few experts are touched).
            With SPLIT == 1 the SiLU-mul is fused and h is written directly. PREFETCH: the next
            K step's words are loaded (into registers) before this step's are dequantized.
   TMA (config, off by default, `moe_tma`): the weight words through a tensor descriptor, TMA
            copies pipelined S1 steps deep by Triton instead of the 1-step register prefetch
            (round 3 on an H200 measured no gain, so the pointer kernel stays the default).
   GEMV (config, `moe_gemv`): the same with CUDA-core dot products, row by row (no tl.dot).
2. silu:    h[r] = silu(sum_s gate part) * (sum_s up part), splits summed in order 0..SPLIT-1, bf16.
3. down:    y[p] = w_p * (h[p] @ W2_e^T). Fast mode: fp32 atomic adds into out[t].
            TMA2 (config, `moe_tma`): NT2 column tiles per program, words through a descriptor.
            Invariant mode: y stored per pair ([P, H] fp32), then
4. combine: out[t] = sum_j y[t * k + j] in slot order j = 0..k-1, cast to x.dtype.

Batch invariance (`invariant=True`): the tile config (BM, BN, KW, SPLIT, warps, stages) is fixed,
not picked from T; the kernels are compiled without specializing on T-dependent integers; every
sum over K splits and top-k slots is in a fixed order with no atomics; calls with more than
`CHUNK` tokens are split on the host (per-token arithmetic is unchanged). So a token's output row
does not depend on the other tokens in the call or on their routing (MMA results per element do
not depend on other rows/columns of a tile when the compiled kernel is the same).

Non-invariant mode runs the same fixed config by default (it measured fastest at every T in
round 1). config={"TUNED": True} gives the round-1 shape-dependent tuning: SPLIT grows (up to 8)
until there are about 4 programs per SM, BM = 32 past 14 tokens per expert, fp32 atomics.

ASM dequant (`ASM`, on by default on CUDA with bf16 scales): see `moe_w4_tiles`. If it fails to
compile, the call falls back to pure Triton and ASM_ERROR says why (likewise TMA / TMA_ERROR).
Errors that are not compile failures are raised, not turned into a fallback: CUDA out-of-memory,
and any error during CUDA-graph capture (a fallback launch cannot be captured there either).
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from ddserve.kernels.moe_align import FAST_PAIRS, align_by_expert_triton
from ddserve.kernels.moe_gemv import _up_gemv_kernel
from ddserve.kernels.moe_reduce import _combine_kernel, _silu_kernel
from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.kernels.moe_tma import down_tma, down_tma_ok, tma_ok, up_tma
from ddserve.kernels.moe_triton_v1 import align_by_expert
from ddserve.kernels.moe_w4_tiles import _acc_step, _load_raw

log = logging.getLogger(__name__)

ASM_ERROR: str | None = None  # set when the asm dequant failed to compile (then auto-off)
TMA_ERROR: str | None = None  # set when the TMA up kernel failed (then the pointer kernel)
CHUNK = 1024  # tokens per call without atomics (bounds the [P, H] fp32 per-pair buffer)
# Registers (ptxas for sm_90, ASM on): up BN1=32 KW1=16 W1=4 with prefetch 134; down BN2=64 KW2=32
# (all of K = 256 in one step) 132, vs BN2=128 KW2=16 244. BN1=64 at 4 warps hits the 255 cap.
# Round 1 on an H200: BN1=64 at 8 warps was the fastest variant at every T (1 .. 768), invariant
# or not (93 us at T=1, 1687 us at T=384), so it is the default of both modes.
INVARIANT_CONFIG = dict(
    BM=16, BN1=64, SPLIT=4, KW1=16, BN2=64, KW2=32, W1=8, W2=4, S1=3, S2=2, PREFETCH=True, MODE=0,
    GEMV=False, SVEC=True, MAXREG=128, TMA=False, TMA2=False, NT2=4,
)  # fmt: skip
# Round 3 on an H200 (bench/results/moe_variants_round3_2026-11-30.json): TMA gave no gain (the
# TMA up kernel 0-1% slower than the pointer kernel at every T, TMA2 within +-4%), so the
# validated round-2 pointer kernel stays the default.
# TMA (round 3, `moe_tma`, INT4 only): the up kernel's weight words through a tensor descriptor,
# TMA copies into shared memory pipelined S1 deep by Triton (PREFETCH is then unused); same K
# order and arithmetic (same bits in the interpreter; both compile to wgmma m64n8k16 for sm_90).
# ptxas sm_90 (default tiles): 117 registers without maxnreg (128 cap: no spills; the pointer
# kernel spills 32 B at 128), 32 KB shared at S1=3: two 8-warp programs per SM, each with 3 K
# steps (2 x 3 x 4 KB of words) in flight instead of 1. TMA=False: the round-2 pointer kernel.
# TMA2 (`moe_tma._down_tma_kernel`, when I = 8 KW2): the down kernel does NT2 column tiles per
# program, their words through a descriptor pipelined S2 deep (h loaded once); same bits.
# Round 2 on an H200 (bench/results/moe_variants_round2_2026-11-30.json): SVEC + MAXREG=128 was
# the fastest at T >= 48 and within 10% of the best at T = 1..24 (1.5-1.6x round 1's default).
# SVEC: one load per scale group (`moe_w4_tiles._load_raw`; round-1 code loaded a 2-byte scale
# per word: 4x the words' load instructions at KW=16, seen in the sm_90 PTX). Same results.
# ptxas sm_90 for the up kernel (default tiles): 174 registers, 130 with SVEC: one 8-warp program
# per SM; MAXREG=128 (maxnreg of the up kernel) would allow two (more loads in flight).
# MODE (ablations for the bench only, wrong results): 1 LOAD_ONLY, 2 NO_MMA, 3 FAKE_DEQUANT.
ABLATIONS = {"load_only": 1, "no_mma": 2, "fake_dequant": 3}


@triton.jit
def _up_step(acc_g, acc_u, gw, gs, uw, us, x_ptr, tok, valid, kb, stride_x,
             K: tl.constexpr, INT4: tl.constexpr, KW: tl.constexpr, ASM: tl.constexpr,
             F32: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """One K step of the up-projection: [BN, BM] gate and up accumulators += W x^T."""
    k = kb + tl.arange(0, 8 * KW)
    xm = valid[None, :] & (k < K)[:, None]
    xk = tl.load(x_ptr + tok[None, :] * stride_x + k[:, None], mask=xm, other=0.0)  # [8 KW, BM]
    acc_g = _acc_step(acc_g, gw, gs, xk, INT4, ASM, F32, MODE)
    acc_u = _acc_step(acc_u, uw, us, xk, INT4, ASM, F32, MODE)
    return acc_g, acc_u


@triton.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _up_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr,
    num_pairs, num_experts, num_mblocks, N_half,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_or,
    K: tl.constexpr, K_CHUNK: tl.constexpr, TOPK: tl.constexpr, INT4: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    F32: tl.constexpr, PREFETCH: tl.constexpr, MODE: tl.constexpr, SV: tl.constexpr,
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
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)  # weights on the MMA's M side
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    k_lo = pid_s * K_CHUNK
    k_end = tl.minimum(k_lo + K_CHUNK, K)
    STEP: tl.constexpr = 8 * KW
    if PREFETCH:  # next step's words are loaded before this step's are converted
        gw, gs = _load_raw(w_base, s_base, n, n_ok, k_lo, k_end, stride_wn, stride_sn, INT4, KW,
                           SV)  # fmt: skip
        uw, us = _load_raw(w_base, s_base, n + N_half, n_ok, k_lo, k_end, stride_wn, stride_sn,
                           INT4, KW, SV)  # fmt: skip
        for kk in range(0, K_CHUNK, STEP):  # constexpr bounds (what the interpreter can run)
            kb = k_lo + kk
            gw2, gs2 = _load_raw(w_base, s_base, n, n_ok, kb + STEP, k_end, stride_wn, stride_sn,
                                 INT4, KW, SV)  # fmt: skip
            uw2, us2 = _load_raw(w_base, s_base, n + N_half, n_ok, kb + STEP, k_end, stride_wn,
                                 stride_sn, INT4, KW, SV)  # fmt: skip
            acc_g, acc_u = _up_step(acc_g, acc_u, gw, gs, uw, us, x_ptr, tok, valid, kb, stride_x,
                                    K, INT4, KW, ASM, F32, MODE)  # fmt: skip
            gw, gs, uw, us = gw2, gs2, uw2, us2
    else:
        for kk in range(0, K_CHUNK, STEP):
            kb = k_lo + kk
            gw, gs = _load_raw(w_base, s_base, n, n_ok, kb, k_end, stride_wn, stride_sn, INT4, KW,
                               SV)  # fmt: skip
            uw, us = _load_raw(w_base, s_base, n + N_half, n_ok, kb, k_end, stride_wn, stride_sn,
                               INT4, KW, SV)  # fmt: skip
            acc_g, acc_u = _up_step(acc_g, acc_u, gw, gs, uw, us, x_ptr, tok, valid, kb, stride_x,
                                    K, INT4, KW, ASM, F32, MODE)  # fmt: skip
    o_ptrs = out_ptr + pid_s * stride_os + rows[None, :].to(tl.int64) * stride_or + n[:, None]
    if SPLIT == 1:  # out is h [rows, N_half] bf16
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(o_ptrs, h.to(tl.bfloat16), mask=n_ok[:, None])
    else:  # out is part [SPLIT, rows, 2 N_half] fp32
        tl.store(o_ptrs, acc_g, mask=n_ok[:, None])
        tl.store(o_ptrs + N_half, acc_u, mask=n_ok[:, None])


@triton.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _down_kernel(
    h_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, tw_ptr,
    num_pairs, num_experts, num_mblocks, N,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    K: tl.constexpr, TOPK: tl.constexpr, INT4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    KW: tl.constexpr, ASM: tl.constexpr, ATOMIC: tl.constexpr, F32: tl.constexpr,
    MODE: tl.constexpr, SV: tl.constexpr,
):  # fmt: skip
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
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for kb in range(0, K, 8 * KW):
        a, b = _load_raw(w_base, s_base, n, n_ok, kb, K, stride_wn, stride_sn, INT4, KW, SV)
        k = kb + tl.arange(0, 8 * KW)
        hk = tl.load(
            h_ptr + rows[None, :] * stride_h + k[:, None], mask=(k < K)[:, None], other=0.0
        )
        acc = _acc_step(acc, a, b, hk, INT4, ASM, F32, MODE)  # [BN, BM]
    y = acc * wt[None, :]
    m = valid[None, :] & n_ok[:, None]
    if ATOMIC:  # out [T, N] fp32
        tl.atomic_add(out_ptr + (pair // TOPK)[None, :] * stride_o + n[:, None], y, mask=m)
    else:  # out [P, N] fp32, one row per (token, slot) pair
        tl.store(out_ptr + pair[None, :] * stride_o + n[:, None], y, mask=m)


LAST_LAUNCH: dict[str, dict] = {}  # kernel -> programs, warps, registers, spills (bench reads it)


def _note_launch(name: str, kernel, grid: int, warps: int) -> None:
    LAST_LAUNCH[name] = dict(
        programs=grid, warps=warps, n_regs=getattr(kernel, "n_regs", None),
        n_spills=getattr(kernel, "n_spills", None), shared=getattr(kernel, "shared", None),
    )  # fmt: skip


_SMS: dict[int, int] = {}


def _num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 132
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def default_config(
    p: int, num_experts: int, inter: int, dev: torch.device, invariant: bool, tuned: bool = False
) -> dict:
    """Tile config: the fixed INVARIANT_CONFIG (both modes: it measured fastest). `tuned`
    (non-invariant only, config={"TUNED": True}): the round-1 shape-dependent choice (BN1=32 at 4
    warps, SPLIT up to 8 for ~4 programs per SM, BM=32 past 14 tokens per expert)."""
    if invariant or not tuned:
        return dict(INVARIANT_CONFIG)
    cfg = dict(INVARIANT_CONFIG, BN1=32, W1=4)
    if p > 14 * num_experts:  # many tokens per expert: taller blocks, 8 warps for the registers
        cfg.update(BM=32, W1=8, W2=8)
    bm, bn1 = cfg["BM"], cfg["BN1"]
    nb = triton.cdiv(p + min(num_experts, p) * (bm - 1), bm)
    programs = nb * triton.cdiv(inter, bn1)
    split = 1
    while split < 8 and programs * split < 4 * _num_sms(dev):
        split *= 2
    return dict(cfg, SPLIT=split)


def fused_moe_v2(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float32, routed_scaling_factor already applied
    weights: ExpertWeights,
    *,
    config: dict | None = None,
    invariant: bool = False,
) -> torch.Tensor:  # [T, H] in x.dtype
    """`moe_ref`'s contract. `config` overrides tile sizes (keys of INVARIANT_CONFIG, ASM,
    ATOMIC); with `invariant` the overrides must themselves be fixed across calls."""
    global ASM_ERROR
    t, hidden = x.shape
    if t > CHUNK and (invariant or not (config or {}).get("TUNED")):  # bounded [P, H] buffer
        return torch.cat([
            fused_moe_v2(x[i : i + CHUNK], topk_ids[i : i + CHUNK], topk_weights[i : i + CHUNK],
                         weights, config=config, invariant=invariant)
            for i in range(0, t, CHUNK)
        ])  # fmt: skip
    topk = topk_ids.shape[1]
    int4 = weights.is_int4
    w13 = weights.w13_packed if int4 else weights.w13
    w2 = weights.w2_packed if int4 else weights.w2
    s13 = weights.w13_scale if int4 else w13  # unused when dense
    s2 = weights.w2_scale if int4 else w2
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    p = t * topk
    config = dict(config or {})
    if "ABLATE" in config:  # bench only: leave one stage out (wrong results)
        config["MODE"] = ABLATIONS[config.pop("ABLATE")]
    tuned = bool(config.pop("TUNED", False)) and not invariant
    cfg = default_config(p, num_experts, inter, x.device, invariant, tuned)
    cfg["ASM"] = (
        int4
        and ASM_ERROR is None
        and x.device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and s13.dtype == torch.bfloat16
        and s2.dtype == torch.bfloat16
    )
    cfg["ATOMIC"] = tuned  # fp32 atomics only in the tuned mode (the fixed-order sum measured
    # no slower)
    asm_auto = "ASM" not in (config or {})
    cfg.update(config or {})
    if t == 0:
        return torch.zeros_like(x)
    args = (x, topk_ids, topk_weights, w13, s13, w2, s2, int4, cfg)
    if not (cfg["ASM"] and asm_auto):
        return _launch(*args)
    try:
        return _launch(*args)
    except Exception as exc:  # noqa: BLE001 - a compile failure of the asm path: use pure Triton
        if not _may_fall_back(exc):
            raise
        ASM_ERROR = f"{type(exc).__name__}: {str(exc)[:500]}"
        log.warning("MoE asm dequant failed, using pure Triton from now on: %s", ASM_ERROR)
        return _launch(*args[:-1], dict(cfg, ASM=False))


def _may_fall_back(exc: Exception) -> bool:
    """Whether a failed fast-path launch may switch the process to the fallback kernel: not for
    CUDA out-of-memory (not a compile problem; the fallback would be disabled for nothing) and not
    during CUDA-graph capture (the capture is already broken and no launch can rescue it)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _up_tma_or_fallback(up_args: tuple, up_kw: dict, interp: bool, cfg: dict):
    """The TMA up kernel; if it fails to compile or launch (first call), the pointer kernel from
    then on (same bits) and TMA_ERROR says why (OOM and errors during graph capture are raised)."""
    global TMA_ERROR
    try:
        return up_tma(up_args, up_kw, interp, cfg["MODE"])
    except Exception as exc:  # noqa: BLE001 - e.g. no TMA on this GPU / triton build
        if not _may_fall_back(exc):
            raise
        TMA_ERROR = f"{type(exc).__name__}: {str(exc)[:500]}"
        log.warning("MoE TMA up kernel failed, using the pointer kernel from now on: %s", TMA_ERROR)
        grid = (up_args[8] * cfg["SPLIT"] * triton.cdiv(up_args[9], cfg["BN1"]),)
        return _up_kernel[grid](
            *up_args, **up_kw, F32=interp, PREFETCH=cfg["PREFETCH"], MODE=cfg["MODE"]
        )


def _launch(x, topk_ids, topk_weights, w13, s13, w2, s2, int4: bool, cfg: dict) -> torch.Tensor:
    t, hidden = x.shape
    topk = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    p = t * topk
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    bm, split, kw1 = cfg["BM"], cfg["SPLIT"], cfg["KW1"]
    one_launch = (x.is_cuda or interp) and p <= FAST_PAIRS  # else the torch ops
    align = align_by_expert_triton if one_launch else align_by_expert
    sorted_pairs, block_expert = align(topk_ids, num_experts, bm)
    nb = block_expert.numel()
    xin = x.to(torch.bfloat16).contiguous()  # [T, H]
    dev = x.device
    h = torch.empty(nb * bm, inter, dtype=torch.bfloat16, device=dev)  # [rows, I]
    part = (
        h if split == 1 else torch.empty(split, nb * bm, 2 * inter, dtype=torch.float32, device=dev)
    )
    k_chunk = triton.cdiv(triton.cdiv(hidden, split), 8 * kw1) * 8 * kw1
    stride_os = 0 if split == 1 else part.stride(0)
    stride_or = h.stride(0) if split == 1 else part.stride(1)
    sv = cfg["SVEC"] and int4 and hidden % 32 == 0 and inter % 32 == 0
    grid_up = nb * split * triton.cdiv(inter, cfg["BN1"])
    up_args = (
        xin, w13, s13, part, sorted_pairs, block_expert,
        p, num_experts, nb, inter,
        xin.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        stride_os, stride_or,
    )  # fmt: skip
    up_kw = dict(K=hidden, K_CHUNK=k_chunk, TOPK=topk, INT4=int4, BM=bm, BN=cfg["BN1"], KW=kw1,
                 SPLIT=split, ASM=cfg["ASM"], SV=sv, num_warps=cfg["W1"],
                 num_stages=cfg["S1"])  # fmt: skip
    if cfg["MAXREG"] and not interp:
        up_kw["maxnreg"] = cfg["MAXREG"]
    if cfg["GEMV"]:  # CUDA-core up-projection (`moe_gemv`)
        k_up = _up_gemv_kernel[(grid_up,)](*up_args, **up_kw)
    elif cfg.get("TMA") and int4 and tma_ok(w13, kw1) and TMA_ERROR is None:
        k_up = _up_tma_or_fallback(up_args, up_kw, interp, cfg)
    else:
        k_up = _up_kernel[(grid_up,)](
            *up_args, **up_kw, F32=interp, PREFETCH=cfg["PREFETCH"], MODE=cfg["MODE"]
        )
    if split > 1:
        _silu_kernel[(nb, triton.cdiv(inter, 64))](
            part, h, block_expert, num_experts, inter, part.stride(0), part.stride(1), h.stride(0),
            SPLIT=split, BM=bm, BC=64,
        )  # fmt: skip
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    rows_out = t if cfg["ATOMIC"] else p
    y = (torch.zeros if cfg["ATOMIC"] else torch.empty)(
        rows_out, hidden, dtype=torch.float32, device=dev
    )
    grid_down = nb * triton.cdiv(hidden, cfg["BN2"])
    down_args = (
        h, w2, s2, y, sorted_pairs, block_expert, tw,
        p, num_experts, nb, hidden,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
    )  # fmt: skip
    meta = dict(TOPK=topk, ASM=cfg["ASM"], ATOMIC=cfg["ATOMIC"], F32=interp, SV=sv, BM=bm,
                num_warps=cfg["W2"], num_stages=cfg["S2"])  # fmt: skip
    if cfg["TMA2"] and int4 and cfg["MODE"] == 0 and down_tma_ok(w2, cfg["KW2"]):
        grid_down = nb * triton.cdiv(hidden, cfg["BN2"] * cfg["NT2"])
        k_down = down_tma(down_args, cfg["NT2"], cfg, meta)
    else:
        k_down = _down_kernel[(grid_down,)](
            *down_args, K=inter, INT4=int4, BN=cfg["BN2"], KW=cfg["KW2"], MODE=cfg["MODE"], **meta
        )
    _note_launch("up", k_up, grid_up, cfg["W1"])
    _note_launch("down", k_down, grid_down, cfg["W2"])
    if cfg["ATOMIC"]:
        return y.to(x.dtype)
    out = torch.empty_like(x)
    _combine_kernel[(t, triton.cdiv(hidden, 1024))](
        y, out, hidden, y.stride(0), out.stride(0), TOPK=topk, BC=1024
    )
    return out
