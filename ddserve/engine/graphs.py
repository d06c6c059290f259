"""CUDA-graph replay of the decode forward and the DDTree verify step (`EngineConfig.cuda_graphs`).

The eager engine is launch-bound (a K2.6 rank forward is ~3,600 kernels). Two kinds of graph:
- the target forward alone (`_Graph`, `GraphedForward.run`: AR steps), one per (blocks B, rows
  per block Q, prefix capacity P);
- the whole verify step between the draft and the host (`_VerifyGraph`, `run_verify`:
  `ddtree.verify_step`'s tree build, verify inputs, target forward, token choice and acceptance),
  one per (B, budget, P, drafter), with greedy token choice (a batch with sampled streams
  redoes the choice and the acceptance from the graph's logits, eagerly: `ddtree.reselect`).
  A drafter whose draft is pure tensor code
  (`Drafter.state_rows`, DFlash) is captured in the same graph, and so is its commit of the
  accepted rows in greedy batches (`Drafter.step_commits`); others run before it, eagerly,
  and their logits are copied in. The host then reads the packed acceptance with the step's one
  device-to-host copy.
B is the batch padded to a bucket and P a power of two >= the longest prefix. A step's integer
inputs (token ids, positions, prefix lengths, slot-table rows, new slots) reach the graph in one
copy from pinned host memory (`_Inputs`), and the prefix slots are gathered from the device slot
table inside the graph, so a replay costs one host-to-device copy and no copy kernels. The AR
graph also takes the greedy token of every row, so a greedy AR step's one device-to-host copy
reads the tokens. Outputs are static tensors, valid until the next replay.
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


class _Inputs:
    """A graph's integer inputs in one static device buffer, written from pinned host memory by
    one copy per replay; the captured step reads named views of it, so a replay needs no other
    host-to-device copy and no copy kernels."""

    def __init__(self, sizes: dict[str, int], device) -> None:
        self.sizes = sizes
        total = sum(sizes.values())
        self.dev = torch.zeros(total, dtype=torch.long, device=device)
        self.host = torch.zeros(total, dtype=torch.long).pin_memory()
        self._np = self.host.numpy()
        self._copied = torch.cuda.Event()  # the last copy out of `host` (reused after it ends)
        self.views, off = {}, 0
        for name, n in sizes.items():
            self.views[name] = self.dev[off : off + n]
            off += n

    def load(self, **values: list[int]) -> None:
        """One copy of every input (each list exactly its view's length), queued on the stream."""
        flat = []
        for name, n in self.sizes.items():
            v = values[name]
            if len(v) != n:
                raise ValueError(f"graph input {name}: {len(v)} values for {n} places")
            flat += v
        self._copied.synchronize()
        self._np[:] = flat
        self.dev.copy_(self.host, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.dev.device))  # the copy's stream


def _padded(values: list[int], n: int, pad) -> list[int]:
    """values, then pad (an int, or a list whose tail fills the places past values) up to n."""
    tail = [pad] * (n - len(values)) if isinstance(pad, int) else pad[len(values) : n]
    return list(values) + tail


class _Graph:
    """One captured target forward for a (B, Q, P) key; its greedy tokens captured with it.

    Inputs: ids, positions, prefix lengths, the streams' rows in the slot table (their prefix
    slots are gathered from it inside the graph) and the new tokens' slots, in one copy."""

    def __init__(self, run_model, table, b: int, q: int, p: int, scratch: list[int], device):
        t = b * q
        self.b, self.q, self._scratch = b, q, scratch[:t]
        self.inp = _Inputs(dict(ids=t, pos=t, lens=b, rows=b, slots=t), device)
        self.inp.load(ids=[0] * t, pos=[0] * t, lens=[0] * b, rows=[0] * b, slots=self._scratch)
        v = self.inp.views
        self.mask = torch.eye(q, dtype=torch.bool, device=device).repeat(b, 1, 1)
        self._eye = self.mask.clone()
        starts = torch.arange(b, device=device) * q
        q_lens = torch.full((b,), q, dtype=torch.long, device=device)
        # every tensor the captured forward reads and that was made outside the capture must
        # live as long as the graph (a freed one's memory is handed to later eager tensors)
        self._static = (starts, q_lens, table)
        width = min(p, table.shape[1])

        def forward():
            prefix = table[:, :width].index_select(0, v["rows"])  # [B, P]
            meta = TreeAttnMeta(
                q_starts=starts, q_lens=q_lens, prefix_slots=prefix, prefix_lens=v["lens"],
                block_slots=v["slots"], block_mask=self.mask,
            )  # fmt: skip
            out = run_model(v["ids"], v["pos"], meta)
            return out, out.logits.argmax(dim=-1)

        self.graph, (self.out, self.tokens) = _capture(forward, device)

    def replay(self, ids, pos, rows, prefix_lens, block_slots, mask) -> None:
        """Actual inputs (host ints) for the first n = len(prefix_lens) blocks; the rest padding
        (no prefix, scratch slots). `mask` [n, Q, Q] is read only when Q > 1 (a one-row block
        sees itself)."""
        b, n, t = self.b, len(prefix_lens), self.b * self.q
        self.inp.load(
            ids=_padded(ids, t, 0), pos=_padded(pos, t, 0), lens=_padded(prefix_lens, b, 0),
            rows=_padded(rows, b, 0), slots=_padded(block_slots, t, self._scratch),
        )  # fmt: skip
        if self.q > 1:
            self.mask[:n].copy_(mask)
            self.mask[n:].copy_(self._eye[n:])
        self.graph.replay()


class _VerifyGraph:
    """One captured `verify_step` (tree build, verify inputs, target forward, greedy token choice,
    acceptance), preceded by the draft itself when the drafter can be captured (`drafter`, its
    `draft_rows` from static state rows), else fed the drafter's logits [B, D, V] (`draft_shape`
    (D, V)); followed, for a captured drafter with `step_commits`, by its commit of each
    stream's accepted rows (`commit_state`), so that a greedy step is this one graph and one
    copy back. Padding blocks draft from the drafter's `pad_row` (and commit nothing) or get
    zero logits, have no prefix, write to scratch slots and see only their own block. Integer
    inputs arrive in one copy (`_Inputs`), among them one commit flag per block: 1 commits the
    block's accepted rows, 0 (padding, and every block of a batch whose tokens are sampled
    after the graph) commits none."""

    def __init__(self, run_model, table, b, n, p, drafter, draft_shape, scratch, device) -> None:
        q = n + 1
        t = b * q
        self.b, self.q, self._scratch = b, q, scratch[:t]
        self.commits = getattr(drafter, "step_commits", False)  # None, or duck-typed: False
        self._pad_row = getattr(drafter, "pad_row", 0)
        sizes = dict(bonus=b, lens=b, rows=b, slots=t)
        if drafter is not None:
            sizes["draft_rows"] = b  # the drafter's state rows
        if self.commits:
            sizes["commit"] = b
        self.inp = _Inputs(sizes, device)
        zeros = {name: [0] * size for name, size in sizes.items() if name != "slots"}
        if drafter is not None:  # the warm-up run before capture drafts from the spare row
            zeros["draft_rows"] = [self._pad_row] * b
        self.inp.load(**zeros, slots=self._scratch)
        v = self.inp.views
        self.draft = None
        if drafter is None:
            self.draft = torch.zeros(b, *draft_shape, dtype=torch.float32, device=device)
        width = min(p, table.shape[1])
        self.meta = meta = TreeAttnMeta(  # kept: the graph reads its tensors
            q_starts=torch.arange(b, device=device) * q,
            q_lens=torch.full((b,), q, dtype=torch.long, device=device),
            prefix_slots=torch.zeros(b, width, dtype=torch.long, device=device),
            prefix_lens=v["lens"], block_slots=v["slots"],
            block_mask=torch.eye(q, dtype=torch.bool, device=device).repeat(b, 1, 1),
        )  # fmt: skip

        def forward(ids, pos, visible):
            meta.block_mask.copy_(visible)
            return run_model(ids, pos, meta)

        def step():
            torch.index_select(table[:, :width], 0, v["rows"], out=meta.prefix_slots)
            if drafter is None:
                draft = self.draft
            else:
                draft = drafter.draft_rows(v["draft_rows"], v["bonus"])
            argmax = lambda logits: logits.argmax(dim=-1)  # noqa: E731
            res = verify_step(forward, argmax, draft, v["bonus"], meta.prefix_lens, n)
            if self.commits and res.hidden is not None:  # count = the accepted path's rows
                drafter.commit_state(v["draft_rows"], res.hidden, res.packed[:, 0] * v["commit"])
            return res

        self._table = table
        self.graph, self.out = _capture(step, device)

    def replay(
        self, draft, draft_rows, bonus, rows, prefix_lens, block_slots, commit: bool
    ) -> bool:
        """Host ints for the first n = len(prefix_lens) blocks (`draft_rows` when the draft is
        captured, else `draft` [n, D, V] on the device); the rest padding. `commit`: the
        drafter commits the blocks' accepted rows in the graph, where it can (the result is
        whether it did)."""
        b, n, t = self.b, len(prefix_lens), self.b * self.q
        committed = commit and self.commits and self.out.hidden is not None
        extra = {}
        if self.draft is None:
            extra["draft_rows"] = _padded(draft_rows, b, self._pad_row)
        if self.commits:
            extra["commit"] = _padded([int(committed)] * n, b, 0)
        self.inp.load(bonus=_padded(bonus, b, 0), lens=_padded(prefix_lens, b, 0),
                      rows=_padded(rows, b, 0), slots=_padded(block_slots, t, self._scratch),
                      **extra)  # fmt: skip
        if self.draft is not None:
            self.draft[:n].copy_(draft)
            self.draft[n:].zero_()
        self.graph.replay()
        return committed


class GraphedForward:
    """Captures lazily, per shape key, and replays; `run` returns None when the shape is not
    graphable (larger than the largest bucket), so the caller runs eagerly.

    The graphs gather prefix slots from the slot table `table` [R, L] (a stream's row lists its
    slots in order); a table that was reallocated (grown) invalidates them, so they are dropped
    and captured again."""

    def __init__(self, run_model, buckets: tuple[int, ...], scratch: list[int], device) -> None:
        self._run_model, self.buckets = run_model, tuple(sorted(buckets))
        self._scratch, self._device = scratch, torch.device(device)
        self._graphs: dict[tuple, _Graph] = {}
        self._verify: dict[tuple, _VerifyGraph] = {}
        self._table: torch.Tensor | None = None

    def _bucket(self, n: int, q: int) -> int | None:
        b = next((x for x in self.buckets if x >= n), None)
        return None if b is None or b * q > len(self._scratch) else b

    def _use_table(self, table: torch.Tensor) -> None:
        if self._table is not None and (
            table.data_ptr() != self._table.data_ptr() or table.shape != self._table.shape
        ):
            log.info("the slot table was reallocated: capturing the graphs again")
            self.close()
        self._table = table

    def run(self, ids, pos, rows, prefix_lens, block_slots, mask, q: int, table, tag=(), pad_to=0):
        """The forward over the first n = len(prefix_lens) blocks of q rows by graph replay, or
        None when the shape is not graphable. Host ints: ids, pos and block_slots [n * q], rows
        (each block's slot-table row) and prefix_lens [n]; `mask` [n, q, q] (read when q > 1).
        `tag`: what else the captured forward depends on (the runner's captured layers, which
        follow its drafter); part of the graph's key. `pad_to`: the graph of at least this many
        blocks (the rest are padding). Returns (the model output cut to n * q
        rows, the greedy token at each of them); the logits and tokens are the graph's static
        tensors, valid until its next replay."""
        n = len(prefix_lens)
        b = self._bucket(max(n, pad_to), q)
        if b is None:
            return None
        self._use_table(table)
        shape = (b, q, _pow2_at_least(max(prefix_lens, default=1)))
        g = self._graphs.get((*shape, tag))
        if g is None:
            log.info("capturing the target forward for blocks=%d rows=%d prefix<=%d", *shape)
            g = self._graphs[(*shape, tag)] = _Graph(
                self._run_model, table, *shape, self._scratch, self._device
            )
        g.replay(ids, pos, rows, prefix_lens, block_slots, mask)
        out, t = g.out, n * q
        hidden = None if out.hidden is None else out.hidden[:t].clone()  # small; kept later
        return type(out)(logits=out.logits[:t], hidden=hidden), g.tokens[:t]

    def run_verify(
        self, draft, draft_rows, drafter, bonus, rows, prefix_lens, block_slots, budget: int,
        table, tag=(), commit: bool = False, pad_to: int = 0,
    ) -> tuple[VerifyResult, bool] | None:  # fmt: skip
        """`verify_step` with greedy token choice over the first n = len(prefix_lens) blocks, by
        replaying one graph, the draft inside it (`drafter.draft_rows` from the host ints
        `draft_rows`) when `draft` is None; None when the shape is not graphable. Host ints:
        bonus, rows (slot-table rows), prefix_lens [n] and block_slots [n * (budget + 1)]; `tag`
        and `pad_to` as in `run`. `commit` (a greedy batch): the captured drafter also commits
        each block's accepted rows (`Drafter.step_commits`). Returns the result, whose tensors
        are the graph's static outputs (valid until its next replay) cut to n blocks, and
        whether the drafter committed; sampled batches redo the choice from its logits
        (`ddtree.reselect`) and commit after it."""
        n = len(prefix_lens)
        b = self._bucket(max(n, pad_to), budget + 1)
        if b is None:
            return None
        self._use_table(table)
        source = (None, tuple(draft.shape[1:])) if draft is not None else (drafter, None)
        commits = draft is None and getattr(drafter, "step_commits", False)  # captured with it
        key = (b, budget, _pow2_at_least(max(prefix_lens, default=1)), *source, commits)
        g = self._verify.get((*key, tag))
        if g is None:
            log.info("capturing the verify step for blocks=%d budget=%d prefix<=%d", *key[:3])
            g = self._verify[(*key, tag)] = _VerifyGraph(
                self._run_model, table, *key[:-1], self._scratch, self._device
            )
        committed = g.replay(draft, draft_rows, bonus, rows, prefix_lens, block_slots, commit)
        res, cut = g.out, lambda t: None if t is None else t[:n]  # noqa: E731
        tree = dataclasses.replace(res.tree, **{f: cut(getattr(res.tree, f)) for f in TREE_TENSORS})
        return VerifyResult(cut(res.packed), cut(res.hidden), tree, cut(res.logits),
                            cut(res.all_hidden)), committed  # fmt: skip

    def close(self) -> None:
        torch.cuda.synchronize(self._device)  # no replay in flight
        self._graphs.clear()
        self._verify.clear()
