"""Compressed-tensors INT4 (`pack-quantized`) support for the model: TP and checkpoint helpers.

Only the routed experts are INT4 (Kimi K2 Thinking / K2.6 layout). The packing arithmetic itself
lives in `ddserve.kernels.moe_ref` (`pack_int4`, `unpack_int4`, `quantize_int4`,
`dequantize_int4`); this module re-exports it so model code has one place to import from. The
`quantization_config` a checkpoint may carry is parsed by `ddserve.quant_config`.
"""

from __future__ import annotations

import torch

from ddserve.kernels.moe_ref import (
    GROUP,
    PACK,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)

__all__ = [
    "GROUP",
    "PACK",
    "check_int4_split",
    "checkpoint_int4",
    "dequantize_int4",
    "pack_int4",
    "quantize_int4",
    "unpack_int4",
]


def check_int4_split(name: str, in_features: int, world_size: int) -> None:
    """INT4 tensors split along their input dim must keep whole scale groups on every rank."""
    if in_features % (world_size * GROUP):
        raise ValueError(
            f"{name}: input dim {in_features} cannot be split across {world_size} ranks in whole "
            f"INT4 groups of {GROUP} (needs a multiple of {world_size * GROUP})"
        )


def checkpoint_int4(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A `<stem>.weight` matrix [out, in] as the compressed-tensors tensors a checkpoint ships:
    `weight_packed` [out, in / 8] int32, `weight_scale` [out, in / 32] bf16, `weight_shape`."""
    stem = name.removesuffix(".weight")
    packed, scale = quantize_int4(w.float())
    return {
        f"{stem}.weight_packed": packed,
        f"{stem}.weight_scale": scale.to(torch.bfloat16),
        f"{stem}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
    }
