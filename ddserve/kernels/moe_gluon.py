"""Variant "v3" of the W4A16 grouped MoE matmul: a Gluon kernel (explicit layouts) that feeds the
dequantized INT4 weights to the tensor cores straight from registers.

Why: in the Triton kernel (v2) the dequantized weight tile is converted to the MMA operand
layout through shared memory (a store and an ldmatrix of 2 bytes per weight for 0.5 byte read from
HBM), and each thread loads short pieces of many rows. Here every thread loads one contiguous run
of words (`moe_w4_repack`: a one-time repack at load) whose nibbles are exactly the MMA operand
values it owns, so the unpack is a few lop3/fma per pair of weights and the layout conversion is
a no-op (asserted at compile time).

The operation: out^T[n, m] = sum_k W[n, k] * x[m, k] over 128-column steps, with W [N, K] the
repacked weights of one expert (rows = output features, on the MMA's M side), x the block's BM
tokens (the MMA's N side, mma.sync m16n8k16). Within a step the reduction visits K in a fixed
permuted order (`moe_w4_repack.PHYS`) that is the same for every call: results depend on nothing
but the token's own row (batch invariant), and differ from the v2 kernels within rounding.

One program body (`_tiles`) serves both projections:
- up:   x rows gathered by token (pairs // TOPK); K = hidden split into SPLIT equal ranges, each
        program one n-tile and one range; fp32 partials part[s, row, n]. `_w4_gemm_kernel`
        stops there (`moe_reduce._silu_kernel` sums the splits in order and applies SiLU-and-mul
        in a second launch); `_w4_up_silu_kernel` does that sum itself (`_silu_unit`).
- down: x = h (rows of the block); each program NT consecutive n-tiles over all of K;
        y[pair, n] = topk weight * acc, computed in fp32 and stored in y's dtype (bf16 or fp32;
        `moe_reduce._combine_kernel` sums the slots in order in fp32).
Weights are streamed with DEPTH steps of register prefetch; with PFA > 0 each step also asks L2
for the lines of the step PFA ahead (`_prefetch_step`). With UNROLL the step loop is
unrolled: the compiler then issues each step's weight, scale and x loads about a step before
they are read (sm_90 SASS, `bench/sass_loop.py`), where in the loop it issues the scales and x
at the step's start and the next weights at its end, so a lone warp waits on memory each step.

SiLU-and-mul in the up launch (`_w4_up_silu_kernel`): h[:, c] needs the gate column c and the up
column I + c of all SPLIT ranges. With I a multiple of BN, n-tile j < I / BN holds gate columns
and n-tile j + I / BN the matching up columns, so the unit (block, j) is complete after exactly
2 SPLIT programs: (block, s, j) and (block, s, j + I / BN) for s < SPLIT. Each of them stores
its partial, then takes an int32 ticket for the unit (atomic add, acq_rel, gpu scope); the one
that draws ticket 2 SPLIT - 1 reads the unit's 2 SPLIT partial tiles back from L2 (.cg), sums
them in split order and applies `_silu_kernel`'s formula (the same operations on the same
values: the same bits), stores h in bf16 and resets the ticket to 0 for the next launch or
graph replay (the caller's tickets are all 0 between launches, `moe_v3._Tickets`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ddserve.kernels.moe_w4_tiles import PAIR_ASM

BK = gl.constexpr(128)  # K columns per step (4 scale groups of 32)


@gluon.constexpr_function
def _x_layout(W, BM):
    """x tile [BM, BK] (columns 32 q + j; BM in 8, 16, 32): registers the 32 columns j of lane
    quad q, then token bits 3, 4; lanes q and token bits 0-2; every warp holds the whole tile
    (the B operand of all its rows)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]] + [[m, 0] for m in (8, 16) if m < BM],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0]] * (W.bit_length() - 1),
        block_bases=[],
        shape=[BM, 128],
    )


@gluon.jit
def _pair(w, s):
    """Nibbles at bits 0 and 16 of int32 words w times bf16 scales s (int16 bits): bf16 pairs
    (n - 8) * s, as two int16 tensors (the instructions of `moe_w4_tiles._pair_asm`)."""
    return gl.inline_asm_elementwise(
        asm=PAIR_ASM,
        constraints="=h,=h,r,h",
        args=[w, s],
        dtype=(gl.int16, gl.int16),
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _bf(x):
    return x.to(gl.bfloat16, bitcast=True)


@gluon.jit
def _dup(s, times: gl.constexpr):
    """[L] -> [L * 2^times]: each element repeated (as the fastest dimension)."""
    for _ in gl.static_range(times):
        s = gl.join(s, s)
    return gl.reshape(s, [s.numel])


@gluon.jit
def _a_tile(words, s0, s1, a_layout: gl.constexpr, W: gl.constexpr, NREP: gl.constexpr,
            KC: gl.constexpr):  # fmt: skip
    """Words [W * 32 * NREP * KC] (thread-major) and per-word scales of rows +0 / +8 -> the
    [16 W NREP, BK] bf16 MMA A operand (no data movement between threads)."""
    a0, b0 = _pair(words, s0)  # call i = 0: row + 0, k + 0
    a1, b1 = _pair(words >> 4, s1)  # i = 1: row + 8
    a2, b2 = _pair(words >> 8, s0)  # i = 2: k + 8
    a3, b3 = _pair(words >> 12, s1)  # i = 3: row + 8, k + 8
    # joins in the order k3, row3, k0: the register order (k0, row3, k3, words...) of operand A
    r0 = gl.join(gl.join(_bf(a0), _bf(a2)), gl.join(_bf(a1), _bf(a3)))  # k0 = 0: [NW, k3, row3]
    r1 = gl.join(gl.join(_bf(b0), _bf(b2)), gl.join(_bf(b1), _bf(b3)))  # k0 = 1
    t = gl.join(r0, r1)  # [NW, 2 (k3), 2 (row3), 2 (k0)]
    t = gl.reshape(t, [W, 8, 4, NREP, KC, 2, 2, 2])  # w, g, q, rep, c, k3, row3, k0
    t = gl.permute(t, [3, 0, 6, 1, 4, 5, 2, 7])  # rep, w, row3, g | c, k3, q, k0
    t = gl.reshape(t, [16 * W * NREP, BK])
    return gl.convert_layout(t, a_layout, assert_trivial=True)


@gluon.jit
def _x_tile(x_ptr, x_off, x_ok, kb, b_layout: gl.constexpr, BM: gl.constexpr):
    """x_off [BM, BK] (`_x_layout`: 32 contiguous columns per thread) -> the [BK, BM] bf16 MMA
    B operand in the permuted K order."""
    x = gl.load(x_ptr + x_off + kb, mask=x_ok, other=0.0)
    x = gl.reshape(x, [BM, 4, 8, 2, 2])  # m, q, c, k3, k0 (column 32 q + 4 c + 2 k3 + k0)
    x = gl.permute(x, [2, 3, 1, 4, 0])  # c, k3, q, k0 | m
    x = gl.reshape(x, [BK, BM])
    return gl.convert_layout(x, b_layout, assert_trivial=True)


@gluon.jit
def pdl_begin(PDL: gl.constexpr):
    """`pdl.begin` in Gluon: wait for the previous kernel, then let the next one be scheduled."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _program_ids(num_mblocks, SPLIT: gl.constexpr):
    """(block, K range, first n-tile) of this program: blocks fastest, then ranges."""
    pid = gl.program_id(0)
    rest = pid // num_mblocks
    return pid % num_mblocks, rest % SPLIT, rest // SPLIT


@gluon.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _w4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, tw_ptr,
    num_pairs, num_experts, num_mblocks, N, K,
    stride_x, stride_os, stride_or, expert_words, expert_scales,
    TOPK: gl.constexpr, GATHER: gl.constexpr, W: gl.constexpr, NREP: gl.constexpr,
    BM: gl.constexpr, KS_TOTAL: gl.constexpr, KSTEPS: gl.constexpr, NT: gl.constexpr,
    SPLIT: gl.constexpr, DOWN: gl.constexpr, DEPTH: gl.constexpr, UNROLL: gl.constexpr,
    PDL: gl.constexpr, PFA: gl.constexpr = 0,
):  # fmt: skip
    pdl_begin(PDL)
    pid_m, pid_s, pid_n = _program_ids(num_mblocks, SPLIT)
    e = gl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    _tiles(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, tw_ptr, e, pid_m, pid_s, pid_n, num_pairs, N,
           K, stride_x, stride_os, stride_or, expert_words, expert_scales, TOPK, GATHER, W, NREP,
           BM, KS_TOTAL, KSTEPS, NT, DOWN, DEPTH, UNROLL, PFA)  # fmt: skip


@gluon.jit(do_not_specialize=["num_pairs", "num_mblocks"])
def _w4_up_silu_kernel(
    x_ptr, w_ptr, s_ptr, part_ptr, pairs_ptr, bexp_ptr, h_ptr, ticket_ptr,
    num_pairs, num_experts, num_mblocks, N, K,
    stride_x, stride_ps, stride_pr, stride_h, expert_words, expert_scales,
    TOPK: gl.constexpr, W: gl.constexpr, NREP: gl.constexpr, BM: gl.constexpr,
    KS_TOTAL: gl.constexpr, KSTEPS: gl.constexpr, SPLIT: gl.constexpr, DEPTH: gl.constexpr,
    UNROLL: gl.constexpr, PDL: gl.constexpr, PFA: gl.constexpr = 0,
):  # fmt: skip
    """The up projection (N = 2 I, I a multiple of BN) into part[SPLIT, rows, N] fp32, then
    h[rows, I] = silu(gate) * up in bf16 by the last program of each (block, gate n-tile) unit;
    ticket[block * I / BN + j] counts the unit's arrivals (0 before and after the launch)."""
    pdl_begin(PDL)
    pid_m, pid_s, pid_n = _program_ids(num_mblocks, SPLIT)
    e = gl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    # (tw_ptr = part_ptr: the up projection does not read top-k weights)
    _tiles(x_ptr, w_ptr, s_ptr, part_ptr, pairs_ptr, part_ptr, e, pid_m, pid_s, pid_n, num_pairs,
           N, K, stride_x, stride_ps, stride_pr, expert_words, expert_scales, TOPK, True, W, NREP,
           BM, KS_TOTAL, KSTEPS, 1, False, DEPTH, UNROLL, PFA)  # fmt: skip
    BN: gl.constexpr = 16 * W * NREP
    units = N // (2 * BN)  # gate n-tiles per block (the host checks I % BN == 0)
    unit = pid_m * units + pid_n % units
    gl.thread_barrier()  # every thread's partial stored before the ticket is taken
    ticket = gl.atomic_add(ticket_ptr + unit, 1, sem="acq_rel")  # arrivals before this one
    if ticket == 2 * SPLIT - 1:  # the unit's other programs have stored theirs
        _silu_unit(part_ptr, h_ptr, pairs_ptr, pid_m, pid_n % units, num_pairs, N // 2,
                   stride_ps, stride_pr, stride_h, W, BM, BN, SPLIT)  # fmt: skip
        gl.store(ticket_ptr + unit, 0)  # clean for the next launch (or graph replay)


@gluon.jit
def _silu_unit(part_ptr, h_ptr, pairs_ptr, pid_m, j, num_pairs, inter, stride_ps, stride_pr,
               stride_h, W: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               SPLIT: gl.constexpr):  # fmt: skip
    """h[row, j BN + c] = silu(g) * u for the block's rows that hold a pair and c < BN, g and u
    the sums of part[s, row, j BN + c] and part[s, row, I + j BN + c] over s = 0 .. SPLIT-1 in
    that order, read from L2: `moe_reduce._silu_kernel`'s operations (zeros plus each split,
    then g / (1 + exp(-g)) * u, rounded once to bf16). Padding rows are neither read nor
    written (their partials were never stored; the down projection masks them out)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])  # 4 columns a thread
    rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, lay))  # [BM]
    ok = gl.expand_dims(gl.load(pairs_ptr + rows) < num_pairs, 1)  # [BM, 1] rows with a pair
    c = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, lay))  # [BN]
    rows = rows.to(gl.int64)
    p = part_ptr + gl.expand_dims(rows * stride_pr, 1) + gl.expand_dims(c, 0)  # [BM, BN]
    g = gl.zeros([BM, BN], gl.float32, layout=lay)
    u = gl.zeros([BM, BN], gl.float32, layout=lay)
    for s in gl.static_range(SPLIT):  # fixed order
        g += gl.load(p + s * stride_ps, mask=ok, other=0.0, cache_modifier=".cg")
        u += gl.load(p + s * stride_ps + inter, mask=ok, other=0.0, cache_modifier=".cg")
    h = g / (1.0 + gl.exp(-g)) * u
    out = h_ptr + gl.expand_dims(rows * stride_h, 1) + gl.expand_dims(c, 0)  # [BM, BN]
    gl.store(out, h.to(gl.bfloat16), mask=ok)


@gluon.jit
def _tiles(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, tw_ptr, e, pid_m, pid_s, pid_n, num_pairs, N,
           K, stride_x, stride_os, stride_or, expert_words, expert_scales, TOPK: gl.constexpr,
           GATHER: gl.constexpr, W: gl.constexpr, NREP: gl.constexpr, BM: gl.constexpr,
           KS_TOTAL: gl.constexpr, KSTEPS: gl.constexpr, NT: gl.constexpr, DOWN: gl.constexpr,
           DEPTH: gl.constexpr, UNROLL: gl.constexpr, PFA: gl.constexpr = 0):  # fmt: skip
    """One program's work: block pid_m (expert e), K range pid_s, n-tiles pid_n NT .. + NT - 1,
    each stored as it completes (`_store`)."""
    BN: gl.constexpr = 16 * W * NREP
    KC: gl.constexpr = BK // 16
    R: gl.constexpr = NREP * KC  # words per thread per step
    NW: gl.constexpr = 32 * W * R  # words per step (= BN * BK / 8)
    NS: gl.constexpr = 32 * W * NREP * 2  # scales per step (= BN * BK / 32)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    w_l: gl.constexpr = gl.BlockedLayout([R], [32], [W], [0])
    s_l: gl.constexpr = gl.BlockedLayout([2 * NREP], [32], [W], [0])
    x_l: gl.constexpr = _x_layout(W, BM)

    # x rows of this block (token gather for the up projection, block rows for the down)
    m = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
    col = gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
    pair = gl.load(pairs_ptr + pid_m * BM + m)
    valid = gl.expand_dims(pair < num_pairs, 1)  # [BM, 1]
    if GATHER:
        xr = (pair // TOPK).to(gl.int64)
    else:
        xr = (pid_m * BM + m).to(gl.int64)
    k_lo = pid_s * KSTEPS * BK
    x_off = gl.expand_dims(xr * stride_x, 1) + gl.expand_dims(col + k_lo, 0)  # [BM, BK]
    # weight stream: tiles of this program are consecutive
    tile0 = (pid_n * NT) * KS_TOTAL + pid_s * KSTEPS
    w_base = w_ptr + e.to(gl.int64) * expert_words + tile0.to(gl.int64) * NW
    s_base = s_ptr + e.to(gl.int64) * expert_scales + tile0.to(gl.int64) * NS
    w_off = gl.arange(0, NW, layout=w_l)
    s_off = gl.arange(0, NS, layout=s_l)
    # the block's output rows, once: each n-tile's store reads them without a load of its own
    row_o = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    pair_o = gl.load(pairs_ptr + row_o)
    if DOWN:  # the pairs' top-k weights
        wt_o = gl.load(tw_ptr + pair_o, mask=pair_o < num_pairs, other=0.0)
    else:
        wt_o = pair_o  # (unused)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    for a in gl.static_range(1, PFA + 1):  # PFA > 0: steps 1 .. PFA asked from L2 first
        _prefetch_step(w_base, s_base, gl.minimum(a, NT * KSTEPS - 1), NW, NS, W)
    w1 = gl.load(w_base + w_off)  # steps 0 (and 1) in flight before the loop
    if DEPTH == 2:
        w2 = gl.load(w_base + gl.minimum(1, NT * KSTEPS - 1) * NW + w_off)
    if DEPTH != 2:
        w2 = w1  # (unused)
    if UNROLL:  # straight-line steps: the compiler issues each step's loads a step early
        for t in gl.static_range(NT * KSTEPS):
            acc, w1, w2 = _step(t, acc, w1, w2, w_base, w_off, s_base, s_off, x_ptr, x_off, valid,
                                col, k_lo, K, out_ptr, row_o, pair_o, wt_o, pid_s, pid_n,
                                num_pairs, N, stride_os, stride_or, W, NREP, BM, KSTEPS, NT,
                                DOWN, DEPTH, PFA)  # fmt: skip
    else:
        for t in range(NT * KSTEPS):
            acc, w1, w2 = _step(t, acc, w1, w2, w_base, w_off, s_base, s_off, x_ptr, x_off, valid,
                                col, k_lo, K, out_ptr, row_o, pair_o, wt_o, pid_s, pid_n,
                                num_pairs, N, stride_os, stride_or, W, NREP, BM, KSTEPS, NT,
                                DOWN, DEPTH, PFA)  # fmt: skip


@gluon.jit
def _prefetch_step(w_base, s_base, step, NW: gl.constexpr, NS: gl.constexpr, W: gl.constexpr):
    """Ask L2 for step `step`'s 128-byte lines: NW / 32 of weights (int32 words), NS / 64 of
    scales (bf16), one line per thread (threads past them ask for the step's first line again).
    Nothing waits on them."""
    gl.static_assert(NW // 32 <= 32 * W and NS // 64 <= 32 * W, "a step's lines > threads")
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    line = gl.arange(0, 32 * W, layout=lay)
    w_row = w_base + step * NW
    s_row = s_base + step * NS
    _prefetch_l2(gl.where(line < NW // 32, w_row + line * 32, w_row))
    _prefetch_l2(gl.where(line < NS // 64, s_row + line * 64, s_row))


@gluon.jit
def _prefetch_l2(ptrs):
    """`pdl.prefetch_l2` in Gluon: ask L2 for the lines at `ptrs` (nothing waits on them)."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _step(t, acc, w1, w2, w_base, w_off, s_base, s_off, x_ptr, x_off, valid, col, k_lo, K,
          out_ptr, row_o, pair_o, wt_o, pid_s, pid_n, num_pairs, N, stride_os, stride_or,
          W: gl.constexpr, NREP: gl.constexpr, BM: gl.constexpr, KSTEPS: gl.constexpr,
          NT: gl.constexpr, DOWN: gl.constexpr, DEPTH: gl.constexpr,
          PFA: gl.constexpr = 0):  # fmt: skip
    """Step t of `_tiles`: the next weights in flight, this step's MMA, the n-tile stored when
    complete. Returns (acc, w1, w2) for step t + 1. PFA > 0: step t + PFA's weight and scale
    lines are first asked from L2 (`_prefetch_step`; the last steps ask for the last again)."""
    BN: gl.constexpr = 16 * W * NREP
    KC: gl.constexpr = BK // 16
    R: gl.constexpr = NREP * KC
    NW: gl.constexpr = 32 * W * R
    NS: gl.constexpr = 32 * W * NREP * 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    w_l: gl.constexpr = gl.BlockedLayout([R], [32], [W], [0])
    if PFA > 0:
        _prefetch_step(w_base, s_base, gl.minimum(t + PFA, NT * KSTEPS - 1), NW, NS, W)
    wc = w1
    nxt = gl.minimum(t + DEPTH, NT * KSTEPS - 1)  # (the last steps reload a tile: L2 hits)
    if DEPTH == 2:
        w1 = w2
        w2 = gl.load(w_base + nxt * NW + w_off)
    else:
        w1 = gl.load(w_base + nxt * NW + w_off)
    sc = gl.load(s_base + t * NS + s_off).to(gl.int16, bitcast=True)
    sc = gl.reshape(sc, [NS // 2, 2])
    s0, s1 = gl.split(sc)  # rows +0 / +8 of each rep
    s0 = gl.convert_layout(_dup(s0, 3), w_l, assert_trivial=True)
    s1 = gl.convert_layout(_dup(s1, 3), w_l, assert_trivial=True)
    a = _a_tile(wc, s0, s1, a_l, W, NREP, KC)
    kb = (t % KSTEPS) * BK
    x_ok = valid & gl.expand_dims(col + (k_lo + kb) < K, 0)
    b = _x_tile(x_ptr, x_off, x_ok, kb, b_l, BM)
    acc = mma_v2(a, b, acc)
    if t % KSTEPS == KSTEPS - 1:  # n-tile done: store it
        nt = pid_n * NT + t // KSTEPS
        _store(acc, out_ptr, row_o, pair_o, wt_o, pid_s, nt, num_pairs, N, stride_os, stride_or,
               mma, BN, DOWN)  # fmt: skip
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    return acc, w1, w2


@gluon.jit
def _store(acc, out_ptr, row, pair, wt, pid_s, nt, num_pairs, N, stride_os, stride_or,
           mma: gl.constexpr, BN: gl.constexpr, DOWN: gl.constexpr):  # fmt: skip
    """Store n-tile nt of the block: `row` its rows, `pair` their pairs, `wt` (DOWN) the pairs'
    top-k weights, all [BM] in the accumulator's column layout, loaded once per program."""
    n = nt * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    ok = gl.expand_dims(n < N, 1) & gl.expand_dims(pair < num_pairs, 0)
    if DOWN:  # y [P, N]: the pair's row, times its top-k weight, rounded once to y's dtype
        val = (acc * gl.expand_dims(wt, 0)).to(out_ptr.dtype.element_ty)
        r = pair.to(gl.int64)
    else:  # part [SPLIT, rows, N]: the block row
        val = acc
        r = row.to(gl.int64)
    ptrs = out_ptr + pid_s * stride_os + gl.expand_dims(r, 0) * stride_or + gl.expand_dims(n, 1)
    gl.store(ptrs, val, mask=ok)
