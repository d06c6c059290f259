"""Expert alignment for the grouped MoE GEMM: `align_by_expert` (torch ops, the reference) and
its Triton counting sort `align_by_expert_triton` (both without host sync, graph capturable).

Both give the same outputs, bit for bit: the (token, slot) pairs p = t * k + j are grouped by
expert, in ascending pair order inside an expert, into blocks of `bm` rows; every used expert
starts a new block. No atomics: the order is fixed by the pair indices.

The Triton version splits the P pairs into chunks of CH (one program each):
1. `_count_kernel`: each chunk's per-expert histogram -> counts [NC, E] int16; the programs also
   pre-fill sorted_pairs with P and block_expert with E (a disjoint slice each).
2. `_place_kernel`: each program sums the counts of all chunks (per-expert totals) and of the
   chunks before its own; an exclusive cumsum of the totals' padded block counts gives each
   expert's first block; a pair's row is
       (first block of its expert) * bm + (its expert's pairs in earlier chunks)
       + (its expert's pairs earlier in its own chunk, from a [CH, CH] comparison),
   and the first row of each block writes the block's expert. The base row per expert is read
   for each pair with `tl.gather` (default), or through a scratch buffer (the fallback, used from
   then on if the gather fails to compile).
With one chunk (P <= ONE_CHUNK) `_place_kernel` alone does it all in one launch: histogram, fill,
barrier, scatter.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ddserve.kernels import pdl
from ddserve.kernels.pdl import begin as pdl_begin

log = logging.getLogger(__name__)

MAX_PAIRS = 8192  # the MoE chunks its calls at 1024 tokens x top-8
ONE_CHUNK = 256  # up to this many pairs: one program, one launch
_FILL = 1024  # rows pre-filled per loop step
_COLS = 16  # rank comparison columns per loop step
GATHER_ERROR: str | None = None  # set when the tl.gather kernel failed to compile on this device


@triton.jit
def _chunk_ids(ids_ptr, c, num_pairs, CH: tl.constexpr):
    """(pair index [CH], valid [CH], expert [CH] int32, 0 on padding lanes) of chunk c."""
    i = c * CH + tl.arange(0, CH)
    valid = i < num_pairs
    e = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    return i, valid, e


@triton.jit
def _fill(pairs_ptr, bexp_ptr, lo, hi, num_pairs, num_experts, num_blocks, FILL: tl.constexpr):
    """sorted_pairs[lo:hi] = P and block_expert[lo:min(hi, NB)] = E."""
    r0 = lo
    while r0 < hi:  # (a while loop: the interpreter cannot run a runtime range bound)
        r = r0 + tl.arange(0, FILL)  # [FILL]
        tl.store(pairs_ptr + r, tl.zeros([FILL], tl.int64) + num_pairs, mask=r < hi)
        tl.store(bexp_ptr + r, tl.zeros([FILL], tl.int64) + num_experts,
                 mask=(r < hi) & (r < num_blocks))  # fmt: skip
        r0 += FILL


# the sizes are not specialized (divisible by 16, == 1): one compile per (CH, E2) bucket
@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_blocks", "num_rows"])
def _count_kernel(ids_ptr, counts_ptr, pairs_ptr, bexp_ptr, num_pairs, num_experts, num_blocks,
                  num_rows, CH: tl.constexpr, E2: tl.constexpr, FILL: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    pdl_begin(PDL)
    c = tl.program_id(0)
    i, valid, e = _chunk_ids(ids_ptr, c, num_pairs, CH)
    hist = tl.histogram(e, E2, mask=valid)  # [E2] pairs of this chunk per expert
    x = tl.arange(0, E2)
    tl.store(counts_ptr + c * num_experts + x, hist.to(tl.int16), mask=x < num_experts)
    share = tl.cdiv(num_rows, tl.num_programs(0))  # rows pre-filled per program
    lo = c * share
    _fill(pairs_ptr, bexp_ptr, lo, tl.minimum(lo + share, num_rows), num_pairs, num_experts,
          num_blocks, FILL)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_blocks", "num_rows", "num_chunks"])
def _place_kernel(ids_ptr, counts_ptr, scratch_ptr, pairs_ptr, bexp_ptr, num_pairs, num_experts,
                  num_blocks, num_rows, num_chunks, BM: tl.constexpr, CH: tl.constexpr,
                  E2: tl.constexpr, NC2: tl.constexpr, FILL: tl.constexpr, ONE: tl.constexpr,
                  COLS: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_begin(PDL)
    c = tl.program_id(0)
    i, valid, e = _chunk_ids(ids_ptr, c, num_pairs, CH)
    x = tl.arange(0, E2)  # [E2] expert
    if ONE:  # the only chunk: its histogram is the totals
        total = tl.histogram(e, E2, mask=valid)  # [E2]
        before = tl.zeros([E2], tl.int32)
    else:
        r = tl.arange(0, NC2)[:, None]  # [NC2, 1] chunk
        m = (r < num_chunks) & (x[None, :] < num_experts)
        cnt = tl.load(counts_ptr + r * num_experts + x[None, :], mask=m, other=0).to(tl.int32)
        total = tl.sum(cnt, 0)  # [E2] pairs per expert
        before = tl.sum(tl.where(r < c, cnt, 0), 0)  # [E2] in the chunks before this one
    blocks = (total + BM - 1) // BM  # [E2]
    base = (tl.cumsum(blocks, 0) - blocks) * BM + before  # [E2] row of this chunk's first pair
    j = tl.arange(0, CH)
    acc = tl.zeros([CH, COLS], tl.int32)  # [CH, COLS] COLS columns at a time (registers)
    for jb in tl.static_range(0, CH, COLS):
        jc = jb + tl.arange(0, COLS)  # [COLS]
        ec = tl.load(ids_ptr + c * CH + jc, mask=c * CH + jc < num_pairs, other=-1).to(tl.int32)
        acc += ((ec[None, :] == e[:, None]) & (jc[None, :] < j[:, None])).to(tl.int32)
    rank = tl.sum(acc, 1)  # [CH] pairs of the same expert earlier in the chunk
    if GATHER:
        row = tl.gather(base, e, 0) + rank  # [CH] destination row of pair i
    else:  # base through this program's scratch row
        tl.store(scratch_ptr + c * E2 + x, base)
        tl.debug_barrier()
        row = tl.load(scratch_ptr + c * E2 + e, mask=valid, other=0) + rank
    if ONE:  # pre-fill, then the scatter lands after it
        _fill(pairs_ptr, bexp_ptr, 0, num_rows, num_pairs, num_experts, num_blocks, FILL)
        tl.debug_barrier()
    tl.store(pairs_ptr + row, i.to(tl.int64), mask=valid)
    tl.store(bexp_ptr + row // BM, e.to(tl.int64), mask=valid & (row % BM == 0))


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
    nb = num_blocks(p, num_experts, bm)
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


def num_blocks(num_pairs: int, num_experts: int, bm: int) -> int:
    """Host-side bound on the blocks: each used expert wastes fewer than bm rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (bm - 1), bm)


def chunk_size(num_pairs: int) -> int:
    """Pairs per program: all of them up to ONE_CHUNK (one launch), else 128 up to 4096 pairs and
    256 past that (at most 32 chunks; the [CH, CH] rank comparison stays small)."""
    if num_pairs <= ONE_CHUNK:
        return max(16, triton.next_power_of_2(num_pairs))
    return 128 if num_pairs <= 4096 else 256


def launch_plan(p: int, num_experts: int, bm: int, chunk: int | None = None,
                num_warps: int | None = None) -> tuple[int, int, dict, dict]:  # fmt: skip
    """(chunks NC, histogram bins E2, `_count_kernel`'s constexprs and warps, `_place_kernel`'s
    (less GATHER)) for P pairs; `_count_kernel` runs only when NC > 1."""
    ch = chunk or chunk_size(p)
    assert 16 <= ch <= 1024 and ch == triton.next_power_of_2(ch), ch
    nc = triton.cdiv(p, ch)
    assert nc <= 64, f"{nc} chunks of {ch} pairs: at most 64 (the counts tile in registers)"
    e2 = max(32, triton.next_power_of_2(num_experts))  # histogram bins: a power of two >= 32
    nc2 = triton.next_power_of_2(nc)
    warps = max(4, min(8, ch // 16)) if nc == 1 else 8 if nc2 * e2 <= 16384 else 16
    count = dict(CH=ch, E2=e2, FILL=_FILL, num_warps=max(1, min(8, ch // 32)))
    place = dict(BM=bm, CH=ch, E2=e2, NC2=nc2, FILL=_FILL, ONE=nc == 1, COLS=min(ch, _COLS),
                 num_warps=num_warps or warps)  # fmt: skip
    return nc, e2, count, place


def align_by_expert_triton(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
    bm: int,
    num_warps: int | None = None,
    gather: bool | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s outputs (equal to them): sorted_pairs [NB * bm] int64 (pair index, or
    P = T * k for padding) and block_expert [NB] int64 (expert, or num_experts past the last used
    block), in one launch up to ONE_CHUNK pairs, two past that. Needs P <= 8192, E <= 1024 and
    bm a power of two (the MoE uses 8 .. 64). `num_warps` (of `_place_kernel`), `gather` (base
    rows by tl.gather, else through memory) and `chunk` (pairs per program, a power of two in
    16 .. 1024; one chunk = one launch) override the defaults (bench, tests)."""
    global GATHER_ERROR
    flat = topk_ids.reshape(-1)  # [P]
    p = flat.numel()
    assert p <= MAX_PAIRS, f"align_by_expert_triton: {p} pairs > {MAX_PAIRS} (chunk the tokens)"
    assert bm in (1, 2, 4, 8, 16, 32, 64, 128, 256), bm  # a power of two
    assert 0 < num_experts <= 1024, num_experts
    nb = num_blocks(p, num_experts, bm)
    dev = flat.device
    sorted_pairs = torch.empty(nb * bm, dtype=torch.int64, device=dev)  # [NB * bm]
    block_expert = torch.empty(nb, dtype=torch.int64, device=dev)  # [NB]
    if p == 0:
        return sorted_pairs, block_expert
    nc, e2, count_meta, place_meta = launch_plan(p, num_experts, bm, chunk, num_warps)
    sizes = (p, num_experts, nb, nb * bm)
    counts = torch.empty(nc, num_experts, dtype=torch.int16, device=dev)  # [NC, E]
    launch = pdl.launch_options(dev)
    if nc > 1:
        _count_kernel[(nc,)](
            flat, counts, sorted_pairs, block_expert, *sizes, **count_meta, **launch
        )

    def place(use_gather: bool) -> None:
        scratch = counts if use_gather else torch.empty(nc, e2, dtype=torch.int32, device=dev)
        _place_kernel[(nc,)](flat, counts, scratch, sorted_pairs, block_expert, *sizes, nc,
                             **place_meta, GATHER=use_gather, **launch)  # fmt: skip

    if gather is None and GATHER_ERROR is None:
        try:
            place(True)
            return sorted_pairs, block_expert
        except Exception as exc:  # noqa: BLE001 - compile failure: the memory path from now on
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise
            GATHER_ERROR = f"{type(exc).__name__}: {str(exc)[:500]}"
            log.warning("moe_align: tl.gather failed, base rows via memory: %s", GATHER_ERROR)
    place(bool(gather))
    return sorted_pairs, block_expert
