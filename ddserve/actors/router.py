"""Router actor: the request queue, stream admission and the step loop over the shards.

The EngineClient seam as a Ray actor: `generate` (a streaming method), `abort`, `stats`.
Up to `max_streams` requests run at once and up to `max_queue` more wait: a request is refused
with QueueFull (the HTTP layer answers 429) only when `max_streams + max_queue` are held, counting
the streams decoding and the requests waiting (a waiting request moves into a free stream slot at
the next step, so a burst into an idle router fills the slots before it fills the queue).

A dedicated thread runs the step loop: each iteration sends one Command to every shard (cancel
aborted streams, admit queued ones, one prefill chunk, one decode step over the prefilled
streams) and hands each stream's new tokens to its request's asyncio queue on the actor's event
loop; idle, it sends an empty command every HEARTBEAT_S, so a dead shard is found without
traffic. A failing shard marks the router dead: in-flight and queued requests fail with
EngineDead at once, and so does every later request; `wait_failed` returns then (the replica's
supervisor waits on it to rebuild the tensor-parallel group, supervisor.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ddserve.actors.budget import BudgetTuner
from ddserve.actors.client import EngineDead, QueueFull, RequestRejected, TokenDelta
from ddserve.actors.shard import Command, CommandResult, ShardSpec
from ddserve.actors.startup import first_failure, one_line
from ddserve.actors.stats import EngineStats
from ddserve.actors.warmup import run_warmup, warmup_plan
from ddserve.engine.config import check_batching
from ddserve.sampling import SamplingParams

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # an idle step loop sends every shard an empty command this often


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The router's settings around the shards' `ShardSpec` (whose engine config holds the batch
    sizes and stream count the router schedules by). budgets: the tree budget of each bucket
    (None: the engine budget for all). A batch of n streams is padded to the smallest bucket
    >= n. budget_candidates: choose each bucket's budget online among these, by measured
    committed tokens per second (`BudgetTuner`)."""

    shard: ShardSpec
    speculative: bool = True
    max_queue: int = 64
    budgets: tuple[int, ...] | None = None
    budget_candidates: tuple[int, ...] | None = None
    control: str = "compiled"  # or "fanout"; see shard_group.py
    shard_cpus: float = 0.1
    step_timeout_s: float = 300.0
    placement_timeout_s: float = 600.0  # waiting for the shards' resources (autoscaling counts)
    warmup: bool = True  # run every step shape once before serving (warmup.py)
    warmup_max_prefix: int = 16384  # largest CUDA-graph prefix capacity the warm-up captures

    def __post_init__(self) -> None:
        if self.max_queue < 1:  # every request waits in the queue before it is admitted
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        engine = self.shard.engine
        check_batching(
            buckets=engine.graph_buckets, budget=engine.budget, num_slots=engine.num_slots,
            max_streams=engine.max_streams, budgets=self.budgets,
            budget_candidates=self.budget_candidates,
        )  # fmt: skip

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.shard.engine.graph_buckets

    @property
    def max_streams(self) -> int:
        return self.shard.engine.max_streams

    def bucket(self, n: int) -> tuple[int, int]:
        """(padded batch size, tree budget) for n active streams."""
        i = next(i for i, b in enumerate(self.buckets) if b >= n)
        return self.buckets[i], (self.budgets[i] if self.budgets else self.shard.engine.budget)


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    out: asyncio.Queue
    started: bool = False  # the prefill emitted its first token


@dataclass
class _Shared:
    """State the event loop and the step thread share (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)
    waiting: deque = field(default_factory=deque)  # _Request, arrival order
    aborted: set = field(default_factory=set)
    active: int = 0  # admitted streams (len of the Router's `_engine`, kept under the lock)


class Router:
    def __init__(self, cfg: RouterConfig, pg: Any) -> None:
        """`pg`: a ready placement group with one bundle per rank (`reserve_shards`)."""
        self.cfg, self._pg = cfg, pg
        self.info: dict = {}
        self._s = _Shared()
        self._engine: dict[str, _Request] = {}  # admitted streams (step thread only)
        self._stats = EngineStats()
        cands = cfg.budget_candidates
        self._tuner = BudgetTuner(cands) if cands and cfg.speculative else None
        self._kv_used = 0
        self._error: str | None = None
        self._stopping = False
        self._shards: list = []
        self._group = None
        self._warmup_shapes = 0

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> dict:
        """Place the shards in the placement group, wire their communicator, load the model,
        warm up every step shape, start the step loop. On failure, releases the shards and the
        placement group before raising."""
        try:
            return await self._start()
        except BaseException:
            self.shutdown()
            raise

    async def _start(self) -> dict:
        from ddserve.actors.shard_group import make_group

        t0 = time.perf_counter()
        self._shards = self._place_shards()
        comm_id = await first_failure(self._shards[0].make_comm_id.remote())
        t1 = time.perf_counter()
        infos = await first_failure(
            asyncio.gather(*[s.setup.remote(comm_id) for s in self._shards])
        )
        self.info = {**infos[0], "speculative": self.cfg.speculative and infos[0]["speculative"]}
        t2 = time.perf_counter()
        self._group = make_group(self.cfg.control, self._shards, self.cfg.step_timeout_s)
        if self.cfg.warmup:
            plan = warmup_plan(self.cfg, self.info)
            await asyncio.to_thread(run_warmup, self._group, plan, self.info["vocab_size"])
            self._warmup_shapes = plan.total
        t3 = time.perf_counter()
        log.info("router: shard processes up %.1f s, communicator and weights %.1f s, "
                 "control and warm-up %.1f s", t1 - t0, t2 - t1, t3 - t2)  # fmt: skip
        self._loop = asyncio.get_running_loop()
        self._failed = asyncio.Event()
        threading.Thread(target=self._step_loop, name="ddserve-step", daemon=True).start()
        return self.info

    def _place_shards(self) -> list:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ddserve.actors.shard import ShardWorker

        spec, gpu = self.cfg.shard, self.cfg.shard.device.startswith("cuda")
        actor = ray.remote(ShardWorker)
        return [
            actor.options(
                num_cpus=self.cfg.shard_cpus,
                num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i),
            ).remote(i, spec)
            for i in range(spec.world_size)
        ]

    async def wait_failed(self) -> str:
        """Returns (the error) once the step loop has failed; pending until then."""
        await self._failed.wait()
        return self._error or "the engine failed"

    async def pid(self) -> int:
        """This actor's process id (fault-injection tests and bench/recovery.py kill it)."""
        import os

        return os.getpid()

    async def shards(self) -> list:
        """The shard actor handles, in rank order (diagnostics and fault-injection tests)."""
        return list(self._shards)

    def shutdown(self) -> None:
        """Stop the step loop and release the shards (their devices) and the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._stopping = True
        self._s.wake.set()
        if self._group is not None:
            self._group.close()
        for s in self._shards:
            ray.kill(s)
        self._shards = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    # ---- EngineClient ----------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Streaming: an empty ack once queued, then deltas; the last has finish_reason."""
        req = _Request(request_id, list(prompt_ids), params, asyncio.Queue())
        with self._s.lock:
            if self._error:
                raise EngineDead(self._error)
            held = self._s.active + len(self._s.waiting)
            if held >= self.cfg.max_streams + self.cfg.max_queue:
                raise QueueFull(f"the server is at capacity ({held} requests in progress)", 1.0)
            self._s.waiting.append(req)
        self._s.wake.set()
        finished = False
        try:
            yield TokenDelta()
            while not finished:
                item = await req.out.get()
                tokens, reason = [], None
                while True:  # coalesce what is already there
                    if isinstance(item, Exception):
                        raise item
                    tokens += item.token_ids
                    reason = item.finish_reason
                    if reason is not None or req.out.empty():
                        break
                    item = req.out.get_nowait()
                finished = reason is not None
                yield TokenDelta(tokens, reason)
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        with self._s.lock:
            self._s.aborted.add(request_id)
        self._s.wake.set()

    async def stats(self) -> dict:
        with self._s.lock:
            queued = len(self._s.waiting)
        return {
            "healthy": self._error is None,
            "error": self._error,
            "queue_depth": queued,
            "active_streams": len(self._engine),
            "kv_slots_used": self._kv_used,
            "kv_slots_total": self.cfg.shard.engine.num_slots,
            "control": self.cfg.control,
            "bucket_budgets": self._bucket_budgets(),
            "warmup_shapes": self._warmup_shapes,
            **self._stats.snapshot(),
        }

    # ---- step loop (its own thread) --------------------------------------------------------
    def _step_loop(self) -> None:
        while not self._stopping:
            cmd = self._next_command()
            if cmd is None:
                if self._s.wake.wait(timeout=HEARTBEAT_S):
                    self._s.wake.clear()
                    continue
                cmd = Command()  # idle: an empty command finds a dead shard before a request does
            t0 = time.perf_counter()
            try:
                res = self._group.run(cmd)
            except Exception as e:  # noqa: BLE001 - any shard failure is fatal to the replica
                self._fail(e)
                return
            self._apply(cmd, res, time.perf_counter() - t0)

    def _next_command(self) -> Command | None:
        with self._s.lock:  # admission counts `active`: it changes with `_engine`, at once
            aborted, self._s.aborted = self._s.aborted, set()
            if aborted:
                self._s.waiting = deque(r for r in self._s.waiting if r.rid not in aborted)
            cancel = [rid for rid in aborted if self._engine.pop(rid, None) is not None]
            room = self.cfg.max_streams - len(self._engine)  # cancels run before admissions
            add = [self._s.waiting.popleft() for _ in range(min(room, len(self._s.waiting)))]
            step = [rid for rid, r in self._engine.items() if r.started]
            pending = len(step) < len(self._engine) or bool(add)
            self._engine.update((r.rid, r) for r in add)
            self._s.active = len(self._engine)
        if not (cancel or add or pending or step):
            return None
        bucket, budget = self.cfg.bucket(max(len(step), 1))
        if self._tuner is not None and step:
            # keyed by the real batch size: steps are not padded, so a bucket's batches differ
            budget = self._tuner.choose(len(step))
        return Command(
            cancel=tuple(cancel),
            add=tuple((r.rid, r.prompt, r.params) for r in add),
            prefill=pending,
            step=tuple(step),
            speculative=self.info["speculative"],
            bucket=bucket,
            budget=budget,
        )

    def _apply(self, cmd: Command, res: CommandResult, wall_s: float) -> None:
        for rid, reason in res.rejected.items():
            self._deliver(self._engine.pop(rid), RequestRejected(reason))
        if res.deferred:
            self._stats.deferred += len(res.deferred)
            back = [self._engine.pop(rid) for rid in res.deferred]
            with self._s.lock:
                self._s.waiting.extendleft(reversed(back))
        for rid, out in res.outputs.items():
            req = self._engine.get(rid)
            if req is None:
                continue  # cancelled meanwhile
            req.started = True
            self._deliver(req, TokenDelta(list(out.tokens), out.finished))
            if out.finished:
                del self._engine[rid]
        with self._s.lock:  # streams only left `_engine` above: `active` was never too low
            self._s.active = len(self._engine)
        self._kv_used = res.kv_slots_used
        if cmd.step:
            committed = sum(len(res.outputs[r].tokens) for r in cmd.step if r in res.outputs)
            self._stats.record_step(len(cmd.step), committed, wall_s, res.busy_s)
            if self._tuner is not None and cmd.speculative:
                per_stream = committed / len(cmd.step)
                self._tuner.record(len(cmd.step), cmd.budget, per_stream, res.step_s)

    def _bucket_budgets(self) -> dict[int, int]:
        """batch size -> the tree budget its steps use now: fixed per bucket (keyed by the bucket
        size), or the tuner's current choice (keyed by the batch sizes seen); {} without DDTree."""
        if not self.info.get("speculative"):
            return {}
        if self._tuner is not None:
            return self._tuner.snapshot()
        return {b: self.cfg.bucket(b)[1] for b in self.cfg.buckets}

    def _deliver(self, req: _Request, item: TokenDelta | Exception) -> None:
        self._loop.call_soon_threadsafe(req.out.put_nowait, item)

    def _fail(self, e: Exception) -> None:
        import ray

        with self._s.lock:  # what clients see; the details (actor ids, pids, ...) are logged
            self._error = "a tensor-parallel shard failed"
            doomed = list(self._engine.values()) + list(self._s.waiting)
            self._s.waiting.clear()
            self._engine.clear()
            self._s.active = 0
        log.error("router: a shard failed (%s); failing %d requests", one_line(e), len(doomed))
        for req in doomed:
            self._deliver(req, EngineDead(self._error))
        self._loop.call_soon_threadsafe(self._failed.set)
        self._group.close()
        for s in self._shards:  # release devices; survivors may be stuck in a collective
            ray.kill(s)
