"""Building blocks whose forward carries the tensor-parallel collectives.

Every weight is created empty in its per-rank shape; `loader.py` fills it from the checkpoint
(the split dimension of each tensor is in the loader's table). With `LocalComm` these are plain
single-device layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddserve.distributed import Communicator
from ddserve.kernels import backend


def shard_size(n: int, world_size: int, what: str) -> int:
    """n / world_size, or a clear error when the split is not even."""
    if n % world_size:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {world_size}")
    return n // world_size


def reduce_partials(comm: Communicator, y: torch.Tensor) -> torch.Tensor:
    """Sum the ranks' partial outputs; in batch-invariant mode in rank order (bitwise the same
    for any number of rows, also at tp > 2)."""
    return comm.all_reduce_ordered(y) if backend.batch_invariant() else comm.all_reduce(y)


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """x / rms(x) in fp32, cast back, then scaled (HF's order of operations; `backend.rms_norm`
    runs it batch-invariantly when that mode is on)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor):
        """(s, self(s)) for s = x + residual, in one launch where `backend.add_rms_norm` fuses."""
        return backend.add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Module):
    """Replicated y = x W^T (same full weight on every rank)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = empty_param((out_features, in_features), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backend.linear(x, self.weight)


class ColumnParallelLinear(Linear):
    """Output features split across ranks; each rank returns its slice (no collective)."""

    def __init__(self, in_features: int, out_features: int, comm: Communicator, dtype, device):
        out_local = shard_size(out_features, comm.world_size, "output features")
        super().__init__(in_features, out_local, dtype, device)


class RowParallelLinear(Linear):
    """Input features split across ranks; partial products are summed by one all-reduce.

    `reduce=False` leaves the partial sum to the caller (the MoE adds shared and routed partials
    before a single all-reduce).
    """

    def __init__(self, in_features, out_features, comm: Communicator, dtype, device, reduce=True):
        in_local = shard_size(in_features, comm.world_size, "input features")
        super().__init__(in_local, out_features, dtype, device)
        self.comm, self.reduce = comm, reduce

    def forward(
        self, x: torch.Tensor, add: torch.Tensor | None = None, *, add_topk: int = 0
    ) -> torch.Tensor:
        """This rank's x @ W^T, all-reduced when `reduce`; without it, plus `add` (a partial
        of the same sum, e.g. the MoE's routed experts, as `backend.linear` takes it with
        `add_topk`) in the matmul's launch."""
        if add is not None and self.reduce:
            raise ValueError("add is a partial of the un-reduced sum: only with reduce=False")
        y = backend.linear(x, self.weight, add, add_topk=add_topk)
        return reduce_partials(self.comm, y) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank + 1) * V/tp) of the table on each rank; all-reduced lookup."""

    def __init__(self, vocab: int, dim: int, comm: Communicator, dtype, device) -> None:
        super().__init__()
        self.comm = comm
        self.num_local = shard_size(vocab, comm.world_size, "vocab_size")
        self.start = comm.rank * self.num_local
        self.weight = empty_param((self.num_local, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, D]
        if self.comm.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start  # [N]
        outside = (local < 0) | (local >= self.num_local)
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)  # [N, D]
        emb = emb.masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(emb)


class ParallelLMHead(nn.Module):
    """Vocab-split output projection; logits gathered to the full vocabulary in float32."""

    def __init__(self, vocab: int, dim: int, comm: Communicator, dtype, device) -> None:
        super().__init__()
        self.comm = comm
        num_local = shard_size(vocab, comm.world_size, "vocab_size")
        self.weight = empty_param((num_local, dim), dtype, device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] float32
        logits = backend.linear(h, self.weight).float()  # [N, V / tp]
        return self.comm.all_gather(logits, dim=-1)
