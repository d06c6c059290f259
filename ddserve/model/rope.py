"""Rotary position embedding with YaRN scaling, exactly as HF `transformers` computes it.

With `rope_interleave` the checkpoint's rope dims are pairs (x0, x1), (x2, x3), ...; HF first
de-interleaves them to (x0, x2, ..., x1, x3, ...) and then applies the rotate-half form. We do
the same, so cached k_rope values are in the de-interleaved layout (queries match it). The
rotation itself, `apply_rope`, lives beside its fused kernel (`kernels/fused_ref.py`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ddserve.config import ModelConfig, yarn_mscale
from ddserve.kernels.fused_ref import apply_rope  # noqa: F401 (the rotation, re-exported)


def _ramp(low: float, high: float, n: int) -> torch.Tensor:  # [n] in [0, 1]
    if low == high:
        high += 0.001
    return ((torch.arange(n, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [P/2] float32, attention_factor multiplying cos and sin)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [P/2]
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0
    factor = rs["factor"]
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    orig_max = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    extrapolation = 1 - _ramp(low, high, dim // 2)  # [P/2]: 1 keeps the original frequency
    interpolated, original = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + original * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Holds inv_freq; produces the per-position cos/sin shared by all layers."""

    def __init__(self, cfg: ModelConfig, device) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, P] for `positions` [T], computed in fp32 then cast (as HF)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()  # [T, P/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, P]
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
