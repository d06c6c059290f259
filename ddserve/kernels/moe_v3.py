"""Host side of the W4A16 MoE variant "v3" (`moe_gluon` kernel, `moe_w4_repack` weight stream).

Same contract as `moe_ref` / `fused_moe_v2`, INT4 weights with bf16 scales on CUDA only (mma.sync:
sm_80+, run on sm_90 only; Gluon kernels do not run in the Triton interpreter). Batch invariant
by construction: every sum runs in an order fixed by the weight shapes (128-column K steps, then
the SPLIT partials in split order, then the top-k slots in `_combine_kernel`, or in the caller's
`invariant.linear(..., add_topk=k)` epilogue with combine=False); the tiles picked per call (BM,
NT) and the block order (expert order from the alignment, slot order for one token, which needs
no alignment) only change which threads compute which outputs.

Launches: up GEMM, SiLU-and-mul, down GEMM, combine. FUSED_SILU folds the SiLU-and-mul into the
up GEMM's launch (`moe_gluon._w4_up_silu_kernel`: the last of a unit's programs, counted by an
int32 ticket, sums the partials and writes h); it gives the bits of the separate
`moe_reduce._silu_kernel` launch (the same operations in the same order), and needs the
intermediate size to be a multiple of the up tile's rows (`fuses_silu`; else the two launches).
The tickets (`_Tickets`) are the only atomics and decide nothing but which program sums.

The repacked weights are made on first use (`prepare`): written over the original tensors when
their owner allows it (the model's experts: `ExpertWeights.repack_in_place`), else a cached copy
next to the compressed-tensors originals that the other variants read.
"""

from __future__ import annotations

import logging

import torch
import triton

from ddserve.kernels import backend, pdl
from ddserve.kernels.moe_align import MAX_PAIRS, align_by_expert, align_by_expert_triton
from ddserve.kernels.moe_common import num_sms
from ddserve.kernels.moe_reduce import _combine_kernel, _silu_kernel
from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.kernels.moe_w4_repack import (
    Repacked,
    as_stream,
    fits_in_place,
    in_place_config,
    in_place_started,
    repack,
    repack_in_place,
)

# SPLIT (the up projection's K split) and the 128-column K step fix each output's summation order:
# they depend on the weight shapes only. The other keys only say which threads compute what (the
# mma.sync of a token's column does not see the other columns), so "auto" picks them per call:
# BM (tokens per block) from the tokens per expert, NT (down n-tiles per program) from the grid.
# W and NREP set the repacked layout (one stream per weights). FUSED_SILU: SiLU-and-mul in the
# up GEMM's launch instead of a launch of its own (same bits). UNROLL: the step loop unrolled
# ("auto": `_unroll`; same bits). PFA: each step of the up GEMM asks L2 for the lines of the step
# PFA ahead (0: none; "auto": `pick_pfa`; same bits). PAIRS: the dtype of the down GEMM's
# weighted per-pair outputs, "bf16" (each rounded once from its fp32 value: half the bytes the
# down GEMM writes and its combine reads) or "fp32"; the top-k sum runs in fp32 either way. It
# fixes each pair's rounding, so like SPLIT it depends on nothing per call. The bench overrides
# any key.
CONFIG = dict(
    W=4, NREP=2, BM="auto", SPLIT=4, NT="auto", DEPTH=1, UNROLL="auto", FUSED_SILU=True,
    PFA="auto", PAIRS="bf16",
)  # fmt: skip
PAIR_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
log = logging.getLogger(__name__)
CHUNK = 1024  # tokens per launch set (bounds the [P, H] per-pair buffer)
LAST_LAUNCH: dict[str, dict] = {}


def prepare(weights: ExpertWeights, w: int = 4, nrep: int = 2) -> tuple[Repacked, Repacked]:
    """The (w13, w2) streams for this tile config.

    `weights.repack_in_place` (the model's own experts): written over the original tensors once
    (`repack_in_place`), no extra memory. Otherwise a copy, made once per weight tensors and
    cached as an attribute of the w13 packed tensor (its lifetime), keyed by the tensors'
    in-place versions (a weight load after the first call repacks again); `ExpertWeights` itself
    is rebuilt per forward by the model, so it cannot hold the cache."""
    if not weights.is_int4:
        raise ValueError("MoE v3 needs INT4 weights")
    tensors = (weights.w13_packed, weights.w13_scale, weights.w2_packed, weights.w2_scale)
    done = in_place_config(weights.w13_packed)
    if done is not None and in_place_config(weights.w2_packed) == done:
        if done != (w, nrep):
            raise ValueError(
                f"experts were repacked in place for (W, NREP) = {done}, not {(w, nrep)}"
            )
        return as_stream(*tensors[:2]), as_stream(*tensors[2:])
    fits = all(fits_in_place(t, w, nrep) for t in (weights.w13_packed, weights.w2_packed))
    if weights.repack_in_place and fits:
        _not_capturing()
        if not in_place_started(weights.w13_packed):  # (a resumed rewrite has compiled before)
            _compiles(weights, w, nrep)  # before the originals are gone (v2 cannot read the stream)
        return (
            repack_in_place(weights.w13_packed, weights.w13_scale, w, nrep),
            repack_in_place(weights.w2_packed, weights.w2_scale, w, nrep),
        )
    if weights.repack_in_place and not _WARNED:
        _warn_copy(weights)
    key = (w, nrep, *(t._version for t in tensors), *(t.data_ptr() for t in tensors))
    cache = getattr(weights.w13_packed, "_ddserve_v3", None)
    if cache is None:
        cache = {}
        weights.w13_packed._ddserve_v3 = cache
    if key not in cache:
        _not_capturing()
        cache.clear()  # one config at a time per tensor (the bench sweeps configs in sequence)
        cache[key] = (
            repack(weights.w13_packed, weights.w13_scale, w, nrep),
            repack(weights.w2_packed, weights.w2_scale, w, nrep),
        )
    return cache[key]


_WARNED = False


def _warn_copy(weights: ExpertWeights) -> None:
    global _WARNED
    _WARNED = True
    log.warning(
        "MoE v3: expert shapes %s / %s are not multiples of the 128 x 128 tile, so the experts "
        "are repacked into a padded copy (extra memory) instead of in place",
        tuple(weights.w13_packed.shape), tuple(weights.w2_packed.shape),
    )  # fmt: skip


def _compiles(weights: ExpertWeights, w: int, nrep: int) -> None:
    """One token through a copy of expert 0 with these tiles: a GPU or Triton build that cannot
    run the Gluon kernel fails here, while the caller can still fall back to v2."""
    one = ExpertWeights(
        w13_packed=weights.w13_packed[:1].clone(), w13_scale=weights.w13_scale[:1].clone(),
        w2_packed=weights.w2_packed[:1].clone(), w2_scale=weights.w2_scale[:1].clone(),
    )  # fmt: skip
    dev = weights.w13_packed.device
    x = torch.zeros(1, weights.w13_packed.shape[2] * 8, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    fused_moe_v3(x, ids, torch.ones(1, 1, device=dev), one, config=dict(W=w, NREP=nrep))
    torch.cuda.synchronize(dev)


UNROLL_STEPS = 16  # "auto" unrolls a program's step loop up to this many steps, at BM 8


def _unroll(cfg: dict, steps: int) -> bool:
    """Whether a launch's step loop is unrolled (the same arithmetic either way). Unrolled, the
    compiler issues each step's weight, scale and x loads about a step before they are read (sm_90
    SASS, `bench/sass_loop.py`); in the loop it issues the scales and x at the step's start and
    the next weights at its end, so a lone warp waits on memory every step. H200, K2.6 shapes
    (bench/results/step/moe_unroll_h200_2026-12-02.json): at BM 8 (up to 6 tokens per expert)
    unrolled is 2-10% faster (T=1: 24.8 vs 27.4 us; T=192: 360.5 vs 369.1); at BM 16 the unrolled
    up GEMM takes 169 registers (rolled: 126) and is 37% slower (T=384: 671 vs 490 us); at BM 32
    it would need more than 255."""
    if cfg["UNROLL"] != "auto":
        return bool(cfg["UNROLL"])
    return cfg["BM"] == 8 and steps <= UNROLL_STEPS


def _config(overrides: dict | None) -> dict:
    """CONFIG with the overrides, checked (a misspelled key must not be silently ignored)."""
    unknown = set(overrides or {}) - set(CONFIG)
    if unknown:
        raise ValueError(f"MoE v3 config: unknown keys {sorted(unknown)} (known: {sorted(CONFIG)})")
    cfg = dict(CONFIG, **(overrides or {}))
    allowed = dict(
        W=(2, 4, 8), NREP=(1, 2, 4), BM=("auto", 8, 16, 32), DEPTH=(1, 2),
        UNROLL=("auto", False, True), FUSED_SILU=(False, True),
        PFA=("auto", 0, 1, 2, 3, 4, 6), PAIRS=tuple(PAIR_DTYPES),
    )  # fmt: skip
    for key, values in allowed.items():
        if cfg[key] not in values:
            raise ValueError(f"MoE v3 config: {key}={cfg[key]!r}, expected one of {values}")
    return cfg


def _not_capturing() -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "MoE v3: the experts' stream must be made before CUDA-graph capture (run one eager "
            "forward first, as the engine's warm-up does); a captured repack would rerun per replay"
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


_ONE_TOKEN_PAIRS: dict[tuple, torch.Tensor] = {}  # kept: captured graphs hold their addresses


def _one_token_blocks(topk_ids: torch.Tensor, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [k * bm], block_expert [k]) for one token without the alignment launch:
    block j holds pair j (slot j) in its first row and padding (k) in the others, its expert is
    topk_ids[0, j]. Blocks in slot order instead of expert order change no output bit: a pair's
    rows are computed within its block and written to the pair's own rows."""
    k = topk_ids.shape[1]
    key = (k, bm, topk_ids.device)
    pairs = _ONE_TOKEN_PAIRS.get(key)
    if pairs is None:
        if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MoE v3: run one eager one-token forward before graph capture")
        pairs = torch.full((k, bm), k, dtype=torch.int64)
        pairs[:, 0] = torch.arange(k)
        pairs = _ONE_TOKEN_PAIRS[key] = pairs.reshape(-1).to(topk_ids.device)
    return pairs, topk_ids.reshape(-1)


def pick_bm(pairs: int, num_experts: int) -> int:
    """Tokens per block: 8 while most touched experts get a few tokens (less padding in the MMA
    and in x), 16 past that (an expert's weights are streamed once per block). H200, K2.6
    shapes (bench/results/moe_v3_round2_2026-11-30.json): BM 8 fastest up to 4 tokens per
    expert, even at 8, BM 16 ahead at 16 (947 us vs 1043 for 8 and 1071 for 32)."""
    return 8 if pairs / num_experts <= 6 else 16


def pick_nt(n_tiles: int, blocks: int, sms: int) -> int:
    """Down-projection n-tiles per program: 4 (the x tile and prologue amortized) unless that
    leaves fewer than two programs per SM (decode: few blocks)."""
    for nt in (4, 2):
        if n_tiles % nt == 0 and blocks * n_tiles // nt >= 2 * sms:
            return nt
    return 1


PFA_FEW_PROGRAMS = 2  # `pick_pfa` for up launches of at most one program per SM


def pick_pfa(cfg: dict, programs: int, sms: int) -> int:
    """Steps ahead whose weight and scale lines each step of the up GEMM asks from L2
    (`moe_gluon._prefetch_step`): PFA_FEW_PROGRAMS when the launch has at most one program per
    SM, else none. Then each program streams its steps (14 at K2.6's hidden size) with one
    4-warp program per SM, each step's loads issued about one step before they are read, so a
    step waits on HBM; with more programs than SMs the asks only add traffic. Measured at K2.6's
    tp = 8 shapes only, where one token gives 128 up programs and ten give 1,152 (H200,
    bench/results/step/moe_pfa_h200_2026-12-03.json, the MoE op in us with PFA 0 / 2 / 3 / 4 /
    6 at every T): one token 24.7 / 23.4 / 24.1 / 24.0 / 25.4; ten 84.1 / 90.2 / 95.3 / 99.9 /
    107.7; 192 tokens 355 / 385 / 398 / 409 / 436. The down GEMM never asks: at one token its
    programs run two steps, both loaded at the start."""
    if cfg["PFA"] != "auto":
        return cfg["PFA"]
    return PFA_FEW_PROGRAMS if programs <= sms else 0


def fuses_silu(cfg: dict, inter: int, up_tile_rows: int) -> bool:
    """Whether the up GEMM's launch also applies SiLU-and-mul: asked for (FUSED_SILU) and every
    up n-tile holds gate columns only or up columns only (I a multiple of the tile's rows), so a
    (block, gate tile) unit is complete after 2 SPLIT programs."""
    return bool(cfg["FUSED_SILU"]) and inter % up_tile_rows == 0


class _Tickets:
    """One device's int32 arrival counters for `_w4_up_silu_kernel`, all 0 between launches (each
    launch's last program per unit resets its own).

    Captured CUDA graphs keep the addresses they were captured with, so a buffer is never freed
    once handed out: growing (outside capture only) retires the old one into `retired`; a capture
    that outgrows it gets its own, zeroed by a memset that every replay runs first. Calls on one
    stream are ordered, so graphs and eager calls share the buffer; two MoE calls running
    concurrently on different streams of one device must not (their counts would mix)."""

    def __init__(self) -> None:
        self.live: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []

    def take(self, n: int, device: torch.device) -> torch.Tensor:
        """At least n zeros (K2.6 at tp = 8 with the default tiles needs at most 1360 blocks x 2
        units = 2720 at CHUNK tokens: the first buffer's 4096)."""
        if self.live is not None and self.live.numel() >= n:
            return self.live
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            own = torch.zeros(n, dtype=torch.int32, device=device)
            self.retired.append(own)
            return own
        if self.live is not None:
            self.retired.append(self.live)
        size = max(n, 4096, 2 * (0 if self.live is None else self.live.numel()))
        self.live = torch.zeros(size, dtype=torch.int32, device=device)
        return self.live


_TICKETS: dict[torch.device, _Tickets] = {}


def _record(name: str, k, grid: int, warps: int, **info) -> None:
    LAST_LAUNCH[name] = dict(programs=grid, warps=warps, n_regs=getattr(k, "n_regs", None),
                             n_spills=getattr(k, "n_spills", None), **info)  # fmt: skip


def _up_silu(x, w13: Repacked, part, h, pairs, bexp, num_pairs: int, nb: int, cfg: dict, *,
             split: int, topk: int, launch: dict) -> object:  # fmt: skip
    """part = the up GEMM's split partials, h = silu(gate) * up (bf16), in one launch."""
    from ddserve.kernels.moe_gluon import _w4_up_silu_kernel

    ks = w13.k_steps
    grid = nb * split * w13.n_tiles
    pfa = pick_pfa(cfg, grid, num_sms(x.device))
    units = nb * (w13.n // 2) // w13.bn  # (block, gate n-tile)
    # one ticket table per device: routed experts run on the main stream only
    assert not backend.on_side_stream(), "the routed MoE does not run inside a side branch"
    tickets = _TICKETS.setdefault(x.device, _Tickets()).take(units, x.device)
    k = _w4_up_silu_kernel[(grid,)](
        x, w13.words, w13.scales, part, pairs, bexp, h, tickets,
        num_pairs, w13.words.shape[0], nb, w13.n, w13.k,
        x.stride(0), part.stride(0), part.stride(1), h.stride(0), w13.words.stride(0),
        w13.scales.stride(0),
        TOPK=topk, W=w13.w, NREP=w13.nrep, BM=cfg["BM"], KS_TOTAL=ks, KSTEPS=ks // split,
        SPLIT=split, DEPTH=cfg["DEPTH"], UNROLL=_unroll(cfg, ks // split), PFA=pfa,
        num_warps=w13.w, **launch,
    )  # fmt: skip
    _record("up", k, grid, w13.w, split=split, nt=1, fused_silu=True, pfa=pfa)
    return k


def _gemm(x, stream: Repacked, out, pairs, bexp, tw, num_pairs: int, nb: int, cfg: dict, *,
          split: int, nt: int, gather: bool, down: bool, topk: int,
          launch: dict) -> object:  # fmt: skip
    from ddserve.kernels.moe_gluon import _w4_gemm_kernel

    ks = stream.k_steps
    grid = nb * split * (stream.n_tiles // nt)
    pfa = 0 if down else pick_pfa(cfg, grid, num_sms(x.device))
    stride_os = out.stride(0) if out.dim() == 3 else 0
    stride_or = out.stride(-2)
    k = _w4_gemm_kernel[(grid,)](
        x, stream.words, stream.scales, out, pairs, bexp, tw,
        num_pairs, stream.words.shape[0], nb, stream.n, stream.k,
        x.stride(0), stride_os, stride_or, stream.words.stride(0), stream.scales.stride(0),
        TOPK=topk, GATHER=gather, W=stream.w, NREP=stream.nrep, BM=cfg["BM"], KS_TOTAL=ks,
        KSTEPS=ks // split, NT=nt, SPLIT=split, DOWN=down, DEPTH=cfg["DEPTH"],
        UNROLL=_unroll(cfg, nt * (ks // split)), PFA=pfa, num_warps=stream.w,
        **launch,
    )  # fmt: skip
    _record("down" if down else "up", k, grid, stream.w, split=split, nt=nt, pfa=pfa,
            **({} if down else dict(fused_silu=False)))  # fmt: skip
    return k


def fused_moe_v3(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float32, routed_scaling_factor already applied
    weights: ExpertWeights,
    *,
    config: dict | None = None,
    invariant: bool = True,  # always: the config is fixed
    combine: bool = True,
) -> torch.Tensor:  # [T, H] in x.dtype, or [T * k, H] pairs with combine=False
    """`moe_ref`'s contract with the Gluon kernel (INT4, bf16 scales, CUDA). Launches, after the
    alignment (T > 1): up GEMM, SiLU-and-mul (in the up GEMM's launch when `fuses_silu`), down
    GEMM, combine. combine=False: no combine launch; the [T * k, H] weighted output of every
    (token, slot) pair instead (pair t * k + j; dtype CONFIG["PAIRS"]), which `_combine_kernel`
    would sum in slot order in fp32; the caller folds that sum into a later launch
    (`invariant.linear(..., add_topk=k)`). Up to CHUNK tokens only (the per-pair buffer is what
    CHUNK bounds)."""
    if not combine and x.shape[0] > CHUNK:
        raise ValueError(f"MoE v3: combine=False takes at most {CHUNK} tokens, got {x.shape[0]}")
    if x.device.type != "cuda":
        raise RuntimeError("MoE v3 (Gluon) runs on CUDA GPUs only; use variant v2 elsewhere")
    if not weights.is_int4 or weights.w13_scale.dtype != torch.bfloat16:
        raise ValueError("MoE v3 needs INT4 weights with bf16 scales")
    cfg = _config(config)
    pair_dtype = PAIR_DTYPES[cfg["PAIRS"]]
    t = x.shape[0]
    if t == 0:
        return torch.zeros_like(x) if combine else torch.zeros_like(x, dtype=pair_dtype)
    if t > CHUNK:
        return torch.cat([
            fused_moe_v3(x[i : i + CHUNK], topk_ids[i : i + CHUNK], topk_weights[i : i + CHUNK],
                         weights, config=config)
            for i in range(0, t, CHUNK)
        ])  # fmt: skip
    w13, w2 = prepare(weights, cfg["W"], cfg["NREP"])
    hidden, inter = x.shape[1], w13.n // 2
    topk = topk_ids.shape[1]
    p = t * topk
    num_experts = w13.words.shape[0]
    bm = pick_bm(p, num_experts) if cfg["BM"] == "auto" else cfg["BM"]
    cfg["BM"] = bm
    if t == 1:  # one token's k experts are distinct: k blocks of one pair each, no sort
        sorted_pairs, block_expert = _one_token_blocks(topk_ids, bm)
    else:
        align = align_by_expert_triton if p <= MAX_PAIRS else align_by_expert  # (top-k > 8)
        sorted_pairs, block_expert = align(topk_ids, num_experts, bm)
    nb = block_expert.numel()
    xin = x.to(torch.bfloat16).contiguous()  # [T, H]
    dev = x.device
    launch = pdl.launch_options(dev)
    split = _largest_divisor(w13.k_steps, cfg["SPLIT"])
    part = torch.empty(split, nb * bm, 2 * inter, dtype=torch.float32, device=dev)  # [S, rows, 2I]
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    h = torch.empty(nb * bm, inter, dtype=torch.bfloat16, device=dev)  # [rows, I]
    if fuses_silu(cfg, inter, w13.bn):
        _up_silu(xin, w13, part, h, sorted_pairs, block_expert, p, nb, cfg, split=split,
                 topk=topk, launch=launch)  # fmt: skip
    else:
        _gemm(xin, w13, part, sorted_pairs, block_expert, tw, p, nb, cfg, split=split, nt=1,
              gather=True, down=False, topk=topk, launch=launch)  # fmt: skip
        _silu_kernel[(nb, triton.cdiv(inter, 64))](
            part, h, block_expert, num_experts, inter, part.stride(0), part.stride(1),
            h.stride(0), SPLIT=split, BM=bm, BC=64, **launch,
        )  # fmt: skip
    y = torch.empty(p, hidden, dtype=pair_dtype, device=dev)  # [P, H] weighted, per pair
    if cfg["NT"] == "auto":
        nt = pick_nt(w2.n_tiles, nb, num_sms(dev))
    else:
        nt = _largest_divisor(w2.n_tiles, cfg["NT"])
    _gemm(h, w2, y, sorted_pairs, block_expert, tw, p, nb, cfg, split=1, nt=nt, gather=False,
          down=True, topk=topk, launch=launch)  # fmt: skip
    if not combine:
        return y
    out = torch.empty_like(x)
    _combine_kernel[(t, triton.cdiv(hidden, 1024))](
        y, out, hidden, y.stride(0), out.stride(0), TOPK=topk, BC=1024, **launch
    )
    return out
