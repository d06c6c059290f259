"""Variant "v2" of the W4A16 grouped MoE: split-K up-projection, bf16x2 asm dequant, fixed-order
sums. Reads the compressed-tensors INT4 layout as shipped (no repack) and dense bf16 experts;
the MoE runs it where v3 does not apply (dense experts, non-bf16 scales) or failed.

Launches after the expert alignment (`moe_align`: the Triton counting sort, one or two launches,
up to 8192 pairs, else the torch ops of `align_by_expert`; no host sync):

1. up:      part[s, r] = x_t @ W13_e[:, K-split s]^T (fp32), SPLIT programs per (block, columns),
            each walking K / SPLIT columns (more loads in flight when few experts are touched).
            With SPLIT == 1 the SiLU-mul is fused and h is written directly. The next K step's
            words are loaded (into registers) before this step's are dequantized.
2. silu:    h[r] = silu(sum_s gate part) * (sum_s up part), splits summed in order 0..SPLIT-1, bf16.
3. down:    y[p] = w_p * (h[p] @ W2_e^T), stored per pair ([P, H] fp32), then
4. combine: out[t] = sum_j y[t * k + j] in slot order j = 0..k-1, cast to x.dtype.

Batch invariance (whatever `invariant` says): the tile config (BM, BN, KW, SPLIT, warps, stages)
is fixed, not picked from T; the kernels are compiled without specializing on T-dependent
integers; every sum over K splits and top-k slots is in a fixed order with no atomics; calls with
more than `CHUNK` tokens are split on the host (per-token arithmetic is unchanged). So a token's
output row does not depend on the other tokens in the call or on their routing (MMA results per
element do not depend on other rows/columns of a tile when the compiled kernel is the same).

ASM dequant (`ASM`, on by default on CUDA with bf16 scales): see `moe_w4_tiles`. If it fails to
compile, the call falls back to pure Triton and ASM_ERROR says why (the same bits). Errors that
are not compile failures are raised, not turned into a fallback: CUDA out-of-memory, and any
error during CUDA-graph capture (a fallback launch cannot be captured there either).
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from ddserve.kernels.moe_align import MAX_PAIRS, align_by_expert, align_by_expert_triton
from ddserve.kernels.moe_common import may_fall_back
from ddserve.kernels.moe_reduce import _combine_kernel, _silu_kernel
from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.kernels.moe_w4_tiles import acc_step, load_raw

log = logging.getLogger(__name__)

ASM_ERROR: str | None = None  # set when the asm dequant failed to compile (then auto-off)
CHUNK = 1024  # tokens per call (bounds the [P, H] fp32 per-pair buffer)
# On an H200 (BENCHMARKS.md, W4A16 MoE): BN1=64 at 8 warps is the fastest v2 tiling measured at
# every T (1 .. 768); one load per scale group plus maxnreg 128 on the up kernel (ptxas sm_90: 130
# registers, two 8-warp programs per SM) is 1.5-1.6x faster than per-word scale loads
# (bench/results/moe_variants_round2_2026-11-30.json). Down: BN2=64 KW2=32 (all of K = 256 in one
# step), 132 registers.
# Keys a caller may override (tests cross tile edges with them); the engine uses these values.
INVARIANT_CONFIG = dict(
    BM=16, BN1=64, SPLIT=4, KW1=16, BN2=64, KW2=32, W1=8, W2=4, S1=3, S2=2, MAXREG=128,
)  # fmt: skip


@triton.jit
def _up_step(acc_g, acc_u, gw, gs, uw, us, x_ptr, tok, valid, kb, stride_x,
             K: tl.constexpr, INT4: tl.constexpr, KW: tl.constexpr, ASM: tl.constexpr,
             F32: tl.constexpr):  # fmt: skip
    """One K step of the up-projection: [BN, BM] gate and up accumulators += W x^T."""
    k = kb + tl.arange(0, 8 * KW)
    xm = valid[None, :] & (k < K)[:, None]
    xk = tl.load(x_ptr + tok[None, :] * stride_x + k[:, None], mask=xm, other=0.0)  # [8 KW, BM]
    acc_g = acc_step(acc_g, gw, gs, xk, INT4, ASM, F32)
    acc_u = acc_step(acc_u, uw, us, xk, INT4, ASM, F32)
    return acc_g, acc_u


@triton.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _up_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr,
    num_pairs, num_experts, num_mblocks, N_half,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_or,
    K: tl.constexpr, K_CHUNK: tl.constexpr, TOPK: tl.constexpr, INT4: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, KW: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    F32: tl.constexpr, SV: tl.constexpr,
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
    # the next step's words are loaded before this step's are converted
    gw, gs = load_raw(w_base, s_base, n, n_ok, k_lo, k_end, stride_wn, stride_sn, INT4, KW, SV)
    uw, us = load_raw(w_base, s_base, n + N_half, n_ok, k_lo, k_end, stride_wn, stride_sn, INT4,
                      KW, SV)  # fmt: skip
    for kk in range(0, K_CHUNK, STEP):  # constexpr bounds (what the interpreter can run)
        kb = k_lo + kk
        gw2, gs2 = load_raw(w_base, s_base, n, n_ok, kb + STEP, k_end, stride_wn, stride_sn, INT4,
                            KW, SV)  # fmt: skip
        uw2, us2 = load_raw(w_base, s_base, n + N_half, n_ok, kb + STEP, k_end, stride_wn,
                            stride_sn, INT4, KW, SV)  # fmt: skip
        acc_g, acc_u = _up_step(acc_g, acc_u, gw, gs, uw, us, x_ptr, tok, valid, kb, stride_x,
                                K, INT4, KW, ASM, F32)  # fmt: skip
        gw, gs, uw, us = gw2, gs2, uw2, us2
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
    KW: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, SV: tl.constexpr,
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
        a, b = load_raw(w_base, s_base, n, n_ok, kb, K, stride_wn, stride_sn, INT4, KW, SV)
        k = kb + tl.arange(0, 8 * KW)
        hk = tl.load(
            h_ptr + rows[None, :] * stride_h + k[:, None], mask=(k < K)[:, None], other=0.0
        )
        acc = acc_step(acc, a, b, hk, INT4, ASM, F32)  # [BN, BM]
    y = acc * wt[None, :]
    m = valid[None, :] & n_ok[:, None]
    tl.store(out_ptr + pair[None, :] * stride_o + n[:, None], y, mask=m)  # [P, N] fp32 per pair


LAST_LAUNCH: dict[str, dict] = {}  # kernel -> programs, warps, registers, spills (bench reads it)


def _note_launch(name: str, kernel, grid: int, warps: int) -> None:
    LAST_LAUNCH[name] = dict(
        programs=grid, warps=warps, n_regs=getattr(kernel, "n_regs", None),
        n_spills=getattr(kernel, "n_spills", None), shared=getattr(kernel, "shared", None),
    )  # fmt: skip


def fused_moe_v2(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float32, routed_scaling_factor already applied
    weights: ExpertWeights,
    *,
    config: dict | None = None,
    invariant: bool = True,  # always: the config is fixed
) -> torch.Tensor:  # [T, H] in x.dtype
    """`moe_ref`'s contract. `config` overrides keys of INVARIANT_CONFIG and ASM (tests)."""
    global ASM_ERROR
    t, hidden = x.shape
    if t > CHUNK:  # bounded [P, H] buffer
        return torch.cat([
            fused_moe_v2(x[i : i + CHUNK], topk_ids[i : i + CHUNK], topk_weights[i : i + CHUNK],
                         weights, config=config)
            for i in range(0, t, CHUNK)
        ])  # fmt: skip
    int4 = weights.is_int4
    w13 = weights.w13_packed if int4 else weights.w13
    w2 = weights.w2_packed if int4 else weights.w2
    s13 = weights.w13_scale if int4 else w13  # unused when dense
    s2 = weights.w2_scale if int4 else w2
    unknown = set(config or {}) - set(INVARIANT_CONFIG) - {"ASM"}
    if unknown:
        raise ValueError(f"MoE v2 config: unknown keys {sorted(unknown)}")
    cfg = dict(INVARIANT_CONFIG)
    cfg["ASM"] = (
        int4
        and ASM_ERROR is None
        and x.device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and s13.dtype == torch.bfloat16
        and s2.dtype == torch.bfloat16
    )
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
        if not may_fall_back(exc):
            raise
        ASM_ERROR = f"{type(exc).__name__}: {str(exc)[:500]}"
        log.warning("MoE asm dequant failed, using pure Triton from now on: %s", ASM_ERROR)
        return _launch(*args[:-1], dict(cfg, ASM=False))


def _launch(x, topk_ids, topk_weights, w13, s13, w2, s2, int4: bool, cfg: dict) -> torch.Tensor:
    t, hidden = x.shape
    topk = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    p = t * topk
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    bm, split, kw1 = cfg["BM"], cfg["SPLIT"], cfg["KW1"]
    on_triton = (x.is_cuda or interp) and p <= MAX_PAIRS  # else the torch ops
    align = align_by_expert_triton if on_triton else align_by_expert
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
    sv = int4 and hidden % 32 == 0 and inter % 32 == 0  # one load per scale group
    grid_up = nb * split * triton.cdiv(inter, cfg["BN1"])
    up_kw = dict(K=hidden, K_CHUNK=k_chunk, TOPK=topk, INT4=int4, BM=bm, BN=cfg["BN1"], KW=kw1,
                 SPLIT=split, ASM=cfg["ASM"], SV=sv, F32=interp, num_warps=cfg["W1"],
                 num_stages=cfg["S1"])  # fmt: skip
    if cfg["MAXREG"] and not interp:
        up_kw["maxnreg"] = cfg["MAXREG"]
    k_up = _up_kernel[(grid_up,)](
        xin, w13, s13, part, sorted_pairs, block_expert,
        p, num_experts, nb, inter,
        xin.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        stride_os, stride_or, **up_kw,
    )  # fmt: skip
    if split > 1:
        _silu_kernel[(nb, triton.cdiv(inter, 64))](
            part, h, block_expert, num_experts, inter, part.stride(0), part.stride(1), h.stride(0),
            SPLIT=split, BM=bm, BC=64, PDL=False,
        )  # fmt: skip
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    y = torch.empty(p, hidden, dtype=torch.float32, device=dev)  # [P, H] weighted, per pair
    grid_down = nb * triton.cdiv(hidden, cfg["BN2"])
    k_down = _down_kernel[(grid_down,)](
        h, w2, s2, y, sorted_pairs, block_expert, tw,
        p, num_experts, nb, hidden,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        K=inter, TOPK=topk, INT4=int4, BM=bm, BN=cfg["BN2"], KW=cfg["KW2"], ASM=cfg["ASM"],
        F32=interp, SV=sv, num_warps=cfg["W2"], num_stages=cfg["S2"],
    )  # fmt: skip
    _note_launch("up", k_up, grid_up, cfg["W1"])
    _note_launch("down", k_down, grid_down, cfg["W2"])
    out = torch.empty_like(x)
    _combine_kernel[(t, triton.cdiv(hidden, 1024))](
        y, out, hidden, y.stride(0), out.stride(0), TOPK=topk, BC=1024, PDL=False
    )
    return out
