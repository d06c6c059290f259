"""Engine settings (one frozen dataclass, identical on every tensor-parallel rank) and the
batching rules every configuration layer checks (`check_batching`).

The layers hold one another: `ServeConfig` (serve/deployment.py, the HTTP and deployment edge)
produces a `RouterConfig` (actors/router.py), which holds the `ShardSpec` every rank builds its
runner from (actors/shard.py), which holds this `EngineConfig`. The offline `LLM` builds an
`EngineConfig` from its arguments. Each setting is declared once, with its default, in the layer
that uses it; a layer with a different default names it and says why (`ServeConfig.max_streams`,
`llm.OFFLINE_NUM_SLOTS`).

Importing this module does not import torch, so the command line can read the defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "bfloat16", "float16", "float32")


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
    import torch

    return "float32" if torch.device(device).type == "cpu" else "bfloat16"


def check_batching(
    *,
    buckets: Sequence[int],
    budget: int,
    num_slots: int,
    max_streams: int | None = None,
    budgets: Sequence[int] | None = None,
    budget_candidates: Sequence[int] | None = None,
) -> None:
    """Raises ValueError (naming the rule) unless the batching settings fit together.

    `buckets`: increasing positive batch sizes (a batch of n streams pads to the smallest bucket
    >= n). `budget`: the engine's tree budget, which every stream's KV reservation includes, so
    `num_slots` must leave room beside it. `max_streams`, when the caller pads every batch
    (the router), must have a bucket: at most the largest one. `budgets` (one per bucket) and
    `budget_candidates` (chosen online), at most one of them, lie in [1, budget]."""
    b = tuple(buckets)
    if not b or b[0] < 1 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
        raise ValueError(f"buckets must be increasing positive batch sizes, got {list(b)}")
    if budget + 1 >= num_slots:
        raise ValueError(f"num_slots {num_slots} leaves no room beside the tree budget {budget}")
    if max_streams is not None and not 1 <= max_streams <= b[-1]:
        raise ValueError(f"max_streams {max_streams} must be in [1, {b[-1]}] (the largest bucket)")
    if budgets is not None and budget_candidates is not None:
        raise ValueError("give fixed per-bucket budgets or budget candidates, not both")
    if budgets is not None and len(budgets) != len(b):
        raise ValueError(f"budgets needs one budget per bucket, got {list(budgets)} for {list(b)}")
    if budgets is not None and not 1 <= min(budgets) <= max(budgets) <= budget:
        raise ValueError(f"per-bucket budgets must lie in [1, {budget}] (the engine budget, "
                         f"which the KV reservation includes), got {list(budgets)}")  # fmt: skip
    cands = budget_candidates
    if cands is not None and not (cands and 1 <= min(cands) <= max(cands) <= budget):
        raise ValueError(f"budget candidates must lie in [1, {budget}], got {list(cands)}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """num_slots: KV pool size in tokens. budget: DDTree nodes per stream per step (the root is
    extra), the most any step may use. prefill_chunk: most prompt tokens per prefill forward.
    seed: base of the per-stream seeds of requests without one (the same on every rank)."""

    num_slots: int = 32768
    budget: int = 16
    prefill_chunk: int = 512
    dtype: str = "auto"
    seed: int = 0
    # concurrent streams: sizes per-stream device state (slot table, drafter context)
    max_streams: int = 16
    # replay decode/verify forwards from CUDA graphs (CUDA, 16-bit dtype); see engine/graphs.py
    cuda_graphs: bool = False
    # batch sizes a step pads to: CUDA graphs are captured for these, the router buckets by them
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
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
        check_batching(buckets=self.graph_buckets, budget=self.budget, num_slots=self.num_slots)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' has no torch dtype until resolved (resolve_dtype)")
        import torch

        return getattr(torch, self.dtype)
