"""Plain-torch references of the fused elementwise ops of a decoder layer (`fused.py`), and of
the matmul with the query's RoPE in its epilogue (`invariant.linear_rope`: `linear_rope_ref`).

Each is the exact sequence of torch ops the model runs without fusion (CPU, float32, batch
invariance off), so `backend` uses them as the fallback and the tests compare the kernels with them.
The RMSNorm inside is passed in (`rms_norm`): the model's fallback gives `backend.rms_norm`, which
is `invariant_ref.rms_norm_ref` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ddserve.kernels.invariant_ref import linear_ref, rms_norm_ref

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """x [T, H, P] (or [T, P]) rotated by cos/sin [T, P] (`rope.RotaryEmbedding.cos_sin`), in
    x's dtype: x * cos and rotate_half(x) * sin each rounded, then their sum rounded (HF's
    arithmetic). With `interleave` the pairs (x0, x1), (x2, x3), ... are first de-interleaved to
    (x0, x2, ..., x1, x3, ...)."""
    if interleave:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # de-interleave pairs
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    rms_norm: RmsNorm = rms_norm_ref,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(s, rms_norm(s)) with s = x + residual in their dtype (the residual stream's add)."""
    s = x + residual  # [T, D]
    return s, rms_norm(s, weight, eps)


def mla_rope_cache_ref(
    q: torch.Tensor,  # [T, H, nope + P] the query heads (q_b_proj's output)
    kv: torch.Tensor,  # [T, R + P] kv_a_proj_with_mqa's output
    norm_weight: torch.Tensor,  # [R] kv_a_layernorm
    eps: float,
    cos: torch.Tensor,  # [T, P]
    sin: torch.Tensor,  # [T, P]
    kv_cache: torch.Tensor,  # [S, R + P] one layer's latent pool
    slots: torch.Tensor,  # [T] rows of kv_cache the tokens' latents go to
    interleave: bool,
    rms_norm: RmsNorm = rms_norm_ref,
) -> torch.Tensor:  # [T, H, P] q_pe rotated, contiguous
    """MLA's latent path: kv_cache[slots] = [rms_norm(c_kv) | rope(k_pe)] cast to the cache's
    dtype; returns the query's rotated rope part."""
    p = cos.shape[-1]
    q_pe = apply_rope(q[..., q.shape[-1] - p :], cos, sin, interleave)  # [T, H, P]
    _write_latent(kv, norm_weight, eps, cos, sin, kv_cache, slots, interleave, rms_norm)
    return q_pe.contiguous()


def mla_latent_ref(
    q_a: torch.Tensor,  # [T, q_lora] q_a_proj's output
    q_norm_weight: torch.Tensor,  # [q_lora] q_a_layernorm
    q_eps: float,
    kv: torch.Tensor,  # [T, R + P]
    norm_weight: torch.Tensor,  # [R] kv_a_layernorm
    eps: float,
    cos: torch.Tensor,  # [T, P]
    sin: torch.Tensor,  # [T, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    slots: torch.Tensor,  # [T]
    interleave: bool,
    rms_norm: RmsNorm = rms_norm_ref,
) -> torch.Tensor:  # [T, q_lora]
    """MLA's latent path with the query's norm in place of its RoPE: kv_cache[slots] as
    `mla_rope_cache_ref` writes it; returns rms_norm(q_a) (q_a_layernorm)."""
    _write_latent(kv, norm_weight, eps, cos, sin, kv_cache, slots, interleave, rms_norm)
    return rms_norm(q_a, q_norm_weight, q_eps)


def _write_latent(kv, norm_weight, eps, cos, sin, kv_cache, slots, interleave, rms_norm) -> None:
    rank, p = norm_weight.shape[0], cos.shape[-1]
    c_kv, k_pe = kv.split([rank, p], dim=-1)
    k_pe = apply_rope(k_pe, cos, sin, interleave)  # [T, P]
    latent = torch.cat([rms_norm(c_kv, norm_weight, eps), k_pe], dim=-1)  # [T, R + P]
    kv_cache[slots] = latent.to(kv_cache.dtype)


def linear_rope_ref(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope: int,
    interleave: bool, linear: Linear = linear_ref,
) -> torch.Tensor:  # fmt: skip
    """linear(x, w) [T, H * (nope + P)] with each head's last P columns rotated by `apply_rope`
    (the query's q_b_proj and RoPE, as MLA runs them without fusion)."""
    y = linear(x, w)  # [T, H * (nope + P)]
    heads = y.view(y.shape[0], -1, nope + cos.shape[-1])  # [T, H, nope + P]
    heads[..., nope:] = apply_rope(heads[..., nope:], cos, sin, interleave)
    return y


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate first) -> silu(gate) * up [T, I], each op rounded to gu's dtype."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up
