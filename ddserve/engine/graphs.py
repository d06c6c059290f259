"""CUDA-graph replay of the decode forward and the DDTree verify step (`EngineConfig.cuda_graphs`).

The eager engine is launch-bound (a K2.6 rank forward is ~3,600 kernels). Two kinds of graph:
- the target forward alone (`_Graph`, `GraphedForward.run`: AR steps), one per (blocks B, rows
  per block Q, prefix capacity P);
- the whole verify step between the draft and the host (`_VerifyGraph`, `run_verify`:
  `ddtree.verify_step`'s tree build, verify inputs, target forward, token choice and acceptance),
  one per (B, budget, P, drafter), with greedy token choice (a batch with sampled streams
  redoes the choice and the acceptance from the graph's logits, eagerly: `ddtree.reselect`).
  A drafter whose draft is pure tensor code
  (`Drafter.device_rows`, DFlash) is captured in the same graph; others run before it, eagerly,
  and their logits are copied in. The host then reads the packed acceptance with the step's one
  device-to-host copy.
B is the batch padded to a bucket and P a power of two >= the longest prefix. Inputs are copied
into static buffers before `replay()`; outputs are static tensors, valid until the next replay.
Padding blocks write their latents to scratch slots reserved at start-up, have no prefix, and
see only their own block (zero draft logits give them a tree of their own).

`EngineConfig.cuda_graphs` defaults to False (the engine alone runs eagerly); the serving config
(`ServeConfig`) turns it on by default on CUDA with 16-bit dtypes. tests/gpu/test_engine_gpu.py
checks graph replay against the eager path. Graphs must be freed before their NCCL communicator
is destroyed (NCCL >= 2.26 waits for them): call `close()` first.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ddserve.ddtree import VerifyResult, verify_step
from ddserve.kernels.tree_attn import TreeAttnMeta

log = logging.getLogger(__name__)

TREE_TENSORS = ("tokens", "parents", "depths", "visible", "scores")  # DraftTree's [B, ...] fields


def _pow2_at_least(n: int, floor: int = 256) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def _capture(fn, device) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn() run once on a side stream (lazy inits and autotuning happen outside the capture),
    then captured; returns the graph and fn's output (static tensors, rewritten by replays)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class _Graph:
    """Static buffers and one captured forward for a (B, Q, P) key."""

    def __init__(self, run_model, b: int, q: int, p: int, scratch: list[int], device) -> None:
        self.ids = torch.zeros(b * q, dtype=torch.long, device=device)
        self.pos = torch.zeros_like(self.ids)
        self.meta, self._scratch, self._eye = _static_meta(b, q, p, scratch, device)
        self.q = q
        self.graph, self.out = _capture(lambda: run_model(self.ids, self.pos, self.meta), device)

    def replay(self, ids, pos, prefix, prefix_lens, block_slots, mask):
        """Actual inputs for the first n = len(prefix_lens) blocks; the rest reset to padding."""
        n, m = prefix_lens.shape[0], self.meta
        rows = n * self.q
        self.ids[:rows].copy_(ids)
        self.pos[:rows].copy_(pos)
        self.ids[rows:].zero_()
        self.pos[rows:].zero_()
        _fill_meta(m, n, rows, prefix, prefix_lens, block_slots, self._scratch)
        m.block_mask[:n].copy_(mask)
        m.block_mask[n:].copy_(self._eye[n:])
        self.graph.replay()
        return self.out


class _VerifyGraph:
    """One captured `verify_step` (tree build, verify inputs, target forward, greedy token choice,
    acceptance), preceded by the draft itself when the drafter can be captured (`drafter`, its
    `draft_rows` from static state rows), else fed the drafter's logits [B, D, V] (`draft_shape`
    (D, V)). Padding blocks draft from row 0 or get zero logits, have no prefix, write to scratch
    slots and see only their own block."""

    def __init__(self, run_model, b, n, p, drafter, draft_shape, scratch, device) -> None:
        q = n + 1
        self.meta, self._scratch, _ = _static_meta(b, q, p, scratch, device)
        self.q = q
        self.bonus = torch.zeros(b, dtype=torch.long, device=device)
        self.rows = torch.zeros(b, dtype=torch.long, device=device)  # drafter state rows
        self.draft = None
        if drafter is None:
            self.draft = torch.zeros(b, *draft_shape, dtype=torch.float32, device=device)

        def forward(ids, pos, visible):
            self.meta.block_mask.copy_(visible)
            return run_model(ids, pos, self.meta)

        def step():
            draft = self.draft if drafter is None else drafter.draft_rows(self.rows, self.bonus)
            argmax = lambda logits: logits.argmax(dim=-1)  # noqa: E731
            return verify_step(forward, argmax, draft, self.bonus, self.meta.prefix_lens, n)

        self.graph, self.out = _capture(step, device)

    def replay(self, draft, rows, bonus, prefix, prefix_lens, block_slots) -> VerifyResult:
        n = prefix_lens.shape[0]
        if self.draft is not None:
            self.draft[:n].copy_(draft)
            self.draft[n:].zero_()
        else:
            self.rows[:n].copy_(rows)
            self.rows[n:].zero_()
        self.bonus[:n].copy_(bonus)
        self.bonus[n:].zero_()
        _fill_meta(self.meta, n, n * self.q, prefix, prefix_lens, block_slots, self._scratch)
        self.graph.replay()
        return self.out


def _static_meta(b: int, q: int, p: int, scratch: list[int], device):
    """Static attention metadata for B blocks of Q rows and P prefix slots (padding: scratch
    slots, no prefix, each block seeing only itself), its scratch slots and identity masks."""
    t = b * q
    meta = TreeAttnMeta(
        q_starts=torch.arange(b, device=device) * q,
        q_lens=torch.full((b,), q, dtype=torch.long, device=device),
        prefix_slots=torch.zeros(b, p, dtype=torch.long, device=device),
        prefix_lens=torch.zeros(b, dtype=torch.long, device=device),
        block_slots=torch.tensor(scratch[:t], dtype=torch.long, device=device),
        block_mask=torch.eye(q, dtype=torch.bool, device=device).repeat(b, 1, 1),
    )
    return meta, meta.block_slots.clone(), meta.block_mask.clone()


def _fill_meta(m: TreeAttnMeta, n: int, rows: int, prefix, prefix_lens, block_slots, scratch):
    """The first n blocks' prefix and slots; the blocks past them back to padding."""
    m.prefix_slots[:n, : prefix.shape[1]].copy_(prefix)
    m.prefix_lens[:n].copy_(prefix_lens)
    m.prefix_lens[n:].zero_()
    m.block_slots[:rows].copy_(block_slots)
    m.block_slots[rows:].copy_(scratch[rows:])


class GraphedForward:
    """Captures lazily, per shape key, and replays; `run` returns None when the shape is not
    graphable (larger than the largest bucket), so the caller runs eagerly."""

    def __init__(self, run_model, buckets: tuple[int, ...], scratch: list[int], device) -> None:
        self._run_model, self.buckets = run_model, tuple(sorted(buckets))
        self._scratch, self._device = scratch, torch.device(device)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._verify: dict[tuple, _VerifyGraph] = {}

    def _bucket(self, n: int, q: int) -> int | None:
        b = next((x for x in self.buckets if x >= n), None)
        return None if b is None or b * q > len(self._scratch) else b

    def run(self, ids, pos, prefix, prefix_lens, block_slots, mask, q: int, tag=()):
        """The forward over the first n = len(prefix_lens) blocks of q rows by graph replay, or
        None when the shape is not graphable. `tag`: what else the captured forward depends on
        (the runner's captured layers, which follow its drafter); part of the graph's key."""
        n = prefix_lens.shape[0]
        b = self._bucket(n, q)
        if b is None:
            return None
        shape = (b, q, _pow2_at_least(prefix.shape[1]))
        g = self._graphs.get((*shape, tag))
        if g is None:
            log.info("capturing the target forward for blocks=%d rows=%d prefix<=%d", *shape)
            g = self._graphs[(*shape, tag)] = _Graph(
                self._run_model, *shape, self._scratch, self._device
            )
        out = g.replay(ids, pos, prefix, prefix_lens, block_slots, mask)
        hidden = None if out.hidden is None else out.hidden[: n * q].clone()  # small; kept later
        return type(out)(logits=out.logits[: n * q], hidden=hidden)  # logits: until next replay

    def run_verify(
        self, draft, rows, drafter, bonus, prefix, prefix_lens, block_slots, budget: int, tag=()
    ) -> VerifyResult | None:
        """`verify_step` with greedy token choice over the first n = len(prefix_lens) blocks, by
        replaying one graph, the draft inside it (`drafter.draft_rows(rows, bonus)`) when
        `draft` is None; None when the shape is not graphable; `tag` as in `run`. The result's
        tensors are the graph's static outputs (valid until its next replay), cut to n blocks;
        sampled batches redo the choice from its logits (`ddtree.reselect`)."""
        n = prefix_lens.shape[0]
        b = self._bucket(n, budget + 1)
        if b is None:
            return None
        source = (None, tuple(draft.shape[1:])) if draft is not None else (drafter, None)
        key = (b, budget, _pow2_at_least(prefix.shape[1]), *source)
        g = self._verify.get((*key, tag))
        if g is None:
            log.info("capturing the verify step for blocks=%d budget=%d prefix<=%d", *key[:3])
            g = self._verify[(*key, tag)] = _VerifyGraph(
                self._run_model, *key, self._scratch, self._device
            )
        res = g.replay(draft, rows, bonus, prefix, prefix_lens, block_slots)
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        tree = dataclasses.replace(res.tree, **{f: cut(getattr(res.tree, f)) for f in TREE_TENSORS})
        return VerifyResult(cut(res.packed), cut(res.hidden), tree, cut(res.logits),
                            cut(res.all_hidden))  # fmt: skip

    def close(self) -> None:
        self._graphs.clear()
        self._verify.clear()
        torch.cuda.synchronize(self._device)
