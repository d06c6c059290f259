"""Batch-invariant dense ops in Triton: a row's result does not depend on how many rows there are.

cuBLAS and torch's reductions choose tile shapes, split-K and reduction strategies from the row
count M, so a token's row computed alone (autoregressive decode) and inside a DDTree verify
forward of budget+1 rows per stream can differ in the last bits. These kernels fix everything
that decides the arithmetic of a row independently of M:

- matmuls (`linear`, `bmm_heads`): one kernel launch; BLOCK_M/N/K, split count, num_warps and
  num_stages come from (N, K, dtype) only, never from M (`invariant_configs.mm_config`). Each
  output element is one fp32 accumulator per K split walking its K range in tiles in order;
  output rounded once to x.dtype. Narrow weights split K into a fixed number S of ranges: each
  of a tile's S programs stores its fp32 partial, then takes an int32 ticket for the tile
  (`tl.atomic_add`, acq_rel); the program that draws ticket S - 1 reads the S partials back
  and adds them in split order 0..S-1 (not arrival order, so the bits do not depend on
  scheduling), rounds once, stores the output and resets the ticket to 0. Partials and tickets
  live in a per-device scratch (`_Scratch`) shared by the calls of one stream (`scratch`: the
  main stream's, or the side stream's inside `backend.side_branch`); see it for the CUDA-graph
  and multi-stream contract. `_launch(two_launch=True)` does the same sum in a second
  launch (`_sum_splits_kernel`), for tests and benchmarks only. fp32 inputs (float32 models) use
  input_precision "tf32x3" (three tf32 MMAs, about fp32 accuracy), fixed by the configuration.
  M is `do_not_specialize`, so M = 1 or M % 16 == 0 compile the same kernel as every other M;
  strides and pointers are specialised (16-byte alignment lets triton vectorise the loads and
  pipeline them through shared memory with cp.async; without it x is loaded 2 bytes at a time),
  and `_launch` makes them the same for every M of one call site: contiguous strides for a
  size-1 leading dim, a copy of an x whose base is not 16-byte aligned, a 16-aligned partials
  stride.
- `linear_rope`: `linear` whose output is attention heads of nope + P columns, each head's last P
  columns rotated (RoPE) in the epilogue: MLA's q_b_proj with the query's RoPE, one launch.
  Only where each head's rope part is exactly one column tile of the configuration
  (`rope_tiles_fit`), so the tile holds every pair it rotates; the rotation is
  `fused_ref.apply_rope`'s arithmetic on the rounded outputs (`_rope_lane`: products rounded to
  the 16-bit dtype, then added, rounded), so the bits are those of `linear` then that RoPE.
  Every other matmul compiles with the epilogue off (constexpr), the same code as without it.
- `rms_norm`: one program per row, the whole row in one block, a fixed tl.sum tree.

References with the same semantics are in `invariant_ref.py` (`split_sum_ref`: the split-order
sum of the partials); `backend` chooses between them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ddserve.kernels import backend, pdl
from ddserve.kernels.invariant_configs import MMConfig, mm_config  # noqa: F401 (re-exported)
from ddserve.kernels.pdl import _interpreting, prefetch_l2
from ddserve.kernels.pdl import begin as pdl_begin

# L2 prefetch per matmul program before its PDL wait (`pdl.PREFETCH`): the first lines of its
# weight rows, at most this many bytes. The programs resident while the previous kernel
# finishes (up to ~2 per SM) then start on warm lines; the cap keeps the lm_head's from
# flooding L2.
PREFETCH_BYTES = 32 << 10


@triton.jit
def _epilogue(acc, r_ptr, offs, rm, rn, ok, srm, dtype: tl.constexpr, ADD: tl.constexpr,
              TOPK: tl.constexpr):  # fmt: skip
    """The fp32 result rounded to y's dtype; with ADD, plus r, rounded again. TOPK = 0: r laid
    out as y (same offsets). TOPK > 0: r is [M * TOPK, N] fp32 or bf16 (row stride srm) and
    row m adds r[m * TOPK + j] over j = 0 .. TOPK-1 in that order in fp32, rounded to y's dtype
    (the MoE's top-k combine), then added."""
    y = acc.to(dtype)
    if ADD:
        if TOPK == 0:
            r = tl.load(r_ptr + offs, mask=ok, other=0.0)
        else:
            pair0 = rm.to(tl.int64)[:, None] * TOPK  # [BM, 1]
            r = tl.zeros(acc.shape, dtype=tl.float32)
            for j in tl.static_range(TOPK):  # slot order
                r += tl.load(r_ptr + (pair0 + j) * srm + rn[None, :], mask=ok, other=0.0).to(
                    tl.float32
                )
            r = r.to(dtype)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    return y


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """a * b in fp32 as PTX `mul.rn.f32` (no flush of denormals, as torch's kernels): the
    compiler would otherwise contract the 16-bit product and the add after it into one fma, one
    rounding instead of torch's two. The interpreter runs no PTX."""
    if INTERPRET:
        return a * b
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _rope_lane(x, y, c, s, INTERPRET: tl.constexpr):
    """One RoPE output lane as `fused_ref.apply_rope` computes it: round(round(x * c) +
    round(y * s)) in x's (16-bit) dtype; x the lane's input, y its rotate_half partner (fp32,
    negated for the first half), c and s the lane's cos and sin (fp32)."""
    dt = x.dtype
    first = _mul_rn(x.to(tl.float32), c, INTERPRET).to(dt).to(tl.float32)
    second = _mul_rn(y, s, INTERPRET).to(dt).to(tl.float32)
    return (first + second).to(dt)


@triton.jit
def _rope_tile(y, cos_ptr, sin_ptr, rm, m_ok, INTERLEAVE: tl.constexpr,
               INTERPRET: tl.constexpr):  # fmt: skip
    """y [BM, P] (one head's rope part per row, rounded) rotated with row rm's cos/sin ([M, P]
    contiguous) as `fused._rope` rotates it: x' is y de-interleaved or not, out = [x'_lo * c_lo -
    x'_hi * s_lo | x'_hi * c_hi + x'_lo * s_hi] lane by lane (`_rope_lane`), in x' order."""
    bm: tl.constexpr = y.shape[0]
    p: tl.constexpr = y.shape[1]
    half: tl.constexpr = p // 2
    if INTERLEAVE:  # x'_lo = y[:, 0::2], x'_hi = y[:, 1::2]
        lo, hi = tl.split(tl.reshape(y, (bm, half, 2)))  # [BM, half] each
    else:  # x'_lo = y[:, :half], x'_hi = y[:, half:]
        lo, hi = tl.split(tl.permute(tl.reshape(y, (bm, 2, half)), (0, 2, 1)))
    at = rm.to(tl.int64)[:, None] * p + tl.arange(0, half)[None, :]  # [BM, half]
    ok = m_ok[:, None]
    c_lo = tl.load(cos_ptr + at, mask=ok, other=0.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + at + half, mask=ok, other=0.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + at, mask=ok, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + at + half, mask=ok, other=0.0).to(tl.float32)
    out_lo = _rope_lane(lo, -hi.to(tl.float32), c_lo, s_lo, INTERPRET)  # [BM, half]
    out_hi = _rope_lane(hi, lo.to(tl.float32), c_hi, s_hi, INTERPRET)
    return tl.reshape(tl.permute(tl.join(out_lo, out_hi), (0, 2, 1)), (bm, p))  # [BM, P]


@triton.jit
def _rope_epilogue(y, pid_n, rm, m_ok, cos_ptr, sin_ptr, BLOCK_N: tl.constexpr,
                   NOPE: tl.constexpr, HEAD: tl.constexpr, INTERLEAVE: tl.constexpr,
                   INTERPRET: tl.constexpr):  # fmt: skip
    """y, rotated (`_rope_tile`) when column tile pid_n is a head's rope part: heads of HEAD
    columns, the last HEAD - NOPE = BLOCK_N of each rotated (the launcher checks the tiling)."""
    if (pid_n * BLOCK_N) % HEAD >= NOPE:
        y = _rope_tile(y, cos_ptr, sin_ptr, rm, m_ok, INTERLEAVE, INTERPRET)
    return y


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(
    x_ptr, w_ptr, y_ptr, r_ptr, part_ptr, ticket_ptr, M, N, K: tl.constexpr,
    sxm, sxh, sxk, swh, swk, swn, sps, sym, syh, syn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, K_PER: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, REDUCE: tl.constexpr, PF_LINES: tl.constexpr, PF_STEP: tl.constexpr,
    PDL: tl.constexpr, ADD: tl.constexpr, TOPK: tl.constexpr, srm, cos_ptr=None, sin_ptr=None,
    ROPE: tl.constexpr = False, NOPE: tl.constexpr = 0, HEAD: tl.constexpr = 0,
    INTERLEAVE: tl.constexpr = False,
):  # fmt: skip
    """y[m, h, n] = sum over k of x[m, h, k] * w[h, k, n]; program (m tile, n tile, head * SPLIT +
    s) accumulates split s's K range in fp32. SPLIT = 1: rounds to y's dtype and stores y.
    SPLIT > 1: stores the fp32 partial at part[s, m, h, n] (strides sps, sym, syh, syn); with
    REDUCE, the tile's last program to take a ticket (ticket[tile] counts arrivals, and is reset
    to 0 by that program) sums part[0] + part[1] + ... in split order, rounds once and stores y;
    without REDUCE, `_sum_splits_kernel` does the same sum in a second launch.
    ADD: y = round(round(result) + r), r laid out as y (torch's `linear(x, w) + r`; not with a
    second-launch sum), or with TOPK > 0 the fixed-order sum of each row's TOPK rows of r
    (`_epilogue`). K is a constexpr (fixed per weight; a runtime loop bound does not run in the
    interpreter).
    ROPE (`linear_rope`; heads = 1, no ADD): the output's columns are heads of HEAD, the last
    HEAD - NOPE = BLOCK_N of each a rope part; a tile that is one is rotated after rounding
    (`_rope_epilogue`, cos/sin [M, BLOCK_N] contiguous). Off (the default), the kernel is the
    same code as without these parameters (cos_ptr and sin_ptr are None, hence constexprs).
    PF_LINES > 0 (PDL launches of weights contiguous along K): before waiting for the previous
    kernel, the program asks L2 for the first PF_LINES 128-byte lines (PF_STEP elements each)
    of each of its weight columns' K range."""
    pid_m, pid_n, pid_hs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h, s = pid_hs // SPLIT, pid_hs % SPLIT
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + h.to(tl.int64) * sxh + rm.to(tl.int64)[:, None] * sxm  # [BM, 1]
    w_cols = w_ptr + h.to(tl.int64) * swh + rn.to(tl.int64)[None, :] * swn  # [1, BN]
    if PF_LINES > 0:  # weights: no kernel of the forward writes them
        kl = s * K_PER + tl.arange(0, PF_LINES) * PF_STEP  # [L] first element of each line
        ok = (kl < K)[:, None] & n_ok[None, :]
        prefetch_l2(tl.where(ok, w_cols + kl[:, None] * swk, w_ptr))  # [L, BN]
    pdl_begin(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, K_PER, BLOCK_K):
        kk = s * K_PER + i + rk  # [BK]
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None] * swk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP32:  # the configuration's precision ("tf32x3": 3 tf32 MMAs, ~fp32), fixed per weight
            acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BM, BN]
        elif INTERPRET:  # the CPU interpreter's bf16 dot is wrong; bf16 products are exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)  # [BM, BN] 16-bit MMA, fp32 accumulate
    offs = h.to(tl.int64) * syh + rm.to(tl.int64)[:, None] * sym + rn[None, :] * syn  # [BM, BN]
    ok = m_ok[:, None] & n_ok[None, :]  # [BM, BN]
    if SPLIT == 1:
        y = _epilogue(acc, r_ptr, offs, rm, rn, ok, srm, y_ptr.dtype.element_ty, ADD, TOPK)
        if ROPE:
            y = _rope_epilogue(y, pid_n, rm, m_ok, cos_ptr, sin_ptr, BLOCK_N, NOPE, HEAD,
                               INTERLEAVE, INTERPRET)  # fmt: skip
        tl.store(y_ptr + offs, y, mask=ok)
    else:
        tl.store(part_ptr + s.to(tl.int64) * sps + offs, acc, mask=ok)
        if REDUCE:
            tl.debug_barrier()  # every thread's partial stored before the ticket is taken
            tile = (h * tl.num_programs(0) + pid_m) * tl.num_programs(1) + pid_n
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")  # arrivals before this
            if ticket == SPLIT - 1:  # the others have stored theirs; read them from L2 (.cg)
                tot = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
                for j in tl.static_range(1, SPLIT):
                    tot += tl.load(part_ptr + j * sps + offs, mask=ok, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
                y = _epilogue(tot, r_ptr, offs, rm, rn, ok, srm, y_ptr.dtype.element_ty, ADD, TOPK)
                if ROPE:
                    y = _rope_epilogue(y, pid_n, rm, m_ok, cos_ptr, sin_ptr, BLOCK_N, NOPE, HEAD,
                                       INTERLEAVE, INTERPRET)  # fmt: skip
                tl.store(y_ptr + offs, y, mask=ok)
                tl.store(ticket_ptr + tile, 0)  # clean for the next launch (or graph replay)


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(
    ws_ptr, y_ptr, numel, sws, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """y = ws[0] + ws[1] + ... in that order (fp32), rounded once to y's dtype: `_mm_kernel`'s
    in-kernel sum as a second launch (benchmarks and tests compare the two)."""
    pdl_begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = offs < numel
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * sws + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


class _Scratch:
    """One device's split-K scratch: fp32 partials and int32 tickets (one per output tile, all 0
    between launches: each launch's last program per tile resets its ticket).

    Captured CUDA graphs keep the addresses they were captured with, so a buffer is never freed
    once handed out: growing (outside capture only) retires the old one into `retired`. Calls on
    one stream are ordered, so graphs and eager calls may share the buffers; two split matmuls
    running concurrently on different streams of one device must not (their tickets and partials
    would mix)."""

    PARTIALS_MAX = 128 << 20  # bytes kept; a larger call gets its own partials

    def __init__(self) -> None:
        self.partials: torch.Tensor | None = None
        self.tickets: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []

    def take(self, n_part: int, n_tick: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(partials with >= n_part fp32, tickets with >= n_tick zeros) for one launch. During a
        capture that outgrows the buffers, the graph gets its own (its tickets zeroed by a
        captured memset before every replay). Sizes at least double, so the retired buffers
        add up to less than the live ones."""
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.tickets is None or self.tickets.numel() < n_tick:
            if capturing:
                return _fresh(n_part, device), torch.zeros(n_tick, dtype=torch.int32, device=device)
            size = max(n_tick, 2 * _numel(self.tickets), 4096)
            self._retire(self.tickets)
            self.tickets = torch.zeros(size, dtype=torch.int32, device=device)
        if 4 * n_part > self.PARTIALS_MAX:
            return _fresh(n_part, device), self.tickets
        if self.partials is None or self.partials.numel() < n_part:
            if capturing:
                return _fresh(n_part, device), self.tickets
            size = min(max(n_part, 2 * _numel(self.partials), 1 << 20), self.PARTIALS_MAX // 4)
            self._retire(self.partials)
            self.partials = _fresh(size, device)
        return self.partials, self.tickets

    def _retire(self, t: torch.Tensor | None) -> None:
        if t is not None:
            self.retired.append(t)


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


def _fresh(n: int, device) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float32, device=device)


_SCRATCH: dict[torch.device, _Scratch] = {}
_SIDE_SCRATCH: dict[torch.device, _Scratch] = {}  # calls inside `backend.side_branch`


def scratch(device: torch.device) -> _Scratch:
    """The split-K scratch of the stream being issued to: the main one, or the side stream's
    while `backend.side_branch` runs (the two run concurrently, so they must not share). Each
    table's calls are ordered: on one stream, or, for the side table, by the fork and join of
    consecutive side branches through the main stream (also between a replayed graph's
    branches). At K2.6 shapes the side branch's gate/up matmul splits K (8 ways) while the main
    stream runs the routed experts, which take no scratch: the separate table
    keeps any split matmul later placed on the main branch from sharing its tickets."""
    table = _SIDE_SCRATCH if backend.on_side_stream() else _SCRATCH
    return table.setdefault(device, _Scratch())


def _canonical(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """x with unit stride along its last dim, a 16-byte aligned base and leading strides that are
    multiples of 16 (or contiguous), and its strides with a size-1 leading dim given its
    contiguous stride. Triton keys its binary on stride divisibility and pointer alignment (and
    the binary decides load vector widths, hence rms_norm's reduction layout), so this keeps one
    binary per call site whatever M is."""
    aligned = x.stride(-1) == 1 and x.data_ptr() % 16 == 0
    if not aligned or not (x.is_contiguous() or all(st % 16 == 0 for st in x.stride()[:-1])):
        x = x.clone(memory_format=torch.contiguous_format)
    strides = list(x.stride())
    if x.shape[0] == 1:
        strides[0] = x[0].numel()  # unused (only row 0 is read); as if contiguous
    return x, strides


class RopeEpilogue(NamedTuple):
    """`linear_rope`'s rotation: the output is heads of nope + P columns (P = cos's width), each
    head's last P rotated with its row's cos/sin."""

    cos: torch.Tensor  # [M, P] contiguous, the output's dtype
    sin: torch.Tensor  # [M, P]
    nope: int
    interleave: bool


def _launch(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ws, heads: int,
    cfg: MMConfig | None = None, two_launch: bool = False, add: torch.Tensor | None = None,
    add_topk: int = 0, rope: RopeEpilogue | None = None,
) -> None:  # fmt: skip
    """y [M, (H,) N] (fresh, contiguous) = x [M, (H,) K] @ w seen as [H, K, N] via strides ws,
    plus `add` (contiguous: y's shape, or [M * add_topk, N] fp32 or bf16 pairs summed per row) when
    given, with `rope`'s rotation when given. `cfg` (default: `mm_config`'s) and `two_launch`
    (the split-K sum as `_sum_splits_kernel`) are for benchmarks and tests; both ways give the
    same bits."""
    assert add is None or not two_launch, "the residual add is the in-kernel sum's epilogue"
    assert add_topk == 0 or heads == 1, "pair rows are addressed by row only"
    x, xs = _canonical(x)
    if x.dim() == 2:
        xs = [xs[0], 0, xs[1]]
    m, k, n = x.shape[0], x.shape[-1], y.shape[-1]
    cfg = cfg or mm_config(n, k, x.dtype, heads)
    bm, bn, bk, split = cfg.block_m, cfg.block_n, cfg.block_k, cfg.split
    rope_args = {}
    if rope is not None:
        p = rope.cos.shape[-1]
        assert heads == 1 and add is None and not two_launch, "rope: a plain linear"
        assert _rope_tiling_ok(n, bn, rope.nope, p), f"rope parts of {p} are not {bn}-column tiles"
        assert rope.cos.shape == rope.sin.shape == (m, p) and rope.cos.is_contiguous()
        assert rope.sin.is_contiguous() and rope.cos.dtype == rope.sin.dtype == y.dtype
        rope_args = dict(cos_ptr=rope.cos, sin_ptr=rope.sin, ROPE=True, NOPE=rope.nope,
                         HEAD=rope.nope + p, INTERLEAVE=rope.interleave)  # fmt: skip
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    ys = (y.stride(0), 0, y.stride(-1)) if y.dim() == 2 else y.stride()
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), heads * split)
    part, tickets, part_stride = y, y, 0
    if split > 1:  # fp32 partials [split, numel rounded up to 16] (a stride divisible by 16)
        part_stride = triton.cdiv(y.numel(), 16) * 16
        part, tickets = scratch(y.device).take(
            split * part_stride, grid[0] * grid[1] * heads, y.device
        )
    launch = pdl.launch_options(x.device)
    pf_step = 128 // w.element_size()  # elements per 128-byte line
    pf_lines = 0
    if launch["PDL"] and "matmul" in pdl.PREFETCH and ws[1] == 1:  # K-contiguous weight rows
        pf_lines = min(triton.next_power_of_2(triton.cdiv(k_per, pf_step)), PREFETCH_BYTES // (
            128 * bn))  # fmt: skip
    _mm_kernel[grid](
        x, w, y, y if add is None else add, part, tickets, m, n, k, *xs, *ws, part_stride, *ys,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, K_PER=k_per,
        FP32=x.dtype == torch.float32, PRECISION=cfg.precision, INTERPRET=_interpreting(),
        REDUCE=not two_launch, PF_LINES=pf_lines, PF_STEP=pf_step, ADD=add is not None,
        TOPK=add_topk, srm=0 if add is None else add.stride(0),
        num_warps=cfg.warps, num_stages=cfg.stages, **rope_args, **launch,
    )  # fmt: skip
    if split > 1 and two_launch:
        numel = y.numel()
        _sum_splits_kernel[(triton.cdiv(numel, 1024),)](
            part, y, numel, part_stride, SPLIT=split, BLOCK=1024, **launch
        )


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype != w.dtype:
        raise TypeError(f"x is {x.dtype} but the weight is {w.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"unsupported dtype {x.dtype}")


def linear(
    x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None, *, add_topk: int = 0
) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] in x.dtype, each row independent of the row count.

    `add` (one launch, the same bits as the separate launches it replaces):
    - add_topk = 0: `add` [..., N] (x.dtype) is added to the rounded product, rounded once more:
      torch's `linear(x, w) + add`;
    - add_topk = k > 0: `add` [M * k, N] fp32 or bf16 holds k rows per output row (the MoE's
      weighted expert outputs, pair m * k + j for slot j); their sum in slot order in fp32,
      rounded to x.dtype, is added: `linear(x, w) + add'` with add' from
      `moe_reduce._combine_kernel` (`invariant_ref.combine_ref`)."""
    _check(x, w)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if add is not None:
        add = _checked_add(add, add_topk, (*x.shape[:-1], n), m, x)
    elif add_topk:
        raise ValueError("add_topk needs add")
    if m:
        # w[n, k] seen as [1, K, N]: stride along k is w.stride(1), along n w.stride(0)
        ws = (0, w.stride(1), w.stride(0))
        _launch(x2, w, y, ws, 1, add=add, add_topk=add_topk)
    return y.view(*x.shape[:-1], n)


def _rope_tiling_ok(n: int, block_n: int, nope: int, p: int) -> bool:
    """Each head (nope + p columns; n holds whole heads) has its rope part as exactly one column
    tile of width block_n: the tile holds every pair it rotates."""
    return p == block_n and nope % p == 0 and n % (nope + p) == 0


def rope_tiles_fit(n: int, k: int, dtype: torch.dtype, nope: int, rope_dim: int) -> bool:
    """Whether `linear_rope` serves a [n, k] weight of `dtype` (16-bit) with heads of nope +
    rope_dim columns in the current phase: its `mm_config` column tile is one rope part
    (at K2.6 tp = 8, q_b 1536 -> 1536 with heads of 128 + 64: BLOCK_N 64 in decode and verify
    forwards; prompt chunks' 128-column tiles do not fit)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    return _rope_tiling_ok(n, mm_config(n, k, dtype).block_n, nope, rope_dim)


def linear_rope(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope: int,
    interleave: bool,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ w [N, K]^T -> [M, N] in x.dtype, N = heads of nope + P columns (P = cos's
    width), each head's last P columns rotated with row m's cos/sin [M, P]: bitwise `linear(x,
    w)` followed by `fused_ref.apply_rope` on those columns, in one launch. Only where
    `rope_tiles_fit` (else ValueError)."""
    _check(x, w)
    n, k = w.shape
    m, p = x.shape[0], cos.shape[-1]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} is not [M, {k}]")
    if not rope_tiles_fit(n, k, x.dtype, nope, p):
        raise ValueError(f"rope parts of {p} columns (heads of {nope} + {p}) are not column "
                         f"tiles of the {n} x {k} {x.dtype} matmul")  # fmt: skip
    if cos.shape != (m, p) or sin.shape != (m, p) or not cos.dtype == sin.dtype == x.dtype:
        raise ValueError(f"cos / sin must be [{m}, {p}] {x.dtype}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m:
        rope = RopeEpilogue(cos.contiguous(), sin.contiguous(), nope, interleave)
        _launch(x, w, y, (0, w.stride(1), w.stride(0)), 1, rope=rope)
    return y


def _checked_add(add: torch.Tensor, topk: int, out_shape, m: int, x: torch.Tensor) -> torch.Tensor:
    """`linear`'s add argument checked against its mode (out_shape: the output's, m its rows),
    as the kernel reads it."""
    n = out_shape[-1]
    if add.device != x.device:
        raise ValueError(f"add is on {add.device}, x on {x.device}")
    if topk < 0:
        raise ValueError(f"add_topk must be >= 0, got {topk}")
    if topk == 0:
        if add.shape != out_shape or add.dtype != x.dtype:
            raise ValueError(f"add {tuple(add.shape)} {add.dtype} does not match the output")
        return add.reshape(-1, n).contiguous()  # [M, N]
    if add.shape != (m * topk, n) or add.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"add with add_topk={topk} must be [{m * topk}, {n}] float32 or bfloat16 (k rows "
            f"per output row), got {tuple(add.shape)} {add.dtype}"
        )
    return add if add.stride(-1) == 1 else add.contiguous()


def bmm_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K], w [H, K, N] (any strides, e.g. a transposed view) -> [T, H, N] in x.dtype."""
    _check(x, w)
    t, h, k = x.shape
    if w.shape[0] != h or w.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} do not match")
    n = w.shape[2]
    y = torch.empty(t, h, n, dtype=x.dtype, device=x.device)  # [T, H, N]
    if t:
        _launch(x, w, y, w.stride(), h)
    return y


@triton.jit
def _rms_kernel(x_ptr, w_ptr, y_ptr, D, sx, sy, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < D
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
    mean_sq = tl.sum(x * x, axis=0) / D
    normed = (x * (1.0 / tl.sqrt_rn(mean_sq + eps))).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (w * normed.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + cols, y, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] (rows may be strided): x.float() * rsqrt(mean(x^2)
    + eps), cast to x.dtype, times weight, rounded to x.dtype; one program per row. Strides are
    specialised (vector loads) but made the same for every M by `_canonical`."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim {d}")
    x2, (sx, _) = _canonical(x.reshape(-1, d) if x.dim() != 2 else x)  # [M, D]
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # [M, D]
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        warps = 4 if block <= 4096 else 8
        _rms_kernel[(x2.shape[0],)](
            x2, weight, y, d, sx, d, eps, BLOCK=block, num_warps=warps,
            **pdl.launch_options(x.device),
        )  # fmt: skip
    return y.view(x.shape)


@triton.jit
def _col(p, j: tl.constexpr, ok, K: tl.constexpr):
    return tl.load(p + j, mask=ok & (j < K), other=0.0)  # [BM] column j, 0 past K


@triton.jit(do_not_specialize=["M", "sx"])
def _row_sum8_kernel(
    x_ptr, y_ptr, M, sx, K: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr
):
    """y[m] = ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)) over a row of K <= 8 fp32 values
    (zeros past K): `invariant_ref.fixed_order_sum`'s pairwise tree, in one launch."""
    pdl_begin(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    ok = rows < M
    p = x_ptr + rows.to(tl.int64) * sx  # [BM]
    lo = (_col(p, 0, ok, K) + _col(p, 4, ok, K)) + (_col(p, 2, ok, K) + _col(p, 6, ok, K))
    hi = (_col(p, 1, ok, K) + _col(p, 5, ok, K)) + (_col(p, 3, ok, K) + _col(p, 7, ok, K))
    tl.store(y_ptr + rows, lo + hi, mask=ok)


def row_sum8(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (at most 8 fp32 values: the Router's top-k weights), keepdim, in
    `fixed_order_sum`'s order (bitwise equal to it for finite inputs that are not all zeros)."""
    k = x.shape[-1]
    if x.dtype != torch.float32 or not 1 <= k <= 8:
        raise ValueError(f"row_sum8 takes at most 8 float32 values per row, got {k} {x.dtype}")
    x2 = x.reshape(-1, k)  # [M, k]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], 1, dtype=x.dtype, device=x.device)  # [M, 1]
    if x2.shape[0]:
        grid = (triton.cdiv(x2.shape[0], 128),)
        _row_sum8_kernel[grid](
            x2, y, x2.shape[0], x2.stride(0), K=k, BLOCK_M=128, **pdl.launch_options(x.device)
        )
    return y.view(*x.shape[:-1], 1)
