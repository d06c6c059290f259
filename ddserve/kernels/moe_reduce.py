"""The MoE's fixed-order reductions (`moe_triton_v2`, `moe_v3`): what makes a token's output
independent of the rest of the batch is that every sum over partial results runs in an order
fixed by the layer's shapes, never by scheduling (no atomics).

- `_silu_kernel`: the up-projection's split-K partials [SPLIT, rows, 2 I] fp32 summed in split
  order, then silu(gate) * up, written as the down-projection's bf16 input h [rows, I].
  (`moe_gluon._silu_unit` is the same computation inside v3's up launch, with FUSED_SILU; the
  two must keep the same operations in the same order.)
- `_combine_kernel`: a token's k expert outputs (one row per (token, slot) pair, already
  weighted; bf16 or fp32) summed in fp32 in slot order j = 0 .. k-1, cast to the output dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddserve.kernels.pdl import begin as pdl_begin


@triton.jit
def _silu_kernel(part_ptr, h_ptr, bexp_ptr, num_experts, N_half, stride_ps, stride_pr, stride_h,
                 SPLIT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    pdl_begin(PDL)
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m)
    if e >= num_experts:
        return
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)  # [BM]
    c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC]
    m = (c < N_half)[None, :]
    g = tl.zeros([BM, BC], dtype=tl.float32)
    u = tl.zeros([BM, BC], dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # fixed order
        p = part_ptr + s * stride_ps + rows[:, None] * stride_pr + c[None, :]
        g += tl.load(p, mask=m, other=0.0)
        u += tl.load(p + N_half, mask=m, other=0.0)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + rows[:, None] * stride_h + c[None, :], h.to(tl.bfloat16), mask=m)


@triton.jit
def _combine_kernel(
    y_ptr, out_ptr, N, stride_y, stride_o, TOPK: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr
):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = c < N
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(TOPK):  # slot order
        acc += tl.load(y_ptr + (t * TOPK + j) * stride_y + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + c, acc.to(out_ptr.dtype.element_ty), mask=m)
