"""The one place that chooses kernel backends. The choice is logged once per process."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


HALF = (torch.bfloat16, torch.float16)


def _half_only(fast: Callable, ref: Callable) -> Callable:
    """GPU kernels take 16-bit activations; float32 runs (exactness checks) use the reference."""

    @functools.wraps(fast)
    def call(x: torch.Tensor, *args, **kwargs):
        return (fast if x.dtype in HALF else ref)(x, *args, **kwargs)

    return call


@functools.cache
def tree_attention(device_type: str) -> Callable:
    """`tree_mla_attention_ref`'s signature; Triton on CUDA when it imports, else the reference."""
    from ddserve.kernels.tree_attn import tree_mla_attention_ref

    impl, name = tree_mla_attention_ref, "torch reference"
    if device_type == "cuda":
        try:
            from ddserve.kernels.tree_attn_triton import tree_mla_attention

            impl = _half_only(tree_mla_attention, tree_mla_attention_ref)
            name = "triton (bf16/fp16; float32 uses the reference)"
        except ImportError as e:  # pragma: no cover - depends on the machine
            log.warning("triton tree attention unavailable (%s); using the torch reference", e)
    log.info("tree attention backend on %s: %s", device_type, name)
    return impl


@functools.cache
def moe(device_type: str) -> Callable:
    """`ddserve.kernels.moe_ref.moe_ref`'s signature: sgl-kernel Marlin, then Triton, then torch."""
    from ddserve.kernels.moe_ref import moe_ref

    impl, name = moe_ref, "torch reference"
    if device_type == "cuda":
        for module, fn, label in (
            ("ddserve.kernels.moe_marlin", "fused_moe_marlin", "sgl-kernel marlin"),
            ("ddserve.kernels.moe_triton", "fused_moe", "triton"),
        ):
            try:
                impl = _half_only(getattr(__import__(module, fromlist=[fn]), fn), moe_ref)
                name = f"{label} (bf16/fp16; float32 uses the reference)"
                break
            except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the machine
                log.info("moe backend %s unavailable: %s", label, e)
    log.info("moe backend on %s: %s", device_type, name)
    return impl


def device_type(t: torch.Tensor | torch.device) -> str:
    return (t.device if isinstance(t, torch.Tensor) else t).type
