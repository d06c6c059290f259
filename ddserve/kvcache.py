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


class Staging:
    """Host numbers (`dtype`: int64 by default) to the device in one copy. On CUDA through a
    reused pinned buffer and a non-blocking copy, so the host does not wait for the stream to
    reach the copy (a copy from pageable memory, e.g. `torch.tensor(list, device=cuda)`, makes
    torch synchronize the stream); the buffer is rewritten only after its previous copy has
    run. The tensor a call returns is valid until the next call's copy, which the stream orders
    after every use queued before it."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long) -> None:
        self.device, self.dtype = device, dtype
        self.host: torch.Tensor | None = None  # [N] pinned
        self.dev: torch.Tensor | None = None  # [N] on the device
        self.copied: torch.cuda.Event | None = None

    def put(self, values: list) -> torch.Tensor:
        """values -> a [len(values)] tensor of `dtype` on the device (queued on the current
        stream; the values rounded to `dtype` as torch.tensor would)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=self.dtype).to(self.device)
        n = len(values)
        if self.copied is not None:
            self.copied.synchronize()  # the last copy out of `host` has run
        if self.host is None or self.host.numel() < n:
            size = max(n, 1024, 0 if self.host is None else 2 * self.host.numel())
            self.host = torch.empty(size, dtype=self.dtype).pin_memory()
            self.dev = torch.empty(size, dtype=self.dtype, device=self.device)
            self.copied = torch.cuda.Event()
        self.host.numpy()[:n] = values
        dst = self.dev[:n]
        dst.copy_(self.host[:n], non_blocking=True)
        self.copied.record(torch.cuda.current_stream(self.device))
        return dst


class SlotTable:
    """Device mirror of every stream's ordered slot list, updated by appends only.

    A batch's prefix-slot matrix is then a gather on the device (`prefix`) instead of a host copy
    of every stream's whole prefix each step, so per-step host work grows with the tokens a step
    commits, not with context length. Rows are reused; the table grows if more streams than
    `rows` are live at once.
    """

    def __init__(self, max_len: int, device: torch.device | str, rows: int = 16) -> None:
        self.max_len, self.device = max_len, torch.device(device)
        self.table = torch.zeros(rows, max_len, dtype=torch.long, device=self.device)  # [R, L]
        self._row: dict = {}
        self._free = list(range(rows - 1, -1, -1))
        self._staging = Staging(self.device)

    def add(self, sid) -> None:
        if not self._free:
            grown = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        self._row[sid] = self._free.pop()

    def remove(self, sid) -> None:
        row = self._row.pop(sid, None)
        if row is not None:
            self._free.append(row)

    def append(self, items: list[tuple[object, int, list[int]]]) -> None:
        """items: (sid, position of the first new slot, new slots) -> one indexed write, queued on
        the current stream (on CUDA the host does not wait for it). A write past the end of a row
        raises IndexError before anything is written."""
        rows, cols, vals, width = [], [], [], self.max_len
        for sid, start, slots in items:
            if start + len(slots) > width:
                raise IndexError(f"stream {sid!r}: {start + len(slots)} slots, rows hold {width}")
            rows += [self._row[sid]] * len(slots)
            cols += range(start, start + len(slots))
            vals += slots
        if vals:
            n = len(vals)
            idx = self._staging.put(rows + cols + vals)  # [3 n], one copy
            self.table[idx[:n], idx[n : 2 * n]] = idx[2 * n :]

    def rows(self, sids: list) -> list[int]:
        """The table rows of these streams (host ints)."""
        return [self._row[s] for s in sids]

    def prefix(self, sids: list, lens: list[int]) -> torch.Tensor:
        """[B, max(max(lens), 1)] slot ids of each stream's first lens[b] tokens (rest: padding)."""
        rows = torch.tensor(self.rows(sids), dtype=torch.long).to(self.device)
        return self.table[rows, : max(1, max(lens, default=0))]
