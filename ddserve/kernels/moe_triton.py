"""W4A16 grouped MoE in Triton: the entry point `fused_moe` and its variants.

Variants (pick with config={"variant": ...}; the other config keys go to the variant):
- "v2" (default, `moe_triton_v2`): split-K up-projection, bf16x2 asm dequant on CUDA, and a
  batch-invariant mode (fixed tiles, fixed-order sums, no atomics) when `invariant=True`.
- "v1" (`moe_triton_v1`): the first kernel, kept for comparison; not batch invariant, so
  `invariant=True` never runs it unless the config names it explicitly.
- "v3" (`moe_v3`, Gluon, CUDA and INT4 only): dequantized weights fed to mma.sync from registers,
  weights repacked once into the kernel's stream; always batch invariant.
"""

from __future__ import annotations

import torch

from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.kernels.moe_triton_v1 import _pick_bm, align_by_expert, fused_moe_v1
from ddserve.kernels.moe_triton_v2 import fused_moe_v2
from ddserve.kernels.moe_v3 import fused_moe_v3

__all__ = ["DEFAULT_VARIANT", "VARIANTS", "_pick_bm", "align_by_expert", "fused_moe"]

VARIANTS = {"v1": fused_moe_v1, "v2": fused_moe_v2, "v3": fused_moe_v3}
DEFAULT_VARIANT = "v2"


def fused_moe(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float32, routed_scaling_factor already applied
    weights: ExpertWeights,
    *,
    config: dict | None = None,
    invariant: bool = False,
) -> torch.Tensor:  # [T, H] in x.dtype
    """`moe_ref`'s contract on CUDA (or the Triton interpreter); no host sync, graph capturable.

    `invariant`: token t's output row is bitwise the same whatever else is in the call."""
    cfg = dict(config or {})
    variant = cfg.pop("variant", DEFAULT_VARIANT)
    return VARIANTS[variant](x, topk_ids, topk_weights, weights, config=cfg, invariant=invariant)
