"""The DDTree builder's first stage in two Triton launches: each draft row's top-k tokens and their
log-probs, `log_softmax(logits).clamp_min(floor).topk(k)` without the float copy and the
full-vocabulary log-softmax. No host sync, launch shapes fixed by (B, D, V, k): CUDA-graph safe.

Draft logits [B, D, V] (bf16, fp16 or fp32, read as fp32; finite or -inf, no NaN), R = B * D rows,
each row's tokens in groups of W consecutive tokens (W ~ sqrt(V / k): 64 at K2.6's V 163840 and
k 64). The k groups with the largest maxima (ties: the lower group) hold the row's top-k: a token
outside them has k group maxima above it, so it is not among the k largest.
1. `_segment_kernel`, one program per (segment of SEG tokens, row), many even at 15 rows (40 per
   row at K2.6): the segment's max m, sum of exp(x - m) (fp32), and its groups' maxima. Reads
   every logit once; no selection.
2. `_select_kernel`, one program per row: row max M = max of the m's, log(sum of s * exp(m - M));
   the k groups with the largest maxima, then the k largest of their k * W logits; writes top_lp
   = (logit - M) - log(sum) clamped at `floor`, float32 [B, D, k] sorted descending, and top_tok
   int64 [B, D, k]. Each selection is k rounds of max-and-mask over unique int64 keys (`_key`:
   the value's order-preserving bits, then the lower group / token first).

Why the segments return group maxima and not their own top-k (merged per row): a top-k per
segment costs 2k selection rounds in each of 9,600 programs at 16 streams and k 64 (a first,
uncommitted version of that design compiled offline for sm_90: ~107 instructions per round at 2
warps, ~0.26e9 warp instructions in all, 0.25 ms at the H200's peak issue rate); per row it is
2k rounds in 240 programs (this file at 8 warps: 157 + 186 instructions per pair of rounds,
~0.04e9). Estimates, not timings: bench/bench_tree_build.py times this kernel against the torch
stage and sweeps the launch shape.

Ties: equal logits go lower token first (-0.0 counts as +0.0); tokens clamped to `floor` keep
their logits' order. torch's topk leaves the order of ties unspecified; `draft_topk_ref` has this
kernel's order. Deterministic: every sum and max has a fixed order for a given (V, k, config)
(`tl.sum` / `tl.max` trees of fixed shape, the segments' sums added in one program), so every
tensor-parallel rank builds the same tree from the same logits, and a row's outputs do not depend
on the other rows. The log-probs differ from torch's log_softmax in the last bits (another
summation order). A row without a finite logit (never a drafter's) gives `floor` on the GPU
(the clamp's max drops the NaN) and NaN in Triton's interpreter and in torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ddserve.kernels import pdl
from ddserve.kernels.pdl import begin as pdl_begin
from ddserve.kernels.router import _ordered, _unordered  # fp32 <-> order-preserving int32

MAX_K = 256  # larger k: the torch first stage
MAX_SELECT = 16384  # keys one selection may read (groups per row, k_pad * W logits)
IDX_MAX = 2**31 - 1  # the key's low 32 bits are IDX_MAX - token: V must stay below it
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TopkConfig(NamedTuple):
    segment: int  # tokens per segment program (a power of two, a multiple of width)
    width: int  # W: tokens per group (a power of two)
    warps: int  # per segment program
    select_warps: int  # per row program


def topk_config(
    v: int, k: int, segment: int = 4096, warps: int = 4, select_warps: int = 8
) -> TopkConfig:
    """The launch shape for V tokens and top-k: W the smallest power of two with k_pad * W >= V / W
    (the two selections then read about as many keys each), SEG = `segment` (a power of two) but
    at most V's next power of two and at least W. K2.6 (V 163840): W 64 for k 64 (2560 groups,
    4096 logits re-read), 128 for k 16, 32 for k 256; 40 segments of 4096. The warps are guesses
    until timed (bench/bench_tree_build.py sweeps them)."""
    k_pad = triton.next_power_of_2(k)
    width = triton.next_power_of_2(math.isqrt(triton.cdiv(v, k_pad) - 1) + 1)
    seg = max(min(triton.next_power_of_2(segment), triton.next_power_of_2(v)), width)
    return TopkConfig(seg, width, warps, select_warps)


def supports(draft_logits: torch.Tensor, k: int) -> bool:
    """Whether `draft_topk` takes these logits and k (shapes and dtype only; no sync)."""
    v = draft_logits.shape[-1]
    if draft_logits.dim() != 3 or draft_logits.dtype not in DTYPES or not 1 <= k <= min(MAX_K, v):
        return False
    if draft_logits.stride(2) != 1:  # the kernels read each row's tokens contiguously
        return False
    cfg = topk_config(v, k)
    _, nh = _sizes(v, cfg)
    return v < IDX_MAX and _selects(cfg, triton.next_power_of_2(k), nh) <= MAX_SELECT


def _sizes(v: int, cfg: TopkConfig) -> tuple[int, int]:
    """(segments, groups) per row; the groups of the last segment past V included."""
    nseg = triton.cdiv(v, cfg.segment)
    return nseg, nseg * (cfg.segment // cfg.width)


def _selects(cfg: TopkConfig, k_pad: int, nh: int) -> int:
    """Keys the larger of the two selections reads."""
    return max(triton.next_power_of_2(nh), k_pad * cfg.width)


@triton.jit
def _key(v, low):
    """int64 keys ordered by v (-0.0 as +0.0), then by `low` (a nonnegative int32)."""
    v = tl.where(v == 0.0, 0.0, v)
    return (_ordered(v).to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def _gone():
    """A key below every key of a real logit (-inf, low bits 0): padding, and taken keys."""
    return _ordered(tl.full((), float("-inf"), tl.float32)).to(tl.int64) << 32


@triton.jit
def _low(key):
    return (key - ((key >> 32) << 32)).to(tl.int32)  # the low 32 bits


@triton.jit
def _flip(i):
    """IDX_MAX - i: a token's low key bits (lower token, larger key) and back."""
    return 0x7FFFFFFF - i


@triton.jit
def _take(keys, gone, K: tl.constexpr, K_PAD: tl.constexpr):
    """The K largest of `keys` [N] (unique apart from `gone`, `_gone()`), descending, in a
    [K_PAD] vector (`gone` past K): K rounds of max-and-mask."""
    rk = tl.arange(0, K_PAD)
    out = tl.zeros((K_PAD,), dtype=tl.int64) + gone
    for i in range(K):  # a loop, not unrolled: K up to MAX_K rounds
        best = tl.max(keys, axis=0)
        out = tl.where(rk == i, best, out)
        keys = tl.where(keys == best, gone, keys)
    return out


@triton.jit
def _segment_kernel(
    x_ptr, heads_ptr, stats_ptr, sb, sd,
    D: tl.constexpr, V: tl.constexpr, NSEG: tl.constexpr, SEG: tl.constexpr, W: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Segment s of row r: stats[r, s] = (max, sum of exp(x - max)); heads[r, s * G + j] = the
    max of its group j (G = SEG / W groups; -inf for groups past V)."""
    pdl_begin(PDL)
    s, r = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = SEG // W
    row = x_ptr + (r // D).to(tl.int64) * sb + (r % D).to(tl.int64) * sd
    rg = tl.arange(0, G)  # [G]
    tok = s * SEG + rg[:, None] * W + tl.arange(0, W)[None, :]  # [G, W]
    x = tl.load(row + tok, mask=tok < V, other=float("-inf")).to(tl.float32)  # [G, W]
    group_max = tl.max(x, axis=1)  # [G]
    m = tl.max(group_max, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a segment of -inf sums to 0, not NaN
    total = tl.sum(tl.sum(tl.exp(x - m_safe), axis=1), axis=0)
    out = r.to(tl.int64) * NSEG + s
    tl.store(stats_ptr + out * 2, m)
    tl.store(stats_ptr + out * 2 + 1, total)
    tl.store(heads_ptr + out * G + rg, group_max)


@triton.jit
def _select_kernel(
    x_ptr, heads_ptr, stats_ptr, lp_ptr, tok_ptr, sb, sd, floor,
    D: tl.constexpr, V: tl.constexpr, NSEG: tl.constexpr, NSEG_PAD: tl.constexpr,
    NH: tl.constexpr, NH_PAD: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
    K_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Row r's top-K log-probs and tokens from its segments' stats and group maxima (NH groups
    of W tokens), re-reading the logits of the K best groups."""
    pdl_begin(PDL)
    r = tl.program_id(0)
    js = tl.arange(0, NSEG_PAD)
    stats = stats_ptr + (r.to(tl.int64) * NSEG + js) * 2
    m = tl.load(stats, mask=js < NSEG, other=float("-inf"))  # [NSEG_PAD]
    s = tl.load(stats + 1, mask=js < NSEG, other=0.0)
    big = tl.max(m, axis=0)
    log_total = tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    gone = _gone()
    # The K groups with the largest maxima, ties to the lower group (= the lower tokens).
    rh = tl.arange(0, NH_PAD)
    head = tl.load(heads_ptr + r.to(tl.int64) * NH + rh, mask=rh < NH, other=0.0)
    g = NH_PAD - _low(_take(tl.where(rh < NH, _key(head, NH_PAD - rh), gone), gone, K, K_PAD))
    row = x_ptr + (r // D).to(tl.int64) * sb + (r % D).to(tl.int64) * sd
    tok = g[:, None] * W + tl.arange(0, W)[None, :]  # [K_PAD, W]; g = NH_PAD past the K
    ok = (g < NH)[:, None] & (tok < V)
    x = tl.load(row + tok, mask=ok, other=float("-inf")).to(tl.float32)
    cand = tl.where(ok, _key(x, _flip(tok)), gone)  # [K_PAD, W]
    top = _take(tl.reshape(cand, (K_PAD * W,)), gone, K, K_PAD)  # [K_PAD]
    logit = _unordered((top >> 32).to(tl.int32))
    lp = tl.maximum((logit - big) - log_total, floor)
    rk = tl.arange(0, K_PAD)
    out = r.to(tl.int64) * K + rk
    tl.store(lp_ptr + out, lp, mask=rk < K)
    tl.store(tok_ptr + out, _flip(_low(top)).to(tl.int64), mask=rk < K)


def draft_topk(
    draft_logits: torch.Tensor, k: int, floor: float, cfg: TopkConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [B, D, V] -> (top_lp [B, D, k] float32 descending, top_tok [B, D, k] int64):
    the k largest logits of each row (ties: lower token), top_lp = log_softmax clamped at
    `floor`. `cfg` overrides `topk_config(V, k)` (tests, benchmarks)."""
    assert supports(draft_logits, k), (tuple(draft_logits.shape), draft_logits.dtype, k)
    assert draft_logits.stride(2) == 1, "logits: unit stride over the vocabulary"
    b, d, v = draft_logits.shape
    cfg = cfg or topk_config(v, k)
    k_pad, (nseg, nh) = triton.next_power_of_2(k), _sizes(v, cfg)
    _check_config(cfg, k_pad, nh)
    dev = draft_logits.device
    top_lp = torch.empty(b, d, k, dtype=torch.float32, device=dev)
    top_tok = torch.empty(b, d, k, dtype=torch.int64, device=dev)
    if b * d == 0:
        return top_lp, top_tok
    heads = torch.empty(b * d, nh, dtype=torch.float32, device=dev)  # [R, NH] group maxima
    stats = torch.empty(b * d, nseg, 2, dtype=torch.float32, device=dev)  # [R, NSEG, (m, s)]
    strides = (draft_logits.stride(0), draft_logits.stride(1))
    launch = pdl.launch_options(dev)
    _segment_kernel[(nseg, b * d)](
        draft_logits, heads, stats, *strides, D=d, V=v, NSEG=nseg, SEG=cfg.segment, W=cfg.width,
        num_warps=cfg.warps, **launch,
    )  # fmt: skip
    _select_kernel[(b * d,)](
        draft_logits, heads, stats, top_lp, top_tok, *strides, float(floor), D=d, V=v,
        NSEG=nseg, NSEG_PAD=triton.next_power_of_2(nseg), NH=nh,
        NH_PAD=triton.next_power_of_2(nh), W=cfg.width, K=k, K_PAD=k_pad,
        num_warps=cfg.select_warps, **launch,
    )  # fmt: skip
    return top_lp, top_tok


def _check_config(cfg: TopkConfig, k_pad: int, nh: int) -> None:
    for n in (cfg.segment, cfg.width):
        assert n & (n - 1) == 0, cfg  # powers of two
    assert cfg.width <= cfg.segment, cfg
    assert _selects(cfg, k_pad, nh) <= MAX_SELECT, cfg


def draft_topk_ref(
    draft_logits: torch.Tensor, k: int, floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_topk`'s contract in torch ops: the k largest logits by a stable descending sort
    (ties: lower token), their log_softmax clamped at `floor`."""
    x = draft_logits.float()  # [B, D, V]
    tok = x.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [B, D, k]
    return x.log_softmax(dim=-1).gather(-1, tok).clamp_min(floor), tok
