"""Per-stream ring of the drafter's per-layer context keys/values.

Each stream owns one row of a preallocated pool `k, v [L, S, C, KVH, Dh]`, S = max_streams + 1:
the last row (`pad_row`) belongs to no stream; a CUDA graph's padding blocks draft from it and
commit nothing into it, so they never touch a stream's row. The context token at absolute
position p lives at ring index p % C, so a row holds the last C committed tokens and writing never
moves data. Keys are stored after k_norm and RoPE (at the token's own position), so they are
written once and read every step. The block's own keys/values are never stored.
Which ring entries are live, and their positions, follow from the stream's length alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ddserve.kvcache import Staging


class RingRows(NamedTuple):
    """One layer's ring (k or v) [S, C, KVH, Dh], the rows [B] of the streams reading it and
    every row's length [S]: a context handed to the attention ungathered (`kernels.drafter_attn`
    reads it in place)."""

    ring: Tensor
    rows: Tensor
    lengths: Tensor


class ContextCache:
    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        max_streams: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        shape = (num_layers, max_streams + 1, capacity, num_kv_heads, head_dim)
        self.capacity, self.pad_row = capacity, max_streams
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, C, KVH, Dh]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, C, KVH, Dh]
        self.lengths = torch.zeros(shape[1], dtype=torch.long, device=device)  # [S]
        self._rows: dict[Hashable, int] = {}
        self._host_len: dict[Hashable, int] = {}
        self._free = list(range(max_streams - 1, -1, -1))
        self._staging = Staging(self.k.device)

    def add(self, sid: Hashable) -> None:
        if sid in self._rows:
            raise KeyError(f"drafter stream {sid!r} already exists")
        if not self._free:
            raise RuntimeError(f"drafter context cache is full ({len(self._rows)} streams)")
        row = self._free.pop()
        self._rows[sid], self._host_len[sid] = row, 0
        self.lengths[row] = 0

    def remove(self, sid: Hashable) -> None:
        self._free.append(self._rows.pop(sid))
        del self._host_len[sid]

    def __contains__(self, sid: Hashable) -> bool:
        return sid in self._rows

    @property
    def num_streams(self) -> int:
        return len(self._rows)

    def length(self, sid: Hashable) -> int:
        """Committed context tokens of the stream (all of them, not only those in the ring)."""
        return self._host_len[sid]

    def set_length(self, sid: Hashable, n: int) -> None:
        """The host's copy of the stream's length after device code (`DFlashDrafter.commit_rows`)
        wrote its entries and its device length; it never shrinks."""
        if n < self._host_len[sid]:
            raise ValueError(f"context length {n} below {self._host_len[sid]}")
        self._host_len[sid] = n

    def append(self, sid: Hashable, k: Tensor, v: Tensor, start: int) -> None:
        """Store k, v [L, T, KVH, Dh] for positions start..start+T-1; the length becomes start+T.

        `start` may exceed the current length only by tokens the caller dropped because they would
        be overwritten anyway (a chunk longer than the ring)."""
        t, n = k.shape[1], self._host_len[sid]
        if start < n or (start > n and t != self.capacity):
            raise ValueError(f"context append at {start} (len {t}) does not follow length {n}")
        if t > self.capacity:
            raise ValueError(
                f"context append of {t} rows exceeds the ring capacity {self.capacity}"
            )
        row = self._rows[sid]
        idx = torch.arange(start, start + t, device=k.device) % self.capacity  # [T]
        self.k[:, row, idx] = k.to(self.k.dtype)
        self.v[:, row, idx] = v.to(self.v.dtype)
        self._host_len[sid] = start + t
        self.lengths[row] = start + t

    def append_many(self, items: list[tuple[Hashable, int, int]], k: Tensor, v: Tensor) -> None:
        """`append` for several streams with one write: items (sid, start, T) in order; k, v
        [L, sum T, KVH, Dh] their rows laid end to end. `append`'s rules hold per stream."""
        rows, idx, lens = [], [], []
        for sid, start, t in items:
            n = self._host_len[sid]
            if start < n or (start > n and t != self.capacity) or t > self.capacity:
                raise ValueError(f"context append at {start} (len {t}) does not follow length {n}")
            rows += [self._rows[sid]] * t
            idx += [(start + i) % self.capacity for i in range(t)]
            lens.append(start + t)
        n, b = len(rows), len(items)
        sid_rows = [self._rows[sid] for sid, _, _ in items]
        flat = self._staging.put(rows + idx + sid_rows + lens)  # one copy, no stream sync
        r, i = flat[:n], flat[n : 2 * n]  # [sum T] each
        self.k[:, r, i] = k.to(self.k.dtype)
        self.v[:, r, i] = v.to(self.v.dtype)
        self.lengths[flat[2 * n : 2 * n + b]] = flat[2 * n + b :]
        for (sid, _, _), n in zip(items, lens, strict=True):
            self._host_len[sid] = n

    def row_ids(self, sids: Sequence[Hashable]) -> list[int]:
        """Pool rows of `sids`, in order."""
        return [self._rows[s] for s in sids]

    def rows(self, sids: Sequence[Hashable]) -> Tensor:
        """Pool rows of `sids`, in order: [B] long on the cache's device."""
        return torch.tensor(self.row_ids(sids), dtype=torch.long, device=self.k.device)

    def layer(
        self, layer: int, rows: Tensor, in_place: bool = False
    ) -> tuple[Tensor, Tensor] | tuple[RingRows, RingRows]:
        """Context k, v of one layer for the given rows: [B, C, KVH, Dh] each, gathered; or with
        `in_place` the layer's rings and the rows (`RingRows` each), nothing copied."""
        if in_place:
            return (RingRows(self.k[layer], rows, self.lengths),
                    RingRows(self.v[layer], rows, self.lengths))  # fmt: skip
        return self.k[layer].index_select(0, rows), self.v[layer].index_select(0, rows)

    def positions(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Absolute position held at each ring index [B, C], and whether that entry is live [B, C].

        Index i holds the latest position p < n with p % C == i: p = n-1 - ((n-1-i) mod C)."""
        last = self.lengths.index_select(0, rows)[:, None] - 1  # [B, 1]
        i = torch.arange(self.capacity, device=rows.device)[None, :]  # [1, C]
        pos = last - torch.remainder(last - i, self.capacity)  # [B, C]
        return pos, pos >= 0
