"""The DFlash drafter's block attention at inference on CUDA, reading the context in place:
the block's queries attend each stream's context keys and values straight from the drafter's
ring (`ContextCache.k/v` of one layer, at the stream's row) and the block's own keys, in one
split-key pass and one merge (two launches per layer), where gathering the rows first
(`ContextCache.layer` + `layers.grouped_attention`, the CPU path) copies every stream's whole
context per layer and runs ~12 kernels, among them a values product cuBLAS runs unaligned when
the ring's length is not a multiple of 8.

`ring_attention(q, ring_k, ring_v, rows, k_blk, v_blk, visible, lengths=None)`:
- q [B, Q, NH, Dh]; ring_k, ring_v [S, C, KVH, Dh] (one layer); rows [B] (the streams' rows);
  k_blk, v_blk [B, Q, KVH, Dh]; visible [B, Q, C + Q] bool (the context columns, then the
  block's); lengths [S] (`ContextCache.lengths`): a stream shorter than the ring attends its
  written entries only, and tiles past them are skipped (the work follows the live context);
- query head h reads KV head h // (NH / KVH); scale Dh^-0.5; the two products' inputs in the
  cache's dtype (tensor cores in bf16), scores, softmax and sums in fp32;
- -> [B, Q, NH * Dh] in q's dtype: `layers.grouped_attention` over the gathered keys up to
  float rounding (tests/kernels/test_drafter_attn_interp.py in the interpreter,
  tests/gpu/test_drafter_attn_gpu.py in bf16 on the GPU).

Partial pass: one program per (stream, KV head, split of the C + Q keys); its BLOCK_M rows are the
KV head's G * Q (query head, query) pairs, so one key tile serves all the query heads that read
it. Each split writes its rows' normalised sums and log-sum-exp; the merge weights them. Launch
shapes follow (B, Q, C) only: CUDA-graph safe, no host sync. The drafter's draft changes which
tree is verified, never the committed tokens, so its arithmetic need not be batch-invariant.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _partial_kernel(
    q_ptr, rk_ptr, rv_ptr, rows_ptr, len_ptr, kb_ptr, vb_ptr, vis_ptr, po_ptr, pl_ptr,
    C, KEYS,
    sq_b, sq_q, sq_h, sr_s, sr_c, sr_h, sb_b, sb_q, sb_h, sv_b, sv_q,
    Q: tl.constexpr, G: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
    NSPLIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LENGTHS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid, split = tl.program_id(0), tl.program_id(1)
    b, h = pid // KVH, pid % KVH
    m = tl.arange(0, BLOCK_M)
    qi, g = m % Q, m // Q
    row_ok = m < G * Q
    d = tl.arange(0, D)
    qp = q_ptr + b * sq_b + qi[:, None] * sq_q + (h * G + g)[:, None] * sq_h + d[None, :]
    kind = rk_ptr.dtype.element_ty  # tensor-core inputs in the cache's dtype, sums in fp32
    qv = (tl.load(qp, mask=row_ok[:, None], other=0.0).to(tl.float32) * (D**-0.5)).to(kind)
    ring = tl.load(rows_ptr + b)
    live = C  # ring entries [0, live) may be attended: all, or what a short stream has written
    if LENGTHS:
        live = tl.minimum(tl.load(len_ptr + ring), C).to(tl.int32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    lo = split * CHUNK
    for start in range(0, CHUNK, BLOCK_N):
        t0 = lo + start
        if (t0 < live) | ((t0 + BLOCK_N > C) & (t0 < KEYS)):  # else a tile of dead entries
            n = t0 + tl.arange(0, BLOCK_N)
            in_ctx, in_blk = n < live, (n >= C) & (n < KEYS)
            ctx_off = ring * sr_s + n[:, None] * sr_c + h * sr_h + d[None, :]
            blk_off = b * sb_b + (n - C)[:, None] * sb_q + h * sb_h + d[None, :]
            k = tl.where(in_ctx[:, None],
                         tl.load(rk_ptr + ctx_off, mask=in_ctx[:, None], other=0.0),
                         tl.load(kb_ptr + blk_off, mask=in_blk[:, None], other=0.0))  # fmt: skip
            v = tl.where(in_ctx[:, None],
                         tl.load(rv_ptr + ctx_off, mask=in_ctx[:, None], other=0.0),
                         tl.load(vb_ptr + blk_off, mask=in_blk[:, None], other=0.0))  # fmt: skip
            vis = tl.load(vis_ptr + b * sv_b + qi[:, None] * sv_q + n[None, :],
                          mask=row_ok[:, None] & (in_ctx | in_blk)[None, :], other=0)  # fmt: skip
            s = tl.dot(qv, tl.trans(k), input_precision=PREC)  # [BLOCK_M, BLOCK_N]
            s = tl.where(vis != 0, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kind), v, input_precision=PREC)
            m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    out = (pid * NSPLIT + split) * BLOCK_M + m
    tl.store(pl_ptr + out, lse)
    tl.store(po_ptr + out[:, None] * D + d[None, :], acc / tl.maximum(l_i, 1e-30)[:, None])


@triton.jit
def _merge_kernel(
    po_ptr, pl_ptr, out_ptr, so_b, so_q,
    Q: tl.constexpr, G: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
    NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    pid, m = tl.program_id(0), tl.program_id(1)
    b, h = pid // KVH, pid % KVH
    qi, g = m % Q, m // Q
    s = tl.arange(0, BLOCK_S)
    idx = (pid * NSPLIT + s) * BLOCK_M + m
    lse = tl.load(pl_ptr + idx, mask=s < NSPLIT, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp(lse - top)  # 0 for empty splits
    d = tl.arange(0, D)
    parts = tl.load(po_ptr + idx[:, None] * D + d[None, :], mask=(s < NSPLIT)[:, None], other=0.0)
    o = tl.sum(w[:, None] * parts, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * so_b + qi * so_q + (h * G + g) * D + d, o.to(out_ptr.dtype.element_ty))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter on a CPU: an H100's / H200's count, so splits look alike
    return torch.cuda.get_device_properties(device).multi_processor_count


def supports(q: torch.Tensor, ring_k: torch.Tensor) -> bool:
    """Whether the kernels take these shapes: a head size that is a power of two of at least
    16 (`tl.arange`, `tl.dot`) and query heads in whole groups per KV head."""
    d, nh, kvh = q.shape[-1], q.shape[2], ring_k.shape[2]
    return d >= 16 and d & (d - 1) == 0 and nh % kvh == 0


def ring_attention(
    q, ring_k, ring_v, rows, k_blk, v_blk, visible, block_n: int = 64,
    keys_per_split: int | None = None, num_warps: int = 8, lengths=None,
) -> torch.Tensor:  # fmt: skip
    """See the module docstring. `lengths` [S] (each ring row's committed tokens, None: every
    entry written): ring entries at or past a row's length (a stream shorter than the ring) are
    never attended, whatever `visible` says, and key tiles of such entries only are skipped, so
    the work follows each stream's live context, not the ring's size. `keys_per_split` None:
    about one partial program per SM (at least `block_n` keys per split; split count and size
    are compile-time constants, so each batch size compiles its kernel once, at capture in a
    CUDA-graph engine). The defaults (auto splits, 8 warps, 64-key tiles) were the fastest or
    within 1.2 us of it at 1, 5 and 10 streams over rings of 2,048 and 4,096 in
    `bench/bench_drafter_attn.py`'s sweep on an H100: 10.7 / 14.8 / 20.5 us at 2,048 where 256
    keys per split with 4 warps took 25.6 / 27.2 / 29.5. Float32 rings multiply in full fp32
    (no TF32)."""
    b, q_len, nh, d = q.shape
    c, kvh = ring_k.shape[1], ring_k.shape[2]
    g = nh // kvh
    keys = c + q_len
    if keys_per_split is None:
        keys_per_split = -(-keys * b * kvh // _sm_count(q.device))
    tiles = -(-keys // block_n)  # the C + Q keys in tiles: no split runs past the last one
    chunk = block_n * min(tiles, max(1, -(-keys_per_split // block_n)))
    nsplit = -(-keys // chunk)
    block_m = max(16, triton.next_power_of_2(g * q_len))
    for t in (ring_k, ring_v, k_blk, v_blk):
        if t.stride(-1) != 1 or t.stride(-2) != d:
            raise ValueError("ring_attention needs [..., KVH, Dh] rows laid out densely")
    if ring_k.stride() != ring_v.stride() or k_blk.stride() != v_blk.stride():
        raise ValueError("ring_attention needs k and v laid out alike")
    q = q.contiguous()
    vis = visible.contiguous().view(torch.int8)  # same bytes, no copy
    po = torch.empty(b * kvh * nsplit * block_m, d, dtype=torch.float32, device=q.device)
    pl = torch.empty(b * kvh * nsplit * block_m, dtype=torch.float32, device=q.device)
    _partial_kernel[(b * kvh, nsplit)](
        q, ring_k, ring_v, rows, rows if lengths is None else lengths, k_blk, v_blk, vis, po, pl,
        c, keys,
        q.stride(0), q.stride(1), q.stride(2), ring_k.stride(0), ring_k.stride(1),
        ring_k.stride(2), k_blk.stride(0), k_blk.stride(1), k_blk.stride(2),
        vis.stride(0), vis.stride(1),
        Q=q_len, G=g, KVH=kvh, D=d, NSPLIT=nsplit, CHUNK=chunk, BLOCK_M=block_m,
        BLOCK_N=block_n, LENGTHS=lengths is not None, num_warps=num_warps,
        PREC="ieee" if ring_k.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
    )  # fmt: skip
    out = torch.empty(b, q_len, nh * d, dtype=q.dtype, device=q.device)
    _merge_kernel[(b * kvh, g * q_len)](
        po, pl, out, out.stride(0), out.stride(1),
        Q=q_len, G=g, KVH=kvh, D=d, NSPLIT=nsplit, BLOCK_M=block_m,
        BLOCK_S=max(2, triton.next_power_of_2(nsplit)),
    )  # fmt: skip
    return out
