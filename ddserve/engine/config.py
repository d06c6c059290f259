"""Engine settings (one frozen dataclass, identical on every tensor-parallel rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = ("auto", *_DTYPES)


def resolve_dtype(dtype: str, device: str | torch.device) -> str:
    """The compute dtype on `device`: "auto" is float32 on the CPU and bfloat16 elsewhere; any
    other name as given. The one rule behind `LLM()`, `ddserve generate` and serving.

    float32 on the CPU keeps DDTree == autoregressive on any x86 CPU: torch's CPU matmuls are not
    batch-invariant (which kernel and reduction order a row gets depends on the row count M and
    on the CPU's ISA), so a verify row and its decode twin differ in the last fp32 bits. In
    float32 that stays ~1e-7 relative, far below a greedy near-tie; in bfloat16 the ops that
    accumulate in fp32 inside (the MoE and attention references) round their output to 8 mantissa
    bits, so a last-bit difference becomes a whole bf16 ulp now and then, and a greedy token flips.
    GPUs get batch-invariant kernels (`EngineConfig.batch_invariant`) and run bfloat16."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "float32" if torch.device(device).type == "cpu" else "bfloat16"


@dataclass(frozen=True)
class EngineConfig:
    """num_slots: KV pool size in tokens. budget: DDTree nodes per stream per step (the root is
    extra). prefill_chunk: most prompt tokens per prefill forward. seed: base of the per-stream
    seeds of requests without one (the same on every rank)."""

    num_slots: int = 8192
    budget: int = 16
    prefill_chunk: int = 512
    dtype: str = "auto"
    seed: int = 0
    max_streams: int = 16  # concurrent streams: sizes per-stream device state (drafter context)
    # replay decode/verify forwards from CUDA graphs (CUDA, 16-bit dtype); see engine/graphs.py
    cuda_graphs: bool = False
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 12, 16)  # batch sizes graphs are captured for
    # batch-invariant GPU kernels: a token's logits do not depend on what else is in the forward,
    # so DDTree == autoregressive bit for bit in 16-bit dtypes (see kernels/backend.py)
    batch_invariant: bool = True
    # torch intra-op threads of a CPU engine (None: `engine.threads.cpu_threads` decides)
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if min(self.budget, self.prefill_chunk, self.num_slots, self.max_streams) < 1:
            raise ValueError("budget, prefill_chunk, num_slots and max_streams must be >= 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' has no torch dtype until resolved (resolve_dtype)")
        return _DTYPES[self.dtype]
