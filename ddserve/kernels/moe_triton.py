"""W4A16 grouped MoE in Triton / Gluon: the entry point `fused_moe` and its two variants.

- "v3" (`moe_v3`, Gluon, CUDA and INT4 with bf16 scales only): dequantized weights fed to
  mma.sync from registers, weights repacked once into the kernel's stream. The default where it
  applies.
- "v2" (`moe_triton_v2`): split-K up-projection on the layout as shipped, bf16x2 asm dequant on
  CUDA; dense experts, other scale dtypes, the Triton interpreter, and the fallback when v3 fails
  on its first call (compile or launch: V3_ERROR says why, and v2 runs from then on).
Both are batch invariant (fixed tiles, fixed-order sums, no atomics). The engine's
`KernelConfig.moe_variant` (set from DDSERVE_MOE_VARIANT, see `config.py`) or config={"variant":
...} names a variant explicitly, with no fallback. `fused_moe_pairs`: v3 without its top-k combine
(the per-pair outputs) for calls of at most PAIRS_MAX_TOKENS tokens, whose combine the shared
expert's down matmul then does in its epilogue.
"""

from __future__ import annotations

import logging

import torch

from ddserve.kernels import backend
from ddserve.kernels.moe_common import may_fall_back
from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.kernels.moe_triton_v2 import fused_moe_v2
from ddserve.kernels.moe_v3 import CHUNK, fused_moe_v3
from ddserve.kernels.moe_w4_repack import in_place_started

__all__ = ["VARIANTS", "default_variant", "fused_moe", "fused_moe_pairs"]

log = logging.getLogger(__name__)
VARIANTS = {"v2": fused_moe_v2, "v3": fused_moe_v3}
V3_ERROR: str | None = None  # set when v3 failed to compile or launch (then v2 from then on)
# Tokens up to which the MoE's top-k combine runs in the shared expert's down matmul
# (`fused_moe_pairs`) instead of its own launch: every call that fits one launch set (v3's
# CHUNK). The shared down matmul plus the combine with bf16 pairs, K2.6 rank shapes on an H200
# (bench/bench_shared_epilogue.py, graph replays, us; shared_epilogue_*_h200_2026-12-03.json):
# separate 5.7 / 6.4 / 11.6 / 34.3 / 60.3, combine in the epilogue 4.8 / 4.9 / 9.4 / 33.7 / 58.4
# at 1 / 10 / 170 / 512 / 1024 tokens; with the prompt chunks' configuration the epilogue is
# 0.1-0.6 us slower up to 17 tokens and faster from 64. The bits are the same either way.
PAIRS_MAX_TOKENS = CHUNK


def default_variant(x: torch.Tensor, weights: ExpertWeights) -> str:
    """v3 where it applies (CUDA, INT4, bf16 scales) and has not failed, else v2."""
    v3_ok = x.is_cuda and weights.is_int4 and weights.w13_scale.dtype == torch.bfloat16
    variant = "v3" if v3_ok and V3_ERROR is None else "v2"
    if variant not in _LOGGED:
        _LOGGED.add(variant)
        why = (
            "INT4 experts, bf16 scales, CUDA"
            if variant == "v3"
            else (f"v3 failed: {V3_ERROR}" if V3_ERROR else "not INT4 with bf16 scales on CUDA")
        )
        log.info("MoE kernel: %s (%s)", variant, why)
    return variant


_LOGGED: set[str] = set()


def fused_moe(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float32, routed_scaling_factor already applied
    weights: ExpertWeights,
    *,
    config: dict | None = None,
    invariant: bool = True,
) -> torch.Tensor:  # [T, H] in x.dtype
    """`moe_ref`'s contract on CUDA (or the Triton interpreter); no host sync and graph capturable
    from the second call on (v3's first call per weights makes their stream and syncs).
    Token t's output row is bitwise the same whatever else is in the call (both variants, so
    `invariant` changes nothing)."""
    global V3_ERROR
    cfg = dict(config or {})
    variant = cfg.pop("variant", None) or backend.current().moe_variant
    explicit = variant is not None
    in_place = weights.is_int4 and in_place_started(weights.w13_packed)
    variant = variant or ("v3" if in_place and x.is_cuda else default_variant(x, weights))
    if in_place and variant != "v3":
        raise RuntimeError(
            f"MoE {variant}: these experts were repacked in place for v3 (the model's own weights "
            "on CUDA); only v3 and the torch reference read them. Set DDSERVE_MOE_VARIANT before "
            "the engine starts to keep the original layout."
        )
    if explicit or variant != "v3" or in_place:
        return VARIANTS[variant](x, topk_ids, topk_weights, weights, config=cfg)
    try:
        return fused_moe_v3(x, topk_ids, topk_weights, weights, config=cfg)
    except Exception as exc:  # noqa: BLE001 - e.g. Gluon unsupported by this GPU / triton build
        if not may_fall_back(exc) or in_place_started(weights.w13_packed):
            raise  # (v2 cannot read experts that the failed call already rewrote in place)
        if cfg:
            raise  # tile overrides are v3's (tests, benchmarks): v2 would refuse them instead
        V3_ERROR = f"{type(exc).__name__}: {str(exc)[:500]}"
        log.warning("MoE v3 failed, using v2 from now on: %s", V3_ERROR)
        return fused_moe_v2(x, topk_ids, topk_weights, weights)


def fused_moe_pairs(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights
) -> torch.Tensor | None:
    """v3 without its combine launch ([T * k, H] weighted pair outputs, `fused_moe_v3(...,
    combine=False)`) when these experts are the model's own, already repacked in place for v3
    (from the first forward on), no other variant is asked for and T <= PAIRS_MAX_TOKENS; else
    None (the caller runs v3 with its combine)."""
    if backend.current().moe_variant not in (None, "v3") or not weights.is_int4:
        return None
    if x.shape[0] > PAIRS_MAX_TOKENS:
        return None
    if not (x.is_cuda and in_place_started(weights.w13_packed)):
        return None
    return fused_moe_v3(x, topk_ids, topk_weights, weights, combine=False)
