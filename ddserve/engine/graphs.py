"""CUDA-graph replay of the decode/verify target forward (`EngineConfig.cuda_graphs`).

The eager engine is launch-bound (BENCHMARKS.md: a K2.6 rank step is 30-120x its bandwidth
floor, a graph-replayed forward 11-17x). One graph is captured per shape key (blocks B, rows per
block Q, prefix capacity P): B is the batch padded to a bucket, Q = budget + 1 (1 for AR), P a
power of two >= the longest prefix. Inputs are copied into static buffers before `replay()`;
the outputs are static tensors, valid until the next replay. Padding blocks write their latents
to scratch slots reserved at start-up and see only themselves. Only the target forward is
captured; draft, tree build, sampling and acceptance stay eager (8-13% of a K2.6 rank DDTree
step, BENCHMARKS.md).

Status: `EngineConfig.cuda_graphs` defaults to False (the engine alone runs eagerly); the
serving config (`ServeConfig`) turns it on by default on CUDA with 16-bit dtypes, so
`ddserve serve` replays graphs there (validated at tp = 2 over NCCL on two H200s). On an H200
`tests/gpu/test_engine_gpu.py` passed (graph replay equals the eager forward; DDTree with graphs
frees every slot) and the K2.6 engine benchmark ran with graphs (BENCHMARKS.md). Graphs must be
freed before their NCCL communicator is destroyed (NCCL >= 2.26 waits for them): call `close()`
first.
"""

from __future__ import annotations

import logging

import torch

from ddserve.kernels.tree_attn import TreeAttnMeta

log = logging.getLogger(__name__)


def _pow2_at_least(n: int, floor: int = 256) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


class _Graph:
    """Static buffers and one captured forward for a (B, Q, P) key."""

    def __init__(self, run_model, b: int, q: int, p: int, scratch: list[int], device) -> None:
        t = b * q
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.ids, self.pos = z(t), z(t)
        self.meta = TreeAttnMeta(
            q_starts=torch.arange(b, device=device) * q,
            q_lens=torch.full((b,), q, dtype=torch.long, device=device),
            prefix_slots=z(b, p),
            prefix_lens=z(b),
            block_slots=torch.tensor(scratch[:t], dtype=torch.long, device=device),
            block_mask=torch.eye(q, dtype=torch.bool, device=device).repeat(b, 1, 1),
        )
        self.q = q
        self._scratch = self.meta.block_slots.clone()  # [t] padding rows write here
        self._eye = self.meta.block_mask.clone()  # [b, q, q] padding blocks see themselves
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: lazy inits and autotuning happen outside capture
            run_model(self.ids, self.pos, self.meta)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run_model(self.ids, self.pos, self.meta)

    def replay(self, ids, pos, prefix, prefix_lens, block_slots, mask):
        """Actual inputs for the first n = len(prefix_lens) blocks; the rest reset to padding."""
        n, m = prefix_lens.shape[0], self.meta
        rows = n * self.q
        self.ids[:rows].copy_(ids)
        self.pos[:rows].copy_(pos)
        self.ids[rows:].zero_()
        self.pos[rows:].zero_()
        m.prefix_slots[:n, : prefix.shape[1]].copy_(prefix)
        m.prefix_lens[:n].copy_(prefix_lens)
        m.prefix_lens[n:].zero_()
        m.block_slots[:rows].copy_(block_slots)
        m.block_slots[rows:].copy_(self._scratch[rows:])
        m.block_mask[:n].copy_(mask)
        m.block_mask[n:].copy_(self._eye[n:])
        self.graph.replay()
        return self.out


class GraphedForward:
    """Captures lazily, per shape key, and replays; `run` returns None when the shape is not
    graphable (larger than the largest bucket), so the caller runs eagerly."""

    def __init__(self, run_model, buckets: tuple[int, ...], scratch: list[int], device) -> None:
        self._run_model, self.buckets = run_model, tuple(sorted(buckets))
        self._scratch, self._device = scratch, torch.device(device)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}

    def run(self, ids, pos, prefix, prefix_lens, block_slots, mask, q: int):
        n = prefix_lens.shape[0]
        b = next((x for x in self.buckets if x >= n), None)
        if b is None or b * q > len(self._scratch):
            return None
        key = (b, q, _pow2_at_least(prefix.shape[1]))
        g = self._graphs.get(key)
        if g is None:
            log.info("capturing the target forward for blocks=%d rows=%d prefix<=%d", *key)
            g = self._graphs[key] = _Graph(self._run_model, *key, self._scratch, self._device)
        out = g.replay(ids, pos, prefix, prefix_lens, block_slots, mask)
        hidden = None if out.hidden is None else out.hidden[: n * q].clone()  # small; kept later
        return type(out)(logits=out.logits[: n * q], hidden=hidden)  # logits: until next replay

    def close(self) -> None:
        self._graphs.clear()
        torch.cuda.synchronize(self._device)
