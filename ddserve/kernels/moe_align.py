"""Expert alignment for the grouped MoE GEMM: `align_by_expert` (torch ops) and its one-launch
Triton version `align_by_expert_triton` (both without host sync, graph capturable).

Both give the same outputs: the (token, slot) pairs p = t * k + j are grouped by expert, in
ascending pair order inside an expert, into blocks of `bm` rows; every used expert starts a new
block.

One program does it all:
1. key = expert * P2 + pair (P2 = next power of two >= P, padding lanes get expert = E), sorted
   with `tl.sort`: the sorted keys list the pairs grouped by expert, stable.
2. For sorted position i: rank = i - (start of its expert's run) (a running max of run starts);
   a run's padding to a multiple of bm, (bm - 1) - rank % bm, is known at its last element; the
   row of i is i + (padding of the runs before it) (an exclusive cumsum). The run boundaries
   need each sorted position's neighbours: `tl.gather` (default), or a store / barrier / load
   through the output buffer (the fallback, used from then on if the gather fails to compile).
3. sorted_pairs is pre-filled with P and block_expert with E, then (after a barrier) the pairs are
   scattered to their rows and each block's first row writes its expert.
The MoE kernels call the Triton version up to FAST_PAIRS pairs and the torch version past that.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

MAX_PAIRS = 8192  # the MoE chunks its calls at 1024 tokens x top-8
# The MoE uses this kernel up to FAST_PAIRS pairs and the torch ops past it: its one-CTA sort
# grows faster than they do (H200, E = 384, CUDA graphs: 1.4-11 us up to 768 pairs, 23 us at
# 1536 vs torch's 86 us, 93 us at 3072 vs 91 us, 229 us at 6144 vs 132 us;
# bench/results/moe_v3_round2_2026-11-30.json, kernel breakdown of the v3 rows).
FAST_PAIRS = 2048
_FILL = 1024  # rows pre-filled per loop step
GATHER_ERROR: str | None = None  # set when the tl.gather kernel failed to compile on this device


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


# the sizes are not specialized (divisible by 16, == 1): one compile per (P2, BM) bucket
@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_blocks", "num_rows"])
def _align_kernel(ids_ptr, pairs_ptr, bexp_ptr, num_pairs, num_experts, num_blocks, num_rows,
                  BM: tl.constexpr, P2: tl.constexpr, FILL: tl.constexpr,
                  GATHER: tl.constexpr):  # fmt: skip
    i = tl.arange(0, P2)  # [P2] pair index, then sorted position
    valid = i < num_pairs
    e = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    e = tl.where(valid, e, num_experts)  # padding lanes sort last, as one run
    key = tl.sort(e * P2 + i)  # [P2] grouped by expert, pair ascending inside
    se = key // P2  # [P2] expert of sorted position i
    sp = key % P2  # [P2] its pair
    if GATHER:  # neighbours in registers / shared memory
        prev = tl.gather(se, tl.maximum(i - 1, 0), 0)
        nxt = tl.gather(se, tl.minimum(i + 1, P2 - 1), 0)
    else:  # neighbours through the output buffer (>= P rows), before its pre-fill
        tl.store(pairs_ptr + i, se.to(tl.int64), mask=valid)
        tl.debug_barrier()
        prev = tl.load(pairs_ptr + i - 1, mask=valid & (i > 0), other=-1).to(tl.int32)
        nxt = tl.load(pairs_ptr + i + 1, mask=i + 1 < num_pairs, other=num_experts).to(tl.int32)
        tl.debug_barrier()
    start = (i == 0) | (se != prev)
    end = (i == P2 - 1) | (se != nxt)
    run_start = tl.associative_scan(tl.where(start, i, 0), 0, _max)  # [P2]
    rank = i - run_start
    pad = tl.where(end & valid, (BM - 1) - rank % BM, 0)  # [P2] run padding, at its last element
    row = i + tl.cumsum(pad, 0) - pad  # [P2] destination row of sorted position i

    # pre-fill: padding rows hold P, blocks past the last used one hold E
    r0 = 0
    while r0 < num_rows:  # (a while loop: the interpreter cannot run a runtime range bound)
        r = r0 + tl.arange(0, FILL)  # [FILL]
        tl.store(pairs_ptr + r, tl.zeros([FILL], tl.int64) + num_pairs, mask=r < num_rows)
        tl.store(bexp_ptr + r, tl.zeros([FILL], tl.int64) + num_experts, mask=r < num_blocks)
        r0 += FILL
    tl.debug_barrier()  # the scatter below must land after the pre-fill
    tl.store(pairs_ptr + row, sp.to(tl.int64), mask=valid)
    tl.store(bexp_ptr + row // BM, se.to(tl.int64), mask=valid & (row % BM == 0))


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


def _num_warps(p2: int) -> int:
    return 1 if p2 <= 64 else 2 if p2 <= 256 else 4 if p2 <= 1024 else 8 if p2 <= 4096 else 16


def align_by_expert_triton(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
    bm: int,
    num_warps: int | None = None,
    gather: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s outputs in one launch: sorted_pairs [NB * bm] int64 (pair index, or
    P = T * k for padding) and block_expert [NB] int64 (expert, or num_experts past the last used
    block). Needs P <= 8192 and bm a power of two (the MoE uses 8 .. 64). `num_warps` and `gather`
    (neighbours by tl.gather, else through memory) override the defaults (bench, tests)."""
    global GATHER_ERROR
    flat = topk_ids.reshape(-1)  # [P]
    p = flat.numel()
    assert p <= MAX_PAIRS, f"align_by_expert_triton: {p} pairs > {MAX_PAIRS} (chunk the tokens)"
    assert bm in (1, 2, 4, 8, 16, 32, 64, 128, 256), bm  # a power of two (tl.arange)
    nb = num_blocks(p, num_experts, bm)
    dev = flat.device
    sorted_pairs = torch.empty(nb * bm, dtype=torch.int64, device=dev)  # [NB * bm]
    block_expert = torch.empty(nb, dtype=torch.int64, device=dev)  # [NB]
    if p == 0:
        return sorted_pairs, block_expert
    p2 = max(16, triton.next_power_of_2(p))
    assert 0 < num_experts and (num_experts + 1) * p2 < 2**31, num_experts  # int32 sort keys
    args = (flat, sorted_pairs, block_expert, p, num_experts, nb, nb * bm)
    meta = dict(BM=bm, P2=p2, FILL=_FILL, num_warps=num_warps or _num_warps(p2))
    if gather is None and GATHER_ERROR is None:
        try:
            _align_kernel[(1,)](*args, **meta, GATHER=True)
            return sorted_pairs, block_expert
        except Exception as exc:  # noqa: BLE001 - compile failure: the memory path from now on
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise
            GATHER_ERROR = f"{type(exc).__name__}: {str(exc)[:500]}"
            log.warning(
                "moe_align: tl.gather kernel failed, neighbours via memory: %s", GATHER_ERROR
            )
    _align_kernel[(1,)](*args, **meta, GATHER=bool(gather))
    return sorted_pairs, block_expert
