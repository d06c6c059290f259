"""Fused elementwise ops of a decoder layer in Triton: one launch where torch needs several.

Every op computes a row from that row alone (one program per token), so it is batch-invariant
whatever the row count; each reproduces the arithmetic of the torch sequence it replaces
(`fused_ref.py`), bitwise on the GPU for 16-bit activations:

- `add_rms_norm`: s = x + residual (fp32 add, rounded), then RMSNorm of s with exactly
  `invariant._rms_kernel`'s operations, block size and warps (the row reduction's tree follows
  from the block layout, so `n` equals `invariant.rms_norm(s)` bit for bit).
- `mla_rope_cache`: MLA's latent path (kv_a_layernorm of c_kv as `_rms_kernel`, RoPE of k_pe,
  cast, scattered to the cache rows) and the query's RoPE in one launch.
- `mla_latent`: the same latent path with q_a_layernorm (as `_rms_kernel`) instead of the
  query's RoPE, launched right after the q_a | kv_a matmul; the query's RoPE then runs in the
  q_b matmul's epilogue (`invariant.linear_rope`). Both norms reduce with `_rms_kernel`'s
  block and warps, so it serves ranks whose blocks get the same warps (`mla_latent_fits`).
- `silu_mul`: silu(gate) in fp32 with torch's formula (x / (1 + exp(-x)), libdevice expf, IEEE
  division) rounded, times up, rounded.

The launchers assert their preconditions; `backend` decides when they run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ddserve.kernels import pdl
from ddserve.kernels.invariant import _canonical, _rope_lane
from ddserve.kernels.pdl import _interpreting
from ddserve.kernels.pdl import begin as pdl_begin

HALF = (torch.bfloat16, torch.float16)


def _rms_warps(block: int) -> int:
    return 4 if block <= 4096 else 8  # as `invariant.rms_norm`


@triton.jit
def _rms_row(x, w_ptr, cols, ok, D, eps, dtype: tl.constexpr):
    """`invariant._rms_kernel`'s arithmetic on a loaded fp32 row x [BLOCK] -> [BLOCK] in dtype."""
    mean_sq = tl.sum(x * x, axis=0) / D
    normed = (x * (1.0 / tl.sqrt_rn(mean_sq + eps))).to(dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return (w * normed.to(tl.float32)).to(dtype)


@triton.jit
def _add_rms_kernel(
    x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, D, sx, sr, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """s = x + residual; y = rms_norm(s) * w; one program per row; s and y contiguous [M, D]."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < D
    a = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(r_ptr + row * sr + cols, mask=ok, other=0.0).to(tl.float32)
    s = (a + b).to(s_ptr.dtype.element_ty)  # [BLOCK] torch's 16-bit add: fp32, rounded once
    tl.store(s_ptr + row * D + cols, s, mask=ok)
    y = _rms_row(s.to(tl.float32), w_ptr, cols, ok, D, eps, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + cols, y, mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, n): s = x + residual [M, D] in x.dtype, n = RMSNorm(s) * weight, one launch."""
    d = x.shape[-1]
    assert x.dtype in HALF and residual.dtype == x.dtype == weight.dtype, "16-bit, one dtype"
    assert residual.shape == x.shape and weight.shape == (d,), "shapes"
    x2, (sx, _) = _canonical(x.reshape(-1, d))  # [M, D]
    r2, (sr, _) = _canonical(residual.reshape(-1, d))  # [M, D]
    s, y = torch.empty_like(x2), torch.empty_like(x2)  # [M, D] contiguous
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        _add_rms_kernel[(x2.shape[0],)](
            x2, r2, weight, s, y, d, sx, sr, eps, BLOCK=block, num_warps=_rms_warps(block),
            **pdl.launch_options(x.device),
        )  # fmt: skip
    return s.view(x.shape), y.view(x.shape)


@triton.jit
def _rope(x_ptr, j, P: tl.constexpr, ok, c, s, INTERLEAVE: tl.constexpr, INTERPRET: tl.constexpr):
    """`fused_ref.apply_rope` on the P values at x_ptr (output lanes j, any shape): x' is x
    de-interleaved or not; out = round(x' * cos) + round(rotate_half(x') * sin), rounded."""
    half: tl.constexpr = P // 2
    lo = j < half
    partner = tl.where(lo, j + half, j - half)  # rotate_half reads x'[partner], negated when lo
    if INTERLEAVE:  # x'[k] = x[2k] for k < P/2, x[2(k - P/2) + 1] after
        src = tl.where(lo, 2 * j, 2 * (j - half) + 1)
        src_partner = tl.where(lo, 2 * j + 1, 2 * (j - half))
    else:
        src, src_partner = j, partner
    a = tl.load(x_ptr + src, mask=ok, other=0.0)
    b = tl.load(x_ptr + src_partner, mask=ok, other=0.0).to(tl.float32)
    return _rope_lane(a, tl.where(lo, -b, b), c, s, INTERPRET)


@triton.jit
def _latent_row(
    kv_row, w_ptr, dst, c, s, j, j_ok, R, eps, P: tl.constexpr, BLOCK_R: tl.constexpr,
    INTERLEAVE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """A token's cache row dst = [rms_norm(kv[:R]) | rope(kv[R:])] in the cache's dtype: the
    kv_a_layernorm of c_kv as `invariant._rms_kernel` on a row of R (same BLOCK and warps),
    the RoPE of k_pe at lanes j with the token's cos/sin c, s (fp32)."""
    cols = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    ok = cols < R
    x = tl.load(kv_row + cols, mask=ok, other=0.0).to(tl.float32)
    c_kv = _rms_row(x, w_ptr, cols, ok, R, eps, kv_row.dtype.element_ty)  # [BLOCK_R]
    tl.store(dst + cols, c_kv.to(dst.dtype.element_ty), mask=ok)
    k_pe = _rope(kv_row + R, j, P, j_ok, c, s, INTERLEAVE, INTERPRET)  # [BP]
    tl.store(dst + R + j, k_pe.to(dst.dtype.element_ty), mask=j_ok)


@triton.jit
def _mla_rope_cache_kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, cache_ptr, q_ptr, qpe_ptr,
    R, H, skv, scache, sq, sqh, eps,
    Q_OFF: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Token row t: cache[slots[t]] = [rms_norm(kv[t, :R]) | rope(kv[t, R:])] in the cache's
    dtype; qpe[t] = rope(q[t, :, Q_OFF:]) [H, P]. cos/sin and qpe are contiguous."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_P)  # [BP]
    j_ok = j < P
    c = tl.load(cos_ptr + row * P + j, mask=j_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * P + j, mask=j_ok, other=0.0).to(tl.float32)
    dst = cache_ptr + tl.load(slots_ptr + row).to(tl.int64) * scache
    _latent_row(kv_ptr + row * skv, w_ptr, dst, c, s, j, j_ok, R, eps, P, BLOCK_R, INTERLEAVE,
                INTERPRET)  # fmt: skip
    # RoPE of the query heads' rope parts, q[t, h, Q_OFF:]
    h = tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    jj = j[None, :]  # [1, BP]
    h_ok = (h < H) & (jj < P)  # [BH, BP]
    q_pe = _rope(q_ptr + row * sq + h * sqh + Q_OFF, jj, P, h_ok, c[None, :], s[None, :],
                 INTERLEAVE, INTERPRET)  # fmt: skip
    tl.store(qpe_ptr + (row * H + h) * P + jj, q_pe, mask=h_ok)


def mla_rope_cache(
    q: torch.Tensor,  # [T, H, nope + P]
    kv: torch.Tensor,  # [T, R + P]
    norm_weight: torch.Tensor,  # [R]
    eps: float,
    cos: torch.Tensor,  # [T, P]
    sin: torch.Tensor,  # [T, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    slots: torch.Tensor,  # [T] int
    interleave: bool,
) -> torch.Tensor:  # [T, H, P] contiguous
    """`fused_ref.mla_rope_cache_ref` (with `invariant.rms_norm` as the norm) in one launch."""
    t, heads, qd = q.shape
    p = cos.shape[-1]
    assert q.dtype == kv.dtype and q.stride(-1) == 1 and qd >= p, "q: kv's dtype, unit stride"
    kv2, skv, cos, sin = _latent_operands(kv, norm_weight, cos, sin, kv_cache, slots)
    rank = norm_weight.shape[0]
    q_pe = torch.empty(t, heads, p, dtype=q.dtype, device=q.device)  # [T, H, P]
    if t:
        block_r = triton.next_power_of_2(rank)
        _mla_rope_cache_kernel[(t,)](
            kv2, norm_weight, cos, sin, slots, kv_cache, q, q_pe,
            rank, heads, skv, kv_cache.stride(0), q.stride(0), q.stride(1), eps,
            Q_OFF=qd - p, P=p, BLOCK_P=triton.next_power_of_2(p), BLOCK_R=block_r,
            BLOCK_H=triton.next_power_of_2(heads), INTERLEAVE=interleave,
            INTERPRET=_interpreting(), num_warps=_rms_warps(block_r),
            **pdl.launch_options(q.device),
        )  # fmt: skip
    return q_pe


def _latent_operands(kv, norm_weight, cos, sin, kv_cache, slots):
    """The cache side's operands checked and as the kernels read them: (kv, its row stride, cos,
    sin); kv's c_kv loads then vectorise as `invariant.rms_norm`'s."""
    t, rank, p = kv.shape[0], norm_weight.shape[0], cos.shape[-1]
    assert kv.dtype in HALF and kv.dtype == cos.dtype == sin.dtype, "16-bit, one dtype"
    assert norm_weight.dtype == kv.dtype, "kv_a_layernorm in the activations' dtype"
    assert p >= 2 and p % 2 == 0, f"rope dim {p} must be even"
    assert kv.shape == (t, rank + p) and kv_cache.shape[-1] == rank + p, "shapes"
    assert cos.shape == sin.shape == (t, p) and slots.shape == (t,), "cos / sin / slots"
    assert kv.stride(-1) == 1 and kv_cache.stride(-1) == 1, "unit stride"
    kv2, (skv, _) = _canonical(kv)
    return kv2, skv, cos.contiguous(), sin.contiguous()


@triton.jit
def _mla_latent_kernel(
    qa_ptr, qw_ptr, qn_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, cache_ptr,
    Q, R, sqa, skv, scache, q_eps, eps,
    P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    INTERLEAVE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Token row t: qn[t] = rms_norm(q_a[t]) [Q] (q_a_layernorm, qn contiguous); cache[slots[t]]
    = [rms_norm(kv[t, :R]) | rope(kv[t, R:])] in the cache's dtype. cos/sin contiguous."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    # q_a_layernorm: `invariant._rms_kernel` on a row of Q (same BLOCK and warps)
    cols = tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    ok = cols < Q
    x = tl.load(qa_ptr + row * sqa + cols, mask=ok, other=0.0).to(tl.float32)
    q_n = _rms_row(x, qw_ptr, cols, ok, Q, q_eps, qn_ptr.dtype.element_ty)  # [BLOCK_Q]
    tl.store(qn_ptr + row * Q + cols, q_n, mask=ok)
    j = tl.arange(0, BLOCK_P)  # [BP]
    j_ok = j < P
    c = tl.load(cos_ptr + row * P + j, mask=j_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * P + j, mask=j_ok, other=0.0).to(tl.float32)
    dst = cache_ptr + tl.load(slots_ptr + row).to(tl.int64) * scache
    _latent_row(kv_ptr + row * skv, w_ptr, dst, c, s, j, j_ok, R, eps, P, BLOCK_R, INTERLEAVE,
                INTERPRET)  # fmt: skip


def mla_latent_fits(q_lora: int, rank: int) -> bool:
    """Whether one launch can norm rows of q_lora and of rank as `invariant.rms_norm` does:
    their blocks get the same warps (at K2.6, 1536 and 512: 4 each)."""
    return _rms_warps(triton.next_power_of_2(q_lora)) == _rms_warps(triton.next_power_of_2(rank))


def mla_latent(
    q_a: torch.Tensor,  # [T, q_lora] q_a_proj's output (rows may be strided)
    q_norm_weight: torch.Tensor,  # [q_lora] q_a_layernorm
    q_eps: float,
    kv: torch.Tensor,  # [T, R + P]
    norm_weight: torch.Tensor,  # [R] kv_a_layernorm
    eps: float,
    cos: torch.Tensor,  # [T, P]
    sin: torch.Tensor,  # [T, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    slots: torch.Tensor,  # [T] int
    interleave: bool,
) -> torch.Tensor:  # [T, q_lora] contiguous
    """`fused_ref.mla_latent_ref` (with `invariant.rms_norm` as both norms) in one launch."""
    t, q_lora = q_a.shape
    assert q_a.dtype == q_norm_weight.dtype == kv.dtype and q_norm_weight.shape == (q_lora,)
    assert q_a.stride(-1) == 1 and kv.shape[0] == t, "q_a: [T, q_lora], unit stride"
    kv2, skv, cos, sin = _latent_operands(kv, norm_weight, cos, sin, kv_cache, slots)
    rank, p = norm_weight.shape[0], cos.shape[-1]
    assert mla_latent_fits(q_lora, rank), "the two norms need different warps"
    qa2, (sqa, _) = _canonical(q_a)  # the loads vectorise as `invariant.rms_norm`'s
    q_n = torch.empty(t, q_lora, dtype=q_a.dtype, device=q_a.device)  # [T, q_lora]
    if t:
        block_q = triton.next_power_of_2(q_lora)
        _mla_latent_kernel[(t,)](
            qa2, q_norm_weight, q_n, kv2, norm_weight, cos, sin, slots, kv_cache,
            q_lora, rank, sqa, skv, kv_cache.stride(0), q_eps, eps,
            P=p, BLOCK_P=triton.next_power_of_2(p), BLOCK_Q=block_q,
            BLOCK_R=triton.next_power_of_2(rank), INTERLEAVE=interleave,
            INTERPRET=_interpreting(), num_warps=_rms_warps(block_q),
            **pdl.launch_options(q_a.device),
        )  # fmt: skip
    return q_n


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(
    gu_ptr, y_ptr, M, N, sg, BLOCK: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr
):
    """y[m, i] = round(round(silu(gu[m, i])) * gu[m, N + i]) for i < N (the intermediate size);
    program (row, column block)."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < N
    g = tl.load(gu_ptr + row * sg + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * sg + N + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    if INTERPRET:  # the interpreter has no libdevice
        e = tl.exp(-gf)
    else:
        e = libdevice.exp(-gf)  # expf, as torch's CUDA silu (tl.exp is an approximation)
    act = tl.math.div_rn(gf, 1.0 + e).to(g.dtype)  # torch's silu in fp32, rounded
    tl.store(y_ptr + row * N + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] (gate first) -> silu(gate) * up [..., I] in gu.dtype, one launch."""
    assert gu.dtype in HALF and gu.shape[-1] % 2 == 0, "16-bit [.., 2I]"
    inner = gu.shape[-1] // 2
    gu2 = gu.reshape(-1, 2 * inner)  # [M, 2I]
    if gu2.stride(-1) != 1:
        gu2 = gu2.contiguous()
    y = torch.empty(gu2.shape[0], inner, dtype=gu.dtype, device=gu.device)  # [M, I]
    if gu2.shape[0]:
        grid = (gu2.shape[0], triton.cdiv(inner, 1024))
        _silu_mul_kernel[grid](
            gu2, y, gu2.shape[0], inner, gu2.stride(0), BLOCK=1024, INTERPRET=_interpreting(),
            **pdl.launch_options(gu.device),
        )  # fmt: skip
    return y.view(*gu.shape[:-1], inner)
