"""Rotary position embedding for the drafter: rotate-half layout (Qwen3), default/linear/YaRN.

YaRN follows HF's `_compute_yarn_parameters`: per-frequency blend of interpolated and extrapolated
inverse frequencies over the correction range [low, high] set by beta_fast/beta_slow, and an
attention factor that multiplies cos and sin (so it scales every q.k score by its square).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ddserve.drafter.config import RopeParams


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(p: RopeParams, dim: int) -> tuple[Tensor, float]:
    """(inverse frequencies [dim/2] float32 on the CPU, attention factor) for head dim `dim`.

    The device is explicit: the loader builds the model under torch.device("meta"), where an
    implicit-device arange goes through torch's reference decompositions (importing them costs
    ~2 s on the 2-core CPU machine, every start)."""
    cpu = torch.device("cpu")
    base = p.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=cpu) / dim)  # [dim/2]
    if p.kind == "default":
        return 1.0 / base, 1.0
    if p.kind == "linear":
        return 1.0 / (p.factor * base), 1.0
    factor = p.factor
    attn = p.attention_factor
    if attn is None:
        if p.mscale and p.mscale_all_dim:
            attn = _yarn_mscale(factor, p.mscale) / _yarn_mscale(factor, p.mscale_all_dim)
        else:
            attn = _yarn_mscale(factor)
    orig = p.original_max_position_embeddings
    if orig is None:
        raise ValueError("yarn rope needs original_max_position_embeddings")

    def corr_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(p.theta))

    low, high = corr_dim(p.beta_fast), corr_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    half = torch.arange(dim // 2, dtype=torch.float32, device=cpu)  # [dim/2]
    ramp = ((half - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # [dim/2]: 1 keeps the original frequency
    inv = (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate
    return inv, float(attn)


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(nn.Module):
    """cos/sin for arbitrary integer positions, computed in float32 on the fly (no table limit)."""

    def __init__(self, p: RopeParams, head_dim: int):
        super().__init__()
        self.params, self.head_dim = p, head_dim
        inv, self.attention_factor = rope_inv_freq(p, head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _apply(self, fn, recurse=True):
        """Follow device moves, never dtype casts: rebuild the float32 frequencies where fn puts
        tensors (also lifts a meta-device model onto a real device)."""
        device = fn(torch.empty(0)).device
        self.inv_freq = rope_inv_freq(self.params, self.head_dim)[0].to(device)
        return self

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [...] int -> cos, sin [..., head_dim] in `dtype`."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., dim]
        f = self.attention_factor
        return (emb.cos() * f).to(dtype), (emb.sin() * f).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., T, heads, dim]; cos/sin [..., T, dim] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin
