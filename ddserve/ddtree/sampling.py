"""Target-token selection at every verify row: argmax (T = 0) or an exact sample (T > 0).

Randomness is a counter-based hash of (seed, step, row): every rank computes the same uniform for
the same stream, step and row without sharing generator state, and no host sync is needed. Each row
gets its own independent uniform, which is what makes the acceptance walk lossless. A sample is
drawn by inverting the CDF of softmax(logits / T) after top-k, then top-p filtering (top-p keeps
the smallest set of most probable tokens whose mass reaches p).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_STEP = _i64(0xD6E8FEB86659FD93)
_ROW = _i64(0xA0761D6478BD642F)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    return x ^ _srl(x, 31)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[B] seeds, [B] steps -> [B, num_rows] float64 uniforms in (0, 1)."""
    rows = torch.arange(num_rows, device=seeds.device, dtype=torch.long)  # [M]
    key = splitmix64(seeds.long())[:, None] ^ (steps.long()[:, None] * _STEP) ^ (rows * _ROW)
    bits = _srl(splitmix64(key), 11)  # [B, M] 53 random bits
    return (bits.double() + 0.5) * 2.0**-53


def filtered_probs(
    logits: torch.Tensor,  # [B, M, V] float32
    temperature: torch.Tensor,  # [B] > 0
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] float, 1 = off
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling distribution, descending-logit order: (probs [B, M, V] f64, ids [B, M, V])."""
    v = logits.shape[-1]
    scaled = logits.double() / temperature.double()[:, None, None]  # [B, M, V]
    vals, ids = scaled.sort(dim=-1, descending=True, stable=True)  # [B, M, V]
    rank = torch.arange(v, device=logits.device)  # [V]
    k = torch.where(top_k > 0, top_k, v)  # [B]
    vals = vals.masked_fill(rank >= k[:, None, None], float("-inf"))
    probs = vals.softmax(dim=-1)  # [B, M, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, M, V] exclusive cumulative mass
    drop = (mass_before >= top_p.double()[:, None, None]) & (rank > 0)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), ids


def select_tokens(
    logits: torch.Tensor,  # [B, M, V] float32, rows of one stream's block
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_k: torch.Tensor,  # [B] int64
    top_p: torch.Tensor,  # [B] float
    seeds: torch.Tensor,  # [B] int64
    steps: torch.Tensor,  # [B] int64
    all_greedy: bool = False,
) -> torch.Tensor:  # [B, M] int64
    """The target's token at every row. `all_greedy` (known on the host) skips the sampler."""
    greedy = logits.argmax(dim=-1)  # [B, M]
    if all_greedy:
        return greedy
    temp = torch.where(temperature > 0, temperature, 1.0)  # [B] avoid 0-division on greedy rows
    probs, ids = filtered_probs(logits, temp, top_k, top_p)  # [B, M, V]
    cdf = probs.cumsum(dim=-1)  # [B, M, V]
    u = uniforms(seeds, steps, logits.shape[1]) * cdf[..., -1]  # [B, M]
    pick = torch.searchsorted(cdf, u[..., None]).clamp_max(logits.shape[-1] - 1)  # [B, M, 1]
    sampled = ids.gather(-1, pick)[..., 0]  # [B, M]
    return torch.where((temperature > 0)[:, None], sampled, greedy)
