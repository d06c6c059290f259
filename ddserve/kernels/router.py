"""The MoE router in two Triton launches, batch-invariant: a token's expert ids and weights do not
depend on how many other tokens are in the call or what they are.

1. `_gate_partials_kernel`: the fp32 gate GEMV, spread over (expert blocks x K splits) programs
   and token tiles, each writing its split's partial logits [T, SPLIT, E_PAD]. The default
   (`router_config`, `RouterConfig.mma`) takes one tl.dot "tf32x3" product per K step (three
   tf32 tensor-core products, about fp32 accuracy, row-invariant like `invariant._mm_kernel`):
   at K2.6's gate (tp = 8: 11 MB, E 384, D 7168) 12 expert blocks x 7 splits per 64-token tile.
   A bf16 gate with bf16 x (checkpoints store the gate in bf16; `moe.Router` passes a bf16
   copy when it holds the fp32 values exactly) takes one bf16 product per K step instead: the
   products of two bf16 numbers are exact and the MMA adds them at fp32 precision, as the
   tf32x3 form does, from half the weight bytes and a third of the MMAs.
   Without `mma` a program keeps BLOCK_K fp32 accumulators per (token, expert), each an FMA
   chain over the split's K range in K order, summed with one fixed `tl.sum` tree: exact fp32
   products, but at T in the hundreds the FMAs, not the weight, bound the time.
2. `_select_kernel`, one program per token: logits = partials of splits 0, 1, ... added in that
   order; sigmoid; + bias; the group filter (a group's score is the sum of its two best biased
   scores; the best `topk_group` groups are kept); top-k by descending biased score (ties: lower
   expert id first); weights = the unbiased sigmoid at the ids, divided by their sum (+ 1e-20;
   `invariant_ref.fixed_order_sum`'s pairwise order, so bitwise that sum) when `norm_topk_prob`,
   times `routed_scaling_factor`.

Every choice that shapes a token's arithmetic (tiles, split, warps) is a function of (E, D) only
(`router_config`), never of T; T is not specialised on. The torch reference is
`router_ref.route_ref`; the two agree on ids for inputs without near-ties and on weights to fp32
rounding, not bitwise (different summation order of the gate dot products).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ddserve.kernels import pdl
from ddserve.kernels.invariant import _canonical
from ddserve.kernels.pdl import begin as pdl_begin
from ddserve.kernels.pdl import prefetch_l2
from ddserve.kernels.router_ref import RoutingParams

PROGRAMS_AT_T1 = 4 * 132  # gate programs to aim for at one token (an H200 has 132 SMs)
# Under PDL a gate program of the first token tile prefetches its rows' K range before the wait,
# up to this many bytes: all of it at K2.6 (32 experts x 1024 bf16 values per program).
GATE_PREFETCH_BYTES = 64 << 10
MAX_TOP_K = 32


class RouterConfig(NamedTuple):
    block_t: int  # tokens per gate program
    block_e: int  # experts per gate program
    block_k: int  # fp32 accumulators per (token, expert): the lanes of the FMA chains
    unroll: int  # K steps loaded per loop iteration (bytes in flight)
    split: int  # K ranges, summed in order by the select kernel
    warps: int
    mma: bool = False  # tensor cores (tl.dot "tf32x3", ~fp32) instead of the FMA chains


def router_config(e: int, d: int) -> RouterConfig:
    """The configuration for an [E, D] gate: the tensor-core gate (bf16 products for a bf16
    gate and x, else "tf32x3") in tiles of 64 tokens x 32 experts, 32-wide K steps four at a
    time; K split into the largest number of ranges that divides D's 256-wide chunks while
    ceil(E / 8) x split stays within PROGRAMS_AT_T1 (7 at K2.6's 384 x 7168 gate). A function of
    the weight's shape only.

    Timed on an H200 at K2.6's gate (bench/bench_router.py --sweep, BENCHMARKS.md): with a bf16
    gate 15 us per call from 1 to 17 tokens and 17 us at 170; with an fp32 gate (tf32x3) 26 and
    36 us, against 21 / 28 / 100 us for 8 x 8 tiles of fp32 FMA chains (the fastest FMA form at
    one token). Other bf16 tilings were within 1 us at small T and slower at 170."""
    chunks = triton.cdiv(d, 256)
    e_blocks = triton.cdiv(e, 8)
    split = max(s for s in range(1, chunks + 1) if chunks % s == 0 and e_blocks * s <= max(
        PROGRAMS_AT_T1, e_blocks))  # fmt: skip
    return RouterConfig(64, 32, 32, 4, split, 4, mma=True)


@triton.jit(do_not_specialize=["T"])
def _gate_partials_kernel(
    x_ptr, w_ptr, part_ptr, T, sx, sw,
    E: tl.constexpr, D: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    SPLIT: tl.constexpr, K_PER: tl.constexpr, MMA: tl.constexpr, BF16: tl.constexpr,
    PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_STEP: tl.constexpr,
):  # fmt: skip
    """part[t, s, e] = sum over split s's K range of x[t, k] * w[e, k] (fp32; see the module
    docstring for the order; with MMA, one tensor-core product per BLOCK_K step added in K
    order: bf16 when x and w both are (BF16), else tf32x3). Program (expert block * SPLIT + s,
    token tile). PF_LINES > 0 (PDL launches): the first token tile's programs ask L2 for
    their gate rows' K range (PF_LINES 128-byte lines of PF_STEP values) before the wait."""
    pid = tl.program_id(0)
    eb, s = pid // SPLIT, pid % SPLIT
    rt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    re = eb * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    t_ok, e_ok = rt < T, re < E
    x_rows = x_ptr + rt.to(tl.int64)[:, None] * sx  # [BT, 1]
    w_rows = w_ptr + re.to(tl.int64)[:, None] * sw  # [BE, 1]
    if PF_LINES > 0:  # the gate: no kernel of the forward writes it
        if tl.program_id(1) == 0:
            kl = s * K_PER + tl.arange(0, PF_LINES) * PF_STEP  # [L]
            ok = e_ok[:, None] & (kl < D)[None, :]
            prefetch_l2(tl.where(ok, w_rows + kl[None, :], w_ptr))  # [BE, L]
    pdl_begin(PDL)
    if MMA:  # [BT, BE] accumulators, the MMA's own fixed order within each step
        part = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for i in range(0, K_PER, BLOCK_K * UNROLL):
            for u in tl.static_range(UNROLL):
                kk = s * K_PER + i + u * BLOCK_K + rk  # [BK]
                k_ok = kk < D
                a = tl.load(x_rows + kk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_rows + kk[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
                if BF16:  # bf16 x bf16: exact products, fp32 accumulation, one MMA
                    part = tl.dot(a, tl.trans(b), part)
                else:
                    part = tl.dot(
                        a.to(tl.float32), tl.trans(b.to(tl.float32)), part, input_precision="tf32x3"
                    )
    else:  # BLOCK_K FMA chains per (token, expert), summed by one tl.sum tree at the end
        acc = tl.zeros((BLOCK_T, BLOCK_E, BLOCK_K), dtype=tl.float32)
        for i in range(0, K_PER, BLOCK_K * UNROLL):
            for u in tl.static_range(UNROLL):
                kk = s * K_PER + i + u * BLOCK_K + rk  # [BK]
                k_ok = kk < D
                a = tl.load(x_rows + kk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_rows + kk[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
                a3 = tl.broadcast_to(a.to(tl.float32)[:, None, :], (BLOCK_T, BLOCK_E, BLOCK_K))
                b3 = tl.broadcast_to(b.to(tl.float32)[None, :, :], (BLOCK_T, BLOCK_E, BLOCK_K))
                acc = tl.fma(a3, b3, acc)  # [BT, BE, BK]
        part = tl.sum(acc, axis=2)  # [BT, BE]
    out = part_ptr + rt.to(tl.int64)[:, None] * (SPLIT * E_PAD) + s * E_PAD + re[None, :]
    tl.store(out, part, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _ordered(v):
    """fp32 -> int32 with the same order (negative floats get their magnitude bits flipped)."""
    i = v.to(tl.int32, bitcast=True)
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i)


@triton.jit
def _unordered(o):
    """The inverse of `_ordered`."""
    return tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)


@triton.jit
def _key(v, idx, N: tl.constexpr):
    """An int64 whose max is the largest v, the lowest idx (< N) among equal v."""
    return (_ordered(v).to(tl.int64) << 32) | (N - idx).to(tl.int64)


@triton.jit
def _key_value(key):
    return _unordered((key >> 32).to(tl.int32))


@triton.jit
def _key_index(key, N: tl.constexpr):
    return N - (key - ((key >> 32) << 32)).to(tl.int32)  # the low 32 bits


@triton.jit
def _score(part_ptr, offs, mask, E_PAD: tl.constexpr, SPLIT: tl.constexpr):
    """sigmoid(partials of splits 0, 1, ... added in order) at expert offsets `offs`."""
    logit = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        logit += tl.load(part_ptr + s * E_PAD + offs, mask=mask, other=0.0)
    return tl.div_rn(1.0, 1.0 + tl.exp(-logit))


@triton.jit
def _halve(v, N: tl.constexpr):
    """v[:N/2] + v[N/2:] for v of N elements."""
    return tl.sum(tl.reshape(v, (2, N // 2)), axis=0)


@triton.jit
def _pairwise_sum(v, N: tl.constexpr):
    """`fixed_order_sum` of v (N a power of two <= 32, zeros past the values)."""
    if N >= 32:
        v = _halve(v, 32)
    if N >= 16:
        v = _halve(v, 16)
    if N >= 8:
        v = _halve(v, 8)
    if N >= 4:
        v = _halve(v, 4)
    if N >= 2:
        v = _halve(v, 2)
    return tl.sum(v, axis=0)  # one element


@triton.jit(do_not_specialize=["T"])
def _select_kernel(
    part_ptr, bias_ptr, ids_ptr, wts_ptr, T, scaling,
    E_PAD: tl.constexpr, SPLIT: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    EG: tl.constexpr, EG_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Token t's ids [TOPK] int64 and weights [TOPK] fp32 from its gate partials."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = G_PAD * EG_PAD  # key offsets: every expert index is < N
    part = part_ptr + t * (SPLIT * E_PAD)
    rg = tl.arange(0, G_PAD)  # [GP]
    rj = tl.arange(0, EG_PAD)  # [EGP]
    idx = rg[:, None] * EG + rj[None, :]  # [GP, EGP] expert ids
    ok = (rg[:, None] < G) & (rj[None, :] < EG)
    biased = _score(part, idx, ok, E_PAD, SPLIT) + tl.load(bias_ptr + idx, mask=ok, other=0.0)
    key = _key(tl.where(ok, biased, float("-inf")), idx, N)  # [GP, EGP]
    gone = _ordered(tl.full((), float("-inf"), tl.float32)).to(tl.int64) << 32  # < every key
    if TOPK_GROUP < G:
        first = tl.max(key, axis=1)  # [GP] each group's best
        second = tl.max(tl.where(key == first[:, None], gone, key), axis=1)  # [GP]
        group_score = tl.where(rg < G, _key_value(first) + _key_value(second), float("-inf"))
        group_key = _key(group_score, rg, G_PAD)  # [GP]
        keep = rg < 0  # [GP] all False
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_key, axis=0)
            keep = keep | (group_key == best)
            group_key = tl.where(group_key == best, gone, group_key)
        key = tl.where(keep[:, None], key, gone)
    rk = tl.arange(0, TOPK_PAD)  # [KP]
    ids = tl.zeros((TOPK_PAD,), dtype=tl.int32)  # [KP]
    for i in tl.static_range(TOPK):
        best = tl.max(tl.max(key, axis=1), axis=0)
        ids = tl.where(rk == i, _key_index(best, N), ids)
        key = tl.where(key == best, gone, key)
    k_ok = rk < TOPK
    w = tl.where(k_ok, _score(part, ids, k_ok, E_PAD, SPLIT), 0.0)  # [KP] unbiased scores
    if NORM:
        w = tl.div_rn(w, _pairwise_sum(w, TOPK_PAD) + 1e-20)
    tl.store(ids_ptr + t * TOPK + rk, ids.to(tl.int64), mask=k_ok)
    tl.store(wts_ptr + t * TOPK + rk, w * scaling, mask=k_ok)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, p: RoutingParams) -> None:
    e, d = weight.shape
    assert x.dim() == 2 and x.shape[1] == d, f"x {tuple(x.shape)} vs gate {tuple(weight.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert weight.dtype in (torch.float32, torch.bfloat16), (
        f"gate: fp32 or bf16, not {weight.dtype}"
    )
    assert weight.stride(1) == 1, "gate: unit K stride"
    assert bias.dtype == torch.float32 and bias.shape == (e,) and bias.is_contiguous()
    assert x.device == weight.device == bias.device
    assert e % p.n_group == 0 and 1 <= p.topk_group <= p.n_group, p
    assert 1 <= p.top_k <= min(MAX_TOP_K, p.topk_group * (e // p.n_group)), p


def _check_config(cfg: RouterConfig) -> None:
    for n in (cfg.block_t, cfg.block_e, cfg.block_k):
        assert n & (n - 1) == 0, cfg  # powers of two
    assert cfg.split >= 1 and cfg.unroll >= 1, cfg
    assert not cfg.mma or min(cfg.block_t, cfg.block_e, cfg.block_k) >= 16, cfg  # tl.dot


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    p: RoutingParams,
    cfg: RouterConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], gate weight [E, D] fp32 or bf16, bias [E] fp32 -> ids [T, k] int64, weights
    [T, k] fp32 (`route_ref`'s contract). `cfg` overrides `router_config(E, D)` (benchmarks)."""
    _check(x, weight, bias, p)
    (e, d), t, k = weight.shape, x.shape[0], p.top_k
    cfg = cfg or router_config(e, d)
    _check_config(cfg)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)  # [T, k]
    wts = torch.empty(t, k, dtype=torch.float32, device=x.device)  # [T, k]
    if t == 0:
        return ids, wts
    x, (sx, _) = _canonical(x)
    e_pad = triton.cdiv(e, 16) * 16
    chunk = cfg.block_k * cfg.unroll
    k_per = triton.cdiv(triton.cdiv(d, cfg.split), chunk) * chunk
    part = torch.empty(t, cfg.split, e_pad, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(e, cfg.block_e) * cfg.split, triton.cdiv(t, cfg.block_t))
    launch = pdl.launch_options(x.device)
    pf_step = 128 // weight.element_size()  # gate values per 128-byte line
    pf_lines = 0  # at most GATE_PREFETCH_BYTES per program
    if launch["PDL"] and "router" in pdl.PREFETCH:
        cap = GATE_PREFETCH_BYTES // (128 * cfg.block_e)
        pf_lines = min(triton.next_power_of_2(triton.cdiv(k_per, pf_step)), cap)
    _gate_partials_kernel[grid](
        x, weight, part, t, sx, weight.stride(0), E=e, D=d, E_PAD=e_pad,
        BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k, UNROLL=cfg.unroll,
        SPLIT=cfg.split, K_PER=k_per, MMA=cfg.mma,
        BF16=x.dtype == weight.dtype == torch.bfloat16, PF_LINES=pf_lines, PF_STEP=pf_step,
        num_warps=cfg.warps, **launch,
    )  # fmt: skip
    eg = e // p.n_group
    _select_kernel[(t,)](
        part, bias, ids, wts, t, float(p.scaling), E_PAD=e_pad, SPLIT=cfg.split, G=p.n_group,
        G_PAD=triton.next_power_of_2(p.n_group), EG=eg, EG_PAD=triton.next_power_of_2(eg),
        TOPK_GROUP=p.topk_group, TOPK=k, TOPK_PAD=triton.next_power_of_2(k),
        NORM=p.norm_topk_prob, num_warps=1, **launch,
    )  # fmt: skip
    return ids, wts
