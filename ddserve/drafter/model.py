"""The DFlash block drafter (arXiv 2602.06036): one pass over [bonus, MASK x D] -> D logits rows.

`DFlashModel` holds the weights and the pure forward; `DFlashDrafter` adds per-stream context
bookkeeping and implements the engine's `Drafter` seam (docs/architecture.md).

Context: for every committed token, the target's hidden states at `target_layer_ids` (outputs of
those decoder layers), concatenated, go through `fc` (no bias) and `hidden_norm`, then through each
layer's own k/v projections, once, into the per-stream ring (`ContextCache`). Positions: a stream
with n committed tokens has its context at 0..n-1 and its block at n..n+D (the bonus is at n).
Block queries see every block key and every live context key, except that a sliding layer hides
context more than `sliding_window - 1` positions behind the query. The drafter has no embedding
or lm_head: it uses the target's `embed` and `lm_logits` (after its own final `norm`).

Tensor parallelism: the drafter is sharded across the target's ranks like the target (layers.py):
each rank holds 1/W of the heads, of the MLP and of `fc`'s input columns (the captured hidden
states, identical on every rank after the target's all-reduce, are cut the same way), and each
rank's context ring holds its own KV heads. `fc`, o_proj and down_proj end in an all-reduce, so
every rank holds the same block hidden states, computes the same draft logits (the target's
all-gathered `lm_logits`) and builds the same tree. A drafter whose KV heads, MLP width or `fc`
width do not divide by W is replicated on every rank instead (`shard_world`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddserve.distributed import Communicator, LocalComm
from ddserve.drafter.base import Drafter
from ddserve.drafter.cache import ContextCache, RingRows
from ddserve.drafter.config import DrafterConfig
from ddserve.drafter.layers import SHARD_DIM, DFlashDecoderLayer, RMSNorm
from ddserve.drafter.rope import Rotary, apply_rope
from ddserve.kernels import backend
from ddserve.kvcache import Staging
from ddserve.stacked import share_rows, stacked_rows

log = logging.getLogger(__name__)
# layer -> its context k, v: [B, C, KVH, Dh] each, or the rings in place (`RingRows` each)
KVFn = Callable[[int], tuple[Tensor, Tensor] | tuple[RingRows, RingRows]]


class TargetHooks(Protocol):
    """What the drafter borrows from the target model (ddserve.model's DeepseekV3ForCausalLM)."""

    def embed(self, ids: Tensor) -> Tensor: ...  # [N] -> [N, H]

    def lm_logits(self, h: Tensor) -> Tensor: ...  # [N, H] -> [N, V] float32


def shard_world(cfg: DrafterConfig, world_size: int) -> int:
    """The number of ranks the drafter is split across at tp = world_size: all of them where its
    KV heads, MLP width and `fc` input width divide by it, else 1 (replicated)."""
    widths = (
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        len(cfg.target_layer_ids) * cfg.hidden_size,
    )
    return world_size if all(n % world_size == 0 for n in widths) else 1


class DFlashModel(nn.Module):
    """Weights and forward of a DFlash drafter; state_dict names match published checkpoints.
    With `comm` at W > 1 ranks (and `shard_world` W) this rank's shard: `shard_dim` says where
    each weight is cut."""

    def __init__(self, cfg: DrafterConfig, comm: Communicator | None = None):
        super().__init__()
        self.cfg = cfg
        comm = comm or LocalComm()
        self.comm = comm if shard_world(cfg, comm.world_size) > 1 else LocalComm()
        h, w = cfg.hidden_size, self.comm.world_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h // w, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(cfg, i, self.comm) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    def context_kv(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [..., T, k*H] (target layers in target_layer_ids order), positions [..., T] ->
        per-layer context k, v [L, ..., T, KVH, Dh]. With the layers' k/v projections stacked
        (`stack_context_kv`), every layer's at once: one matmul, one k norm, one rotation, a
        few dozen ops whatever the layer count, where layer by layer takes ~15 per layer (a
        commit runs eagerly after each step, so its op count is host time on the step's path)."""
        dtype, world = self.fc.weight.dtype, self.comm.world_size
        if world > 1:  # row-parallel fc: this rank's columns of the hidden states, all-reduced
            part = hidden.shape[-1] // world
            hidden = hidden.narrow(-1, self.comm.rank * part, part)
        ctx = self.hidden_norm(self.comm.all_reduce(self.fc(hidden.to(dtype))))  # [..., T, H]
        cos, sin = self.rotary.cos_sin(positions, dtype)  # [..., T, Dh]
        w = self._stacked_kv()
        if w is None:
            kvs = [layer.context_kv(ctx, cos, sin) for layer in self.layers]
            return torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])
        attn, n = self.layers[0].self_attn, len(self.layers)
        kv = F.linear(ctx, w).view(*ctx.shape[:-1], n, 2, attn.n_kv, attn.head_dim)
        k, v = kv.movedim((-3, -4), (0, 1))  # [L, ..., T, KVH, Dh] each
        norm = torch.stack([layer.self_attn.k_norm.weight for layer in self.layers])  # [L, Dh]
        norm = norm.view(n, *[1] * (k.dim() - 2), attn.head_dim)
        kf = k.float()
        kf = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + attn.k_norm.eps)
        k = norm * kf.to(k.dtype)  # `RMSNorm`'s operations, every layer at once
        return apply_rope(k, cos, sin), v

    def shard_dim(self, name: str) -> int | None:
        """The dimension at which this rank holds 1/W of state_dict tensor `name` (the slice at
        rank * size), or None where it holds the whole tensor."""
        if self.comm.world_size == 1:
            return None
        parts = name.split(".")
        return SHARD_DIM.get(parts[-2]) if len(parts) >= 2 and parts[-1] == "weight" else None

    def stack_context_kv(self) -> None:
        """Rebind every layer's k_proj and v_proj weight to a view of one [L * 2 * KVH * Dh, H]
        buffer (`share_rows`: layer by layer, k rows then v rows, values kept), so `context_kv`
        computes them in one matmul. Inference only (the views are not trainable); a weight
        replaced afterwards turns the stacked path off."""
        share_rows(*self._kv_projections())

    def stack(self) -> None:
        """Every inference-time stacking: `stack_context_kv`, and each layer's MLP gate and up
        weights as views of one [2 * I, H] buffer, so the block's MLP runs one matmul for them
        and `backend.silu_mul` (one launch in the engine's batch-invariant mode on CUDA). Values
        kept; a weight replaced afterwards unstacks its layer; where gradients are wanted the
        layers compute separately (the stacked tensor is a view of the gate weight alone)."""
        self.stack_context_kv()
        for layer in self.layers:
            share_rows(layer.mlp.gate_proj, layer.mlp.up_proj)

    def _kv_projections(self) -> list[nn.Linear]:
        attns = [layer.self_attn for layer in self.layers]
        return [m for a in attns for m in (a.k_proj, a.v_proj)]

    def _stacked_kv(self) -> Tensor | None:
        """The stacked k/v weight while `stack_context_kv`'s views are intact, else None; None
        too where gradients are wanted (the stacked tensor is a view of the first weight only,
        so the others would get none)."""
        eps = {layer.self_attn.k_norm.eps for layer in self.layers}
        ws = [m.weight for m in self._kv_projections()]
        if len(eps) != 1 or (torch.is_grad_enabled() and any(w.requires_grad for w in ws)):
            return None
        return stacked_rows(*ws)

    def block(
        self, x: Tensor, positions: Tensor, ctx_pos: Tensor, ctx_live: Tensor, ctx_kv: KVFn
    ) -> Tensor:
        """x [B, Q, H] block embeddings at positions [B, Q]; context entries at ctx_pos [B, C]
        (live where ctx_live); ctx_kv(layer) gives that layer's context k, v. -> [B, Q, H]."""
        b, q_len, _ = x.shape
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [B, Q, Dh]
        block_vis = torch.ones(b, q_len, q_len, dtype=torch.bool, device=x.device)  # [B, Q, Q]
        live = ctx_live[:, None, :].expand(b, q_len, ctx_live.shape[1])  # [B, Q, C]
        full = torch.cat((live, block_vis), dim=-1)  # [B, Q, C+Q]
        sliding = full
        if self.cfg.sliding_window is not None:
            near = positions[:, :, None] - ctx_pos[:, None, :] < self.cfg.sliding_window  # [B,Q,C]
            sliding = torch.cat((live & near, block_vis), dim=-1)  # [B, Q, C+Q]
        for i, layer in enumerate(self.layers):
            k, v = ctx_kv(i)
            x = layer(x, cos, sin, k, v, sliding if layer.sliding else full)
        return self.norm(x)


def _in_kernel_mode(fn):
    """Run a DFlashDrafter method in the drafter's `kernels` configuration, when it has one."""

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        if self.kernels is None:
            return fn(self, *args, **kwargs)
        with backend.kernel_mode(self.kernels):
            return fn(self, *args, **kwargs)

    return run


class DFlashDrafter(Drafter):
    """DFlash behind the engine's Drafter seam: add_stream / commit / draft / remove_stream.

    Each stream keeps a ring of `min(sliding_window, max_context)` context entries when every
    layer slides (older entries are invisible anyway), else of `max_context` (required then: the
    most tokens a stream can hold, e.g. the KV pool size)."""

    def __init__(
        self,
        model: DFlashModel,
        target: TargetHooks,
        max_streams: int,
        max_context: int | None = None,
    ):
        cfg = model.cfg
        self.cfg, self.model, self.target = cfg, model.eval(), target
        self.depth, self.max_streams = cfg.depth, max_streams
        self.capture_layers = tuple(sorted(set(cfg.target_layer_ids)))
        order = [self.capture_layers.index(i) for i in cfg.target_layer_ids]
        self._order = None if order == list(range(len(order))) else order
        bounds = [c for c in (cfg.context_window, max_context) if c is not None]
        if not bounds:
            raise ValueError("a drafter with full-attention layers needs max_context")
        capacity = min(bounds)
        self._exact_ring = capacity == cfg.context_window  # wrapping drops only unseen entries
        w = model.fc.weight
        self.cache = ContextCache(
            cfg.num_hidden_layers,
            capacity,
            model.layers[0].self_attn.n_kv,  # this rank's KV heads
            cfg.head_dim,
            max_streams,
            dtype=w.dtype,
            device=w.device,
        )
        self._positions = Staging(w.device)  # a batched commit's context positions
        # the engine's kernel configuration (`backend.KernelConfig`): the drafter's own calls
        # run in it (its norms as the target's kernels), or in the ambient one while None
        self.kernels = None
        # commit_block through its CUDA graphs (on CUDA; `commit_many` eagerly where off) and
        # the block attention reading the context in the ring (`kernels.drafter_attn`, a
        # Triton kernel; gathered rows where off): both on where the drafter lives on CUDA
        self.graph_commits = self.ring_attention = w.is_cuda
        # a verify graph commits the accepted rows itself (`commit_state`) where a block's rows
        # fit the ring without wrapping onto each other; padding blocks use the spare row
        self.step_commits = self.depth + 1 <= capacity
        self.pad_row = self.cache.pad_row
        self._graphs: dict[tuple[int, int], _CommitGraph] = {}  # commit_block's, by (B, W)
        self._eager: set[tuple[int, int]] = set()  # shapes whose capture failed
        # what the graphs share (they never run at once): a memory pool and static inputs,
        # [max_streams, block_size, k*H] hidden states and [3 * max_streams] ints
        self._pool = self._static_hidden = self._static_ints = None

    def add_stream(self, sid: Hashable, prompt_ids: list[int], hidden: Tensor | None) -> None:
        self.cache.add(sid)
        try:
            self._append(sid, prompt_ids, hidden)
        except Exception:
            self.cache.remove(sid)
            raise

    def remove_stream(self, sid: Hashable) -> None:
        self.cache.remove(sid)

    def close(self) -> None:
        """Free the commit graphs (a sharded drafter's captured its all-reduces; NCCL waits for
        such graphs when its communicator is destroyed). Later commits capture them again."""
        if self._graphs:
            torch.cuda.synchronize(self.cache.k.device)  # no replay in flight
        self._graphs.clear()

    def commit(self, sid: Hashable, token_ids: list[int], hidden: Tensor | None) -> None:
        """Append committed tokens' captured hidden states [T, len(capture_layers)*H]."""
        self._append(sid, token_ids, hidden)

    @_in_kernel_mode
    @torch.inference_mode()
    def commit_many(self, items: list[tuple[Hashable, list[int], Tensor | None]]) -> None:
        """One context forward for every stream's committed tokens (their hidden states laid
        end to end), one write into the ring: the same launches for 1 stream as for 10 (the
        host's per-stream work is a few view ops each)."""
        if len({sid for sid, _, _ in items}) < len(items) or len(items) < 2:
            for item in items:  # a stream twice must see its first commit: one at a time
                self._append(*item)
            return
        hiddens, positions, appends = [], [], []
        for sid, token_ids, hidden in items:
            start, keep, hidden = self._checked(sid, token_ids, hidden)
            hiddens.append(hidden)
            positions += range(start, start + keep)
            appends.append((sid, start, keep))
        dev = self.cache.k.device
        pos = self._positions.put(positions)  # one copy, no stream sync
        k, v = self.model.context_kv(torch.cat(hiddens).to(dev), pos)
        self.cache.append_many(appends, k, v)

    @_in_kernel_mode
    @torch.inference_mode()
    def commit_block(self, sids: list, token_ids: list[list[int]], hidden: Tensor) -> None:
        """`Drafter.commit_block`. On CUDA with `graph_commits` on (the default there), one
        replay of a graph captured per block shape (B, W) (`commit_rows`: every row of the
        block through the context forward, the first len(token_ids[i]) of stream i written to
        its ring): the same ring and lengths as `commit_many` for ~5 host launches where the
        eager commit issues ~60 torch ops while the device idles after the step's
        device-to-host copy (1.1 ms less per K2.5-sized DDTree step on an H100: BENCHMARKS.md).
        Elsewhere, or for a block the graph cannot take (a stream twice, a count of 0 or above
        W, W above the ring), eager."""
        b, w = hidden.shape[:2]
        counts = [len(t) for t in token_ids]
        graphable = (
            self.graph_commits and hidden.is_cuda and b == len(sids) == len(set(sids))
            and w <= min(self.cfg.block_size, self.cache.capacity) and (b, w) not in self._eager
            and all(1 <= c <= w for c in counts)
        )  # fmt: skip
        if not graphable:
            return super().commit_block(sids, token_ids, hidden)
        starts = []
        for sid, c in zip(sids, counts, strict=True):
            n = self.cache.length(sid)
            if not self._exact_ring and n + c > self.cache.capacity:
                cap = self.cache.capacity
                raise ValueError(f"drafter context {n + c} exceeds max_context {cap}")
            starts.append(n)
        g = self._graphs.get((b, w)) or _CommitGraph(self, b, w)
        g.load(hidden, self._positions.put(self.cache.row_ids(sids) + starts + counts))
        if (b, w) in self._graphs:
            g.graph.replay()
        else:  # this shape's first commit: eagerly (the real one), then its graph captured
            g.warm_up()
        for sid, n, c in zip(sids, starts, counts, strict=True):
            self.cache.set_length(sid, n + c)
        if (b, w) not in self._graphs:
            try:
                g.capture()
                self._graphs[(b, w)] = g
            except Exception:  # noqa: BLE001 - a shape that cannot be captured commits eagerly
                log.warning("DFlash commit graph for %d streams x %d rows not captured; "
                            "committing that shape eagerly", b, w, exc_info=True)  # fmt: skip
                self._eager.add((b, w))

    def commit_rows(self, hidden: Tensor, rows: Tensor, starts: Tensor, counts: Tensor) -> None:
        """Pure tensor code of a block commit: hidden [B, W, k*H] (captured layers sorted) at
        positions starts[i] + j; rows j < counts[i] go to stream row rows[i] of the ring (the
        others' ring entries are rewritten with their own values) and its length becomes
        starts[i] + counts[i]. Host lengths are the caller's (`ContextCache.set_length`)."""
        b, w = hidden.shape[:2]
        if self._order is not None:
            hidden = hidden.view(b, w, len(self.capture_layers), -1)[:, :, self._order]
            hidden = hidden.reshape(b, w, -1)
        j = torch.arange(w, device=hidden.device)
        pos = starts[:, None] + j  # [B, W]
        k, v = self.model.context_kv(hidden, pos)  # [L, B, W, KVH, Dh]
        keep = (j < counts[:, None])[None, :, :, None, None]  # [1, B, W, 1, 1]
        r, i = rows[:, None].expand(b, w), pos % self.cache.capacity  # [B, W] each
        for ring, new in ((self.cache.k, k), (self.cache.v, v)):
            ring[:, r, i] = torch.where(keep, new.to(ring.dtype), ring[:, r, i])
        self.cache.lengths[rows] = starts + counts

    @_in_kernel_mode
    @torch.inference_mode()
    def commit_state(self, rows: Tensor, hidden: Tensor, counts: Tensor) -> None:
        """`Drafter.commit_state`: `commit_rows` at the streams' device lengths (inside the
        verify graph; padding blocks at `pad_row` with count 0)."""
        self.commit_rows(hidden, rows, self.cache.lengths.index_select(0, rows), counts)

    def advance(self, sids: list, token_ids: list[list[int]]) -> None:
        for sid, toks in zip(sids, token_ids, strict=True):
            n = self.cache.length(sid) + len(toks)
            if not self._exact_ring and n > self.cache.capacity:  # admission rules this out
                raise ValueError(f"drafter context {n} exceeds max_context {self.cache.capacity}")
            self.cache.set_length(sid, n)

    def rewind(self, sids: list) -> None:
        """`Drafter.rewind`. Where a ring had wrapped, the entries the undone commit overwrote
        stay overwritten: only drafts can change, never what the target commits."""
        rows = self.cache.row_ids(sids)
        flat = self._positions.put(rows + [self.cache.length(s) for s in sids])
        self.cache.lengths[flat[: len(rows)]] = flat[len(rows) :]

    def _checked(self, sid: Hashable, token_ids: list[int], hidden: Tensor | None):
        """(start position, rows kept, their reordered hidden states) of one commit."""
        t = len(token_ids)
        if hidden is None or hidden.shape[0] != t:
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"DFlash commit of {t} tokens needs their hidden states, got {got}")
        n = self.cache.length(sid)
        if not self._exact_ring and n + t > self.cache.capacity:
            raise ValueError(f"drafter context {n + t} exceeds max_context {self.cache.capacity}")
        keep = min(t, self.cache.capacity)  # older rows would be overwritten within this chunk
        return n + t - keep, keep, self._reorder(hidden[t - keep :])  # [keep, k*H]

    @_in_kernel_mode
    @torch.inference_mode()
    def _append(self, sid: Hashable, token_ids: list[int], hidden: Tensor | None) -> None:
        start, keep, hidden = self._checked(sid, token_ids, hidden)
        pos = torch.arange(start, start + keep, device=self.cache.k.device)  # [keep]
        k, v = self.model.context_kv(hidden.to(self.cache.k.device), pos)  # [L, keep, KVH, Dh]
        self.cache.append(sid, k, v, start)

    @torch.inference_mode()
    def draft(self, sids: Sequence[Hashable], bonus: Tensor) -> Tensor:
        """bonus [B] (each stream's last committed token) -> per-depth logits [B, D, V] float32."""
        return self.draft_rows(self.cache.rows(sids), bonus)

    def state_rows(self, sids: list) -> list[int]:
        return self.cache.row_ids(sids)

    @_in_kernel_mode
    @torch.inference_mode()
    def draft_rows(self, rows: Tensor, bonus: Tensor) -> Tensor:
        """`draft` for the context-cache rows [B] of the streams (pure tensor code)."""
        b, q_len, dev = rows.shape[0], self.cfg.block_size, self.cache.k.device
        ids = torch.full((b, q_len), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = bonus.to(dev)
        x = self.target.embed(ids.reshape(-1)).reshape(b, q_len, -1)  # [B, Q, H]
        x = x.to(self.model.fc.weight.dtype)
        n = self.cache.lengths.index_select(0, rows)  # [B]
        positions = n[:, None] + torch.arange(q_len, device=dev)  # [B, Q]
        ctx_pos, ctx_live = self.cache.positions(rows)  # [B, C]
        context = functools.partial(self.cache.layer, rows=rows, in_place=self.ring_attention)
        h = self.model.block(x, positions, ctx_pos, ctx_live, context)
        logits = self.target.lm_logits(h[:, 1:].reshape(b * self.depth, -1))  # [B*D, V]
        return logits.float().reshape(b, self.depth, -1)

    def _reorder(self, hidden: Tensor) -> Tensor:
        """Captured layers come sorted and unique; fc expects target_layer_ids order."""
        if self._order is None:
            return hidden
        t = hidden.shape[0]
        blocks = hidden.reshape(t, len(self.capture_layers), -1)  # [T, n_cap, H]
        return blocks[:, self._order].reshape(t, -1)  # [T, k*H]


class _CommitGraph:
    """`DFlashDrafter.commit_rows` for one block shape (B, W), over views of the drafter's shared
    static inputs: `load` copies a commit's hidden states and ints in, then `run` (eagerly) or,
    once `capture` has run, `graph.replay()`."""

    def __init__(self, drafter: DFlashDrafter, b: int, w: int) -> None:
        dev, width = drafter.cache.k.device, len(drafter.capture_layers) * drafter.cfg.hidden_size
        if drafter._static_hidden is None:
            rows, dtype = drafter.max_streams, drafter.model.fc.weight.dtype
            drafter._static_hidden = torch.empty(rows, drafter.cfg.block_size, width,
                                                 dtype=dtype, device=dev)  # fmt: skip
            drafter._static_ints = torch.empty(3 * rows, dtype=torch.long, device=dev)
            drafter._pool = torch.cuda.graph_pool_handle()
        self.drafter, self.dev = drafter, dev
        self.hidden = drafter._static_hidden[:b, :w]  # [B, W, k*H]
        self.ints = drafter._static_ints[: 3 * b]
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, hidden: Tensor, ints: Tensor) -> None:
        self.hidden.copy_(hidden)
        self.ints.copy_(ints)

    def run(self) -> None:
        rows, starts, counts = self.ints.view(3, -1)
        self.drafter.commit_rows(self.hidden, rows, starts, counts)

    def warm_up(self) -> None:
        """`run` on a side stream, ordered after and before the current stream's work (lazy
        initialisations happen outside the capture, as `torch.cuda.graph` advises)."""
        main, side = torch.cuda.current_stream(self.dev), torch.cuda.Stream(self.dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.run()
        main.wait_stream(side)

    def capture(self) -> None:
        """Record `run`; nothing runs (a capture does not execute its kernels)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.drafter._pool):
            self.run()
        self.graph = graph
