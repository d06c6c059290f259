"""ModelRunner: one tensor-parallel rank's engine (prefill, AR step, DDTree step). No Ray.

Every rank runs the same calls in the same order. Bookkeeping decisions (sampled tokens, accepted
path, stops) come from the all-gathered logits and per-(seed, step) hashed randomness, so every
rank reaches the same state without talking. One device-to-host copy per step fetches them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ddserve.config import ModelConfig
from ddserve.ddtree import block_meta, reselect, select_tokens, verify_step
from ddserve.ddtree.verify import causal_masks
from ddserve.distributed import Communicator, LocalComm
from ddserve.drafter.base import Drafter
from ddserve.engine.config import EngineConfig, resolve_dtype
from ddserve.engine.graphs import GraphedForward
from ddserve.engine.stream import StepOutput, Stream, stop_ids
from ddserve.engine.threads import configure_cpu_threads
from ddserve.kernels import backend
from ddserve.kernels.config import KernelConfig
from ddserve.kvcache import LatentCache, OutOfSlots, SlotAllocator, SlotTable, Staging
from ddserve.model.moe import build_dequantized_caches
from ddserve.sampling import SamplingParams

log = logging.getLogger(__name__)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class ModelRunner:
    """Streams, KV slots and the target model of one rank.

    Admission reserves each stream's worst case (prompt + max_tokens + budget + 1 slots), so a
    running stream never runs out of slots; `add_stream` raises OutOfSlots instead, having
    allocated nothing, and the caller queues the request.
    """

    def __init__(
        self,
        model_path: str | Path,
        comm: Communicator | None = None,
        engine_cfg: EngineConfig | None = None,
        drafter: Drafter | str | Path | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        from ddserve.model.loader import load_model

        cfg, comm = engine_cfg or EngineConfig(), comm or LocalComm()
        dev = torch.device(device or default_device())
        cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, dev))
        model, model_cfg = load_model(model_path, comm, cfg.torch_dtype, dev, progress=False)
        self._setup(model, model_cfg, comm, cfg, drafter)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        model_cfg: ModelConfig,
        comm: Communicator | None = None,
        engine_cfg: EngineConfig | None = None,
        drafter: Drafter | str | Path | None = None,
    ) -> ModelRunner:
        """A runner around an already-built model (benchmarks, tests): no checkpoint is read.
        The device is the model's, and so is the dtype when the config's is "auto"; `comm`
        defaults to the model's communicator."""
        self = cls.__new__(cls)
        comm = comm or getattr(model, "comm", None) or LocalComm()
        cfg = engine_cfg or EngineConfig()
        if cfg.dtype == "auto":
            floating = next(p.dtype for p in model.parameters() if p.is_floating_point())
            cfg = dataclasses.replace(cfg, dtype=str(floating).removeprefix("torch."))
        self._setup(model, model_cfg, comm, cfg, drafter)
        return self

    def _setup(self, model, model_cfg, comm, engine_cfg, drafter) -> None:
        self.cfg, self.comm = engine_cfg, comm
        self.kernels = KernelConfig.resolve(batch_invariant=engine_cfg.batch_invariant)
        log.info("kernel configuration: %s", self.kernels)
        self.model, self.model_cfg = model, model_cfg
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":  # CPU tensor-parallel ranks share one host
            configure_cpu_threads(comm.world_size, engine_cfg.cpu_threads)
            build_dequantized_caches(model)
        mc = self.model_cfg
        self.kv = LatentCache(
            mc.num_hidden_layers,
            self.cfg.num_slots,
            mc.kv_latent_dim,
            self.cfg.torch_dtype,
            self.device,
        )
        self.allocator = SlotAllocator(self.cfg.num_slots)
        self.slot_table = SlotTable(self.cfg.num_slots, self.device, rows=self.cfg.max_streams)
        self._sample_floats = Staging(self.device, torch.float32)  # temperature, top_p
        self._sample_ints = Staging(self.device)  # top_k, seed, step
        self.drafter = self._make_drafter(drafter)
        if hasattr(self.drafter, "kernels"):  # DFlash: its norms in this engine's kernels
            self.drafter.kernels = self.kernels
        if hasattr(self.drafter, "graph_commits") and not self.cfg.cuda_graphs:
            self.drafter.graph_commits = False  # an eager engine: no graph of the drafter's
        self.streams: dict[Hashable, Stream] = {}
        self._reserved = 0
        self._admitted = 0
        self.target_forwards = 0
        self._graphs = self._make_graphs()

    def _make_graphs(self) -> GraphedForward | None:
        if not self.cfg.cuda_graphs:
            return None
        if self.device.type != "cuda" or self.cfg.torch_dtype == torch.float32:
            log.warning("cuda_graphs needs a CUDA device and a 16-bit dtype: running eagerly")
            return None
        need = max(self.cfg.graph_buckets) * (self.cfg.budget + 1)
        if 2 * need > self.cfg.num_slots:
            log.warning(
                "cuda_graphs needs %d padding KV slots, more than half of num_slots=%d: running "
                "eagerly (raise num_slots or lower the largest bucket / budget)",
                need, self.cfg.num_slots,
            )  # fmt: skip
            return None
        scratch = self.allocator.alloc(need)
        self._reserved += len(scratch)  # padding rows' slots, never given to a stream

        def run_model(ids, pos, meta):  # captured once per shape, in this engine's kernel mode
            with backend.kernel_mode(self.kernels):
                return self.model(ids, pos, self.kv.pool, meta, self.capture)

        return GraphedForward(run_model, self.cfg.graph_buckets, scratch, self.device)

    def close(self) -> None:
        """Free CUDA graphs, the drafter's too (before the communicator they captured
        collectives of)."""
        if self._graphs is not None:
            self._graphs.close()
            self._graphs = None
        close = getattr(self.drafter, "close", None)  # duck-typed drafters may have none
        if close is not None:
            close()

    def _make_drafter(self, drafter: Drafter | str | Path | None) -> Drafter | None:
        if drafter is None or isinstance(drafter, Drafter) or hasattr(drafter, "draft"):
            return drafter  # type: ignore[return-value]
        from ddserve.drafter import load_drafter

        return load_drafter(
            drafter, self.model_cfg, self.model, max_streams=self.cfg.max_streams,
            max_context=self.cfg.num_slots, dtype=self.cfg.torch_dtype, device=self.device,
            comm=self.comm,
        )  # fmt: skip

    # ---- admission -------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.allocator.num_free

    @property
    def capture(self) -> tuple[int, ...]:
        return tuple(self.drafter.capture_layers) if self.drafter is not None else ()

    def add_stream(self, sid: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a stream for prefill. Raises OutOfSlots (nothing reserved) if it cannot fit."""
        if sid in self.streams:
            raise ValueError(f"stream {sid!r} already exists")
        if not prompt_ids:
            raise ValueError("empty prompt")
        cap = self.drafter.max_streams if self.drafter is not None else None
        if cap is not None and len(self.streams) >= cap:
            raise OutOfSlots(f"the drafter already holds its max_streams={cap} streams")
        need = len(prompt_ids) + params.max_tokens + self.cfg.budget + 1
        if self._reserved + need > self.cfg.num_slots:
            free = self.cfg.num_slots - self._reserved
            raise OutOfSlots(f"stream needs up to {need} KV slots; {free} unreserved")
        seed = params.seed if params.seed is not None else hash((self.cfg.seed, self._admitted))
        self._admitted += 1
        self._reserved += need
        eos = self.model_cfg.eos_token_id
        self.streams[sid] = Stream(
            sid, list(prompt_ids), params, seed & (2**62 - 1), need, stop_ids(params, eos)
        )
        self.slot_table.add(sid)

    def cancel(self, sid: Hashable) -> bool:
        """Drop a stream in any state and free all its slots. False if unknown."""
        st = self.streams.pop(sid, None)
        if st is None:
            return False
        self.allocator.free(st.slots)
        self.slot_table.remove(sid)
        self._reserved -= st.reserved
        if self.drafter is not None and st.prefilled:
            self.drafter.remove_stream(sid)
        return True

    def _finish(self, outs: dict[Hashable, StepOutput]) -> dict[Hashable, StepOutput]:
        for sid, out in outs.items():
            if out.finished:
                self.cancel(sid)
        return outs

    # ---- shared pieces ---------------------------------------------------------------------
    def _meta(self, sts: list[Stream], q_lens: list[int], new: list[list[int]], mask):
        """Attention metadata; each stream's prefix slots come from the device slot table."""
        lens = [len(st.slots) for st in sts]
        prefix = self.slot_table.prefix([st.sid for st in sts], lens)  # [B, P]
        return block_meta(q_lens, prefix, new, mask, self.device, prefix_lens=lens)

    def _keep_slots(self, kept: list[tuple[Stream, list[int]]], written: bool = False) -> None:
        """Append committed slots to the streams' lists and, in one write, to the device table
        (unless `written`: the step queued that write already)."""
        items = []
        for st, slots in kept:
            items.append((st.sid, len(st.slots), slots))
            st.slots.extend(slots)
        if not written:
            self.slot_table.append(items)

    def _decode_forward(
        self, sts: list[Stream], q: int, new: list[list[int]], mask, ids, pos, pad_to: int = 0
    ):
        """The forward over q new rows per stream (AR: q = 1; `mask` [B, q, q] the rows'
        visibility within a block), by graph replay when enabled and the shape fits (the graph
        of at least `pad_to` blocks), else eagerly: (model output, the greedy token of each row,
        or None when eager). ids and pos [B * q]: host ints (the graph takes them in its one
        input copy) or tensors. `mask` may be None when q = 1 (a one-row block sees itself)."""
        if mask is None and q != 1:
            raise ValueError(f"a block of {q} rows needs its visibility mask")
        as_list = lambda x: x.tolist() if isinstance(x, torch.Tensor) else x  # noqa: E731
        if self._graphs is not None:
            res = self._graphs.run(
                as_list(ids), as_list(pos), self.slot_table.rows([st.sid for st in sts]),
                [len(st.slots) for st in sts], [s for block in new for s in block], mask, q,
                self.slot_table.table, tag=self.capture, pad_to=pad_to,
            )  # fmt: skip
            if res is not None:
                self.target_forwards += 1
                return res
        ids, pos = (torch.as_tensor(x, device=self.device) for x in (ids, pos))
        if mask is None:
            mask = torch.ones(len(sts), 1, 1, dtype=torch.bool)
        return self._forward(ids, pos, self._meta(sts, [q] * len(sts), new, mask)), None

    def _verify(
        self, sts: list[Stream], draft, rows, bonus: list[int], blocks, n: int, pad_to: int = 0
    ):
        """`verify_step` for these streams (their budget-n trees in `blocks`' slots) from the
        drafter's logits `draft`, or, when it is None, from its state `rows` (host ints; the
        draft then runs in the same graph): one graph replay when graphs are on and the shape
        fits, else eagerly. `bonus`: each stream's last committed token. Returns the packed
        acceptance, the accepted rows' hidden states, and whether the drafter has committed
        them already (inside the graph of a greedy batch: `Drafter.step_commits`)."""
        lens = [len(st.slots) for st in sts]
        select = lambda logits: self._sample(sts, logits)  # noqa: E731
        greedy = all(st.params.greedy for st in sts)
        if self._graphs is not None:
            out = self._graphs.run_verify(
                draft, rows, self.drafter, bonus, self.slot_table.rows([st.sid for st in sts]),
                lens, [s for b in blocks for s in b], n, self.slot_table.table, self.capture,
                commit=greedy, pad_to=pad_to,
            )  # fmt: skip
            if out is not None:
                res, committed = out
                self.target_forwards += 1
                if not greedy:
                    res = reselect(res, select)
                hidden = None if committed or res.hidden is None else res.hidden.clone()
                return res.packed, hidden, committed
        bonus_t = torch.tensor(bonus, device=self.device)  # [B]
        if draft is None:
            draft = self.drafter.draft_rows(torch.tensor(rows, device=self.device), bonus_t)

        def forward(ids, pos, visible):
            return self._forward(ids, pos, self._meta(sts, [n + 1] * len(sts), blocks, visible))

        prefix_lens = torch.tensor(lens, device=self.device)  # [B]
        res = verify_step(forward, select, draft, bonus_t, prefix_lens, n)
        return res.packed, res.hidden, False

    def _forward(self, ids, positions, meta, absorbed: bool = True, logit_rows=None):
        self.target_forwards += 1
        with backend.kernel_mode(self.kernels):
            return self.model(
                ids, positions, self.kv.pool, meta, self.capture, absorbed, logit_rows=logit_rows
            )

    def _sample(self, sts: list[Stream], logits: torch.Tensor) -> torch.Tensor:
        """logits [B, M, V] -> the target token at every row [B, M] (step = each stream's step)."""
        params = [st.params for st in sts]
        if all(p.greedy for p in params):  # argmax: no sampling inputs to send to the device
            return logits.argmax(dim=-1)
        b = len(sts)
        floats = self._sample_floats.put(
            [p.temperature for p in params] + [p.top_p for p in params]
        )
        ints = self._sample_ints.put(
            [p.top_k for p in params] + [st.seed for st in sts] + [st.steps for st in sts]
        )  # one copy each, no stream sync (`Staging`)
        temp, top_p = floats[:b], floats[b:]
        top_k, seeds, steps = ints[:b], ints[b : 2 * b], ints[2 * b :]
        return select_tokens(logits, temp, top_k, top_p, seeds, steps)

    def _active(self, sids: list[Hashable]) -> list[Stream]:
        sts = [self.streams[s] for s in sids]
        if not all(st.prefilled for st in sts):
            raise RuntimeError("every stream must be prefilled before decoding")
        return sts

    # ---- prefill ---------------------------------------------------------------------------
    @property
    def pending_prefill(self) -> list[Hashable]:
        return [sid for sid, st in self.streams.items() if not st.prefilled]

    def prefill(self, max_chunks: int | None = None) -> dict[Hashable, StepOutput]:
        """Prefill queued streams in forwards of at most `prefill_chunk` tokens; streams whose
        prompt completes emit their first token (sampling step 0)."""
        outs: dict[Hashable, StepOutput] = {}
        chunks = 0
        while self.pending_prefill and (max_chunks is None or chunks < max_chunks):
            outs.update(self._prefill_chunk())
            chunks += 1
        return self._finish(outs)

    def _prefill_chunk(self) -> dict[Hashable, StepOutput]:
        # A prompt is cut at multiples of prefill_chunk whatever else is pending (a chunk that
        # does not fit waits for the next forward), so its KV and first token do not depend on
        # the traffic it was admitted with (with batch-invariant kernels, bit for bit).
        budget, plan = self.cfg.prefill_chunk, []
        for sid in self.pending_prefill:
            st = self.streams[sid]
            done = len(st.slots)
            n = min(self.cfg.prefill_chunk, len(st.prompt) - done)
            if n > budget:
                break
            plan.append((st, done, n))
            budget -= n
            if budget == 0:
                break
        q_lens = [n for _, _, n in plan]
        new = self._alloc_scratch(q_lens)
        with self._free_on_error(new):
            ids = torch.tensor(
                [t for st, d, n in plan for t in st.prompt[d : d + n]], device=self.device
            )
            pos = torch.tensor([p for _, d, n in plan for p in range(d, d + n)], device=self.device)
            meta = self._meta([st for st, _, _ in plan], q_lens, new, causal_masks(q_lens))
            ends = (torch.tensor(q_lens).cumsum(0) - 1).to(self.device)  # [B] last row per block
            with backend.prefill_phase():
                out = self._forward(ids, pos, meta, absorbed=False, logit_rows=ends)  # [B, V]
        complete = [i for i, (st, d, n) in enumerate(plan) if d + n == len(st.prompt)]
        self._keep_slots([(st, slots) for (st, _, _), slots in zip(plan, new, strict=True)])
        self._prefill_hidden(plan, out.hidden, q_lens)
        if not complete:
            return {}
        sts = [plan[i][0] for i in complete]
        rows = torch.tensor(complete, device=self.device)
        first = self._sample(sts, out.logits[rows][:, None, :])[:, 0].tolist()  # one D2H copy
        outs = {}
        for st, tok in zip(sts, first, strict=True):
            if self.drafter is not None:
                hidden = torch.cat(st.prompt_hidden) if st.prompt_hidden else None
                self.drafter.add_stream(st.sid, st.prompt, hidden)
            st.prompt_hidden = []
            st.steps = 1
            outs[st.sid] = st.emit([tok])
        return outs

    def _prefill_hidden(self, plan, hidden: torch.Tensor | None, q_lens: list[int]) -> None:
        """Keep captured prompt hidden states until a stream's prompt is complete."""
        if hidden is not None:
            for (st, _, _), h in zip(plan, hidden.split(q_lens), strict=True):
                st.prompt_hidden.append(h)

    def _alloc_scratch(self, sizes: list[int]) -> list[list[int]]:
        """Slots for this forward's new tokens (within each stream's reservation), taken in one
        allocation: block b gets the next sizes[b] slots the pool hands out."""
        flat, blocks, i = self.allocator.alloc(sum(sizes)), [], 0
        for n in sizes:
            blocks.append(flat[i : i + n])
            i += n
        return blocks

    @contextmanager
    def _free_on_error(self, blocks: list[list[int]]) -> Iterator[None]:
        """If the forward (or sampling) raises, the step's new slots go back to the pool, so a
        failed step leaves the pool as it found it (streams keep their committed slots)."""
        try:
            yield
        except BaseException:
            for b in blocks:
                self.allocator.free(b)
            raise

    def _commit_context(self, sts: list[Stream], committed: list[list[int]], hidden) -> None:
        """The drafter's context: each stream's committed tokens, with their hidden states
        `hidden` [B, W, C] (row j of stream i: its j-th committed token) when the target
        captures any."""
        if hidden is None:
            self.drafter.commit_many([
                (st.sid, c, None) for st, c in zip(sts, committed, strict=True)
            ])  # fmt: skip
        else:
            self.drafter.commit_block([st.sid for st in sts], committed, hidden)

    # ---- decode ----------------------------------------------------------------------------
    @torch.no_grad()
    def ar_step(self, sids: list[Hashable], pad_to: int = 0) -> dict[Hashable, StepOutput]:
        """One target token per stream (q_len 1), through the same model and sampler. `pad_to`:
        replay the graph of at least this many streams (the shape a caller planned for more
        streams than it runs; padding rows cost compute, not a new capture)."""
        sts = self._active(sids)
        new = self._alloc_scratch([1] * len(sts))
        with self._free_on_error(new):
            ids = [st.output[-1] for st in sts]
            pos = [len(st.slots) for st in sts]
            out, greedy = self._decode_forward(sts, 1, new, None, ids, pos, pad_to)
            # The new slots' table write, queued behind the forward, which reads no table entry
            # at these positions: its host work overlaps the device's. A failed step leaves
            # entries past the streams' lengths, which nothing reads.
            self.slot_table.append([(st.sid, p, s) for st, p, s in zip(sts, pos, new, strict=True)])
            if greedy is not None and all(st.params.greedy for st in sts):
                toks = greedy.tolist()  # one D2H copy
            else:
                toks = self._sample(sts, out.logits[:, None, :])[:, 0].tolist()  # one D2H copy
            if self.drafter is not None:  # before any stream changes: a failure undoes the step
                hid = None if out.hidden is None else out.hidden[:, None]  # [B, 1, C]
                self._commit_context(sts, [[st.output[-1]] for st in sts], hid)
        outs = {}
        for st, tok in zip(sts, toks, strict=True):
            st.steps += 1
            st.committed.append(1)
            outs[st.sid] = st.emit([tok])
        self._keep_slots(list(zip(sts, new, strict=True)), written=True)
        return self._finish(outs)

    @torch.no_grad()
    def ddtree_step(
        self, sids: list[Hashable], budget: int | None = None, pad_to: int = 0
    ) -> dict[Hashable, StepOutput]:
        """Draft -> build -> verify (one forward over every stream's budget+1 nodes) -> accept
        -> commit (keep the root's and accepted nodes' slots, free the rest).

        `budget` (default: the engine's) lets the caller pick a tree size per batch bucket; it
        may not exceed the engine's budget, which admission reserved slots for. Budget 0 is the
        empty tree: verify the root alone, i.e. a plain `ar_step` (no draft), which the budget
        tuner picks where drafting does not pay. `pad_to` as in `ar_step`."""
        if self.drafter is None:
            raise RuntimeError("ddtree_step needs a drafter")
        n = self.cfg.budget if budget is None else budget
        if not 0 <= n <= self.cfg.budget:
            raise ValueError(f"budget must be in [0, {self.cfg.budget}], got {n}")
        if n == 0:
            return self.ar_step(sids, pad_to)
        sts = self._active(sids)
        bonus = [st.output[-1] for st in sts]
        rows = self.drafter.state_rows(list(sids)) if self._graphs is not None else None
        if rows is None:  # a drafter the verify graph cannot hold drafts eagerly
            draft = self.drafter.draft(list(sids), torch.tensor(bonus, device=self.device))
        else:
            draft = None
        blocks = self._alloc_scratch([n + 1] * len(sts))
        with self._free_on_error(blocks):
            packed_t, hidden, in_step = self._verify(sts, draft, rows, bonus, blocks, n, pad_to)
            try:
                packed = packed_t.tolist()  # the step's one D2H copy
                width = (len(packed[0]) - 1) // 2
                paths = [p[1 : 1 + p[0]] for p in packed]  # each stream's kept verify rows
                toks = [p[1 + width : 1 + width + p[0]] for p in packed]  # its committed tokens
                committed = [[st.output[-1]] + t[:-1] for st, t in zip(sts, toks, strict=True)]
                if in_step:  # the graph committed the drafter's context; the host catches up
                    self.drafter.advance(list(sids), committed)
                else:
                    self._commit_context(sts, committed, hidden)
            except BaseException:  # before any stream changes: a failure undoes the step
                if in_step:
                    self.drafter.rewind(list(sids))
                raise
        outs, kept_slots, dropped = {}, [], []
        for st, block, path, tk in zip(sts, blocks, paths, toks, strict=True):
            kept = set(path)
            dropped.append([s for r, s in enumerate(block) if r not in kept])
            kept_slots.append((st, [block[r] for r in path]))
            st.steps += 1
            st.committed.append(len(tk))
            outs[st.sid] = st.emit(tk, accepted_rows=tuple(path[1:]))
        # one free, the last stream's slots first: the next allocations hand out the last
        # stream's dropped slots first, each block's in row order
        self.allocator.free([s for d in reversed(dropped) for s in d])
        self._keep_slots(kept_slots)
        return self._finish(outs)
