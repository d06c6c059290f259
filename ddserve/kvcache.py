"""Slot-based KV cache (page size 1): a free-list allocator and the per-layer MLA latent pool.

Streams own ordered lists of slot ids (the engine keeps them). Tree nodes get fresh slots for the
verify pass; after acceptance a stream keeps the accepted nodes' slots and frees the rest, so
compaction is bookkeeping, never copying.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class OutOfSlots(RuntimeError):
    """The pool cannot hold the request; nothing was allocated. The caller should queue it."""


class SlotAllocator:
    """Free list over slot ids 0..num_slots-1. Double frees and foreign ids are errors."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        # Pop from the end; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used = bytearray(num_slots)  # 1 = allocated

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n distinct free slots; raises OutOfSlots (allocating nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > len(self._free):
            raise OutOfSlots(f"need {n} KV slots, {len(self._free)} of {self.num_slots} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        for s in out:
            self._used[s] = 1
        out.reverse()
        return out

    def free(self, slots: Iterable[int]) -> None:
        """Return slots to the pool; validates all of them before changing anything."""
        slots = list(slots)
        if len(set(slots)) != len(slots):
            raise ValueError("duplicate slots in free()")
        for s in slots:
            if not 0 <= s < self.num_slots or not self._used[s]:
                raise ValueError(f"slot {s} is not allocated")
        for s in slots:
            self._used[s] = 0
        self._free.extend(reversed(slots))


class LatentCache:
    """MLA latent pool: `pool[layer, slot] = [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)]`.

    Replicated on every tensor-parallel rank. Slot ids index the second dimension.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        latent_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        self.pool = torch.zeros(num_layers, num_slots, latent_dim, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return int(self.pool.shape[1])

    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
