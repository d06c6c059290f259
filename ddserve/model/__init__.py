"""The DeepSeek-V3 / Kimi K2 target model: MLA, MoE, YaRN RoPE, INT4 experts, TP layers.

Imports are lazy: `ddserve.model.quant` and `ddserve.model.rope` (which the training modules use)
load without the model's other modules.
"""

from __future__ import annotations

__all__ = ["DeepseekV3ForCausalLM", "ModelOutput", "load_checkpoint", "load_model"]


def __getattr__(name: str):
    if name in ("DeepseekV3ForCausalLM", "ModelOutput"):
        from ddserve.model import deepseek

        return getattr(deepseek, name)
    if name in ("load_checkpoint", "load_model"):
        from ddserve.model import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'ddserve.model' has no attribute {name!r}")
