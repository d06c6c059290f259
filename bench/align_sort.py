"""The one-program sort alignment that `moe_align.align_by_expert_triton` replaced, kept for
`bench_align.py` to time against: key = expert * P2 + pair sorted with `tl.sort` (P2 = next power
of two >= P), run starts by a running max, padding by an exclusive cumsum, then pre-fill, barrier
and scatter. Same outputs as `moe_align.align_by_expert`; P <= 8192.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddserve.kernels.moe_align import num_blocks


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_blocks", "num_rows"])
def _sort_kernel(ids_ptr, pairs_ptr, bexp_ptr, num_pairs, num_experts, num_blocks, num_rows,
                 BM: tl.constexpr, P2: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    i = tl.arange(0, P2)  # [P2] pair index, then sorted position
    valid = i < num_pairs
    e = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    e = tl.where(valid, e, num_experts)  # padding lanes sort last, as one run
    key = tl.sort(e * P2 + i)  # [P2] grouped by expert, pair ascending inside
    se = key // P2  # [P2] expert of sorted position i
    sp = key % P2  # [P2] its pair
    prev = tl.gather(se, tl.maximum(i - 1, 0), 0)  # neighbours in registers / shared memory
    nxt = tl.gather(se, tl.minimum(i + 1, P2 - 1), 0)
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


def _num_warps(p2: int) -> int:
    return 1 if p2 <= 64 else 2 if p2 <= 256 else 4 if p2 <= 1024 else 8 if p2 <= 4096 else 16


def align_by_sort(
    topk_ids: torch.Tensor, num_experts: int, bm: int, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [NB * bm] int64, block_expert [NB] int64), one launch."""
    flat = topk_ids.reshape(-1)  # [P]
    p = flat.numel()
    assert 0 < p <= 8192 and bm in (1, 2, 4, 8, 16, 32, 64, 128, 256), (p, bm)
    nb = num_blocks(p, num_experts, bm)
    sorted_pairs = torch.empty(nb * bm, dtype=torch.int64, device=flat.device)  # [NB * bm]
    block_expert = torch.empty(nb, dtype=torch.int64, device=flat.device)  # [NB]
    p2 = max(16, triton.next_power_of_2(p))
    _sort_kernel[(1,)](flat, sorted_pairs, block_expert, p, num_experts, nb, nb * bm, BM=bm,
                       P2=p2, FILL=1024, num_warps=num_warps or _num_warps(p2))  # fmt: skip
    return sorted_pairs, block_expert
