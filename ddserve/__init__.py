"""ddserve: DeepSeek-V3-architecture MoE serving with DDTree speculative decoding."""

from __future__ import annotations

from ddserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `LLM` pulls in the model and engine; import it only when asked for.
    if name == "LLM":
        from ddserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'ddserve' has no attribute {name!r}")
