"""Router actor: the request queue, stream admission and the step loop over the shards.

The EngineClient seam as a Ray actor: `submit` and `subscribe` (what `RayEngineClient.generate`
runs on), `abort`, `stats`. A caller (a Serve replica) holds one `subscribe` stream, and every
step's tokens for all of its requests come through it as one item: one Ray yield per step
whatever the stream count, where one streaming call per request cost a yield per request per
step (~0.13 ms of this actor's CPU each, `bench/ray_stream_cost.py`).

Up to `max_streams` requests run at once and up to `max_queue` more wait: a request is refused
with QueueFull (the HTTP layer answers 429) only when `max_streams + max_queue` are held, counting
the streams decoding and the requests waiting (a waiting request moves into a free stream slot at
the next step, so a burst into an idle router fills the slots before it fills the queue).

The requests are held by the engine's `Scheduler` (engine/scheduler.py, which the offline `LLM`
runs too): admission up to `max_streams`, deferral when the KV pool is full, cancellation,
finish handling and the decode step's tree budget (`BudgetPolicy`: fixed per bucket or tuned).
A dedicated thread runs the step loop: each iteration the Scheduler plans one Command, which
goes to every shard (cancel aborted streams, admit queued ones, one prefill chunk, one decode
step over the prefilled streams); the Scheduler takes rank 0's result, and the step's new tokens
go, in one hand-off to the actor's event loop, to the outbox of each request's subscriber. Up to
`pipeline` Commands are in flight (default 2): the next one is planned and sent while the shards
run the current one, which hides the Ray round trip and the loop's own work behind the step at
the cost of a padding row, for one step, per finished stream and of up to one step more before
a new request's prefill. Idle, it sends an empty command every HEARTBEAT_S, so a dead shard is
found without traffic. A failing shard marks the router dead: in-flight and queued requests fail
with EngineDead at once, and so does every later request; `wait_failed` returns then (the
replica's supervisor waits on it to rebuild the tensor-parallel group, supervisor.py).
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
from ddserve.engine.scheduler import BudgetPolicy, Request, Scheduler, StepReport
from ddserve.sampling import SamplingParams

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # an idle step loop sends every shard an empty command this often
HEARTBEAT = Command()  # that command (not the Scheduler's: its result goes to no request)


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
    pipeline: int = 2  # Commands in flight to the shards (1: send the next after each result)
    shard_cpus: float = 0.1
    step_timeout_s: float = 300.0
    placement_timeout_s: float = 600.0  # waiting for the shards' resources (autoscaling counts)
    warmup: bool = True  # run every step shape once before serving (warmup.py)
    warmup_max_prefix: int = 16384  # largest CUDA-graph prefix capacity the warm-up captures

    def __post_init__(self) -> None:
        if self.max_queue < 1:  # every request waits in the queue before it is admitted
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 1 <= self.pipeline <= 8:  # a compiled graph holds at most 10 executions
            raise ValueError(f"pipeline must be in [1, 8], got {self.pipeline}")
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
        return self.budget_policy().bucket(n)

    def budget_policy(self, tuner: BudgetTuner | None = None) -> BudgetPolicy:
        """The Scheduler's budget choice: each bucket's fixed budget, or `tuner`'s choice."""
        return BudgetPolicy(
            budget=self.shard.engine.budget, buckets=self.buckets, budgets=self.budgets,
            tuner=tuner,
        )  # fmt: skip


@dataclass
class _Outbox:
    """One subscriber's undelivered (request id, TokenDelta or EngineError) pairs, in order."""

    items: list = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Shared:
    """State the event loop and the step thread share (guarded by `lock`): the Scheduler, so
    admission's count (`held`) and the queue it counts change together."""

    sched: Scheduler
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)


class Router:
    def __init__(self, cfg: RouterConfig, pg: Any) -> None:
        """`pg`: a ready placement group with one bundle per rank (`reserve_shards`)."""
        self.cfg, self._pg = cfg, pg
        self.info: dict = {}
        cands = cfg.budget_candidates
        self._tuner = BudgetTuner(cands) if cands and cfg.speculative else None
        # speculative is set once the shards report whether they hold a drafter (`_start`)
        self._s = _Shared(Scheduler(cfg.max_streams, cfg.budget_policy(self._tuner), False))
        self._stats = EngineStats()
        self._kv_used = 0
        self._error: str | None = None
        self._stopping = False
        self._shards: list = []
        self._group = None
        self._warmup_shapes = 0
        self._outboxes: dict[str, _Outbox] = {}  # subscriber id -> outbox (event loop only)
        self._gone: set[str] = set()  # subscribers whose stream has ended

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
        self._s.sched.speculative = self.info["speculative"]
        self._group = make_group(self.cfg.control, self._shards, self.cfg.step_timeout_s)
        if self.cfg.warmup:
            plan = warmup_plan(self.cfg, self.info)
            await asyncio.to_thread(run_warmup, self._group, plan, self.info["vocab_size"])
            self._warmup_shapes = plan.total
        t3 = time.perf_counter()
        log.info("router: shard processes up %.1f s, communicator and weights %.1f s, "
                 "control and warm-up %.1f s", t1 - t0, t2 - t1, t3 - t2)  # fmt: skip
        self._begin_steps()
        return self.info

    def _begin_steps(self) -> None:
        """Start the step loop's thread over `self._group` (from the actor's event loop)."""
        self._loop = asyncio.get_running_loop()
        self._failed = asyncio.Event()
        self._thread = threading.Thread(target=self._step_loop, name="ddserve-step", daemon=True)
        self._thread.start()

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

    # ---- EngineClient (through RayEngineClient) --------------------------------------------
    async def subscribe(self, subscriber: str) -> AsyncIterator[list]:
        """Streaming: lists of (request id, TokenDelta or EngineError) for the requests
        `submit`ted with this subscriber id, in order; each list holds what arrived since the
        last (a step's tokens for every stream, or several steps' when the caller is slower).
        A request's last item carries finish_reason or is an error. Runs until the caller
        closes it; then its requests still held are aborted, and a later `submit` for it
        raises EngineDead."""
        box = self._outbox(subscriber)
        try:
            while True:
                await box.ready.wait()
                box.ready.clear()
                items, box.items = box.items, []
                yield items
        finally:
            self._gone.add(subscriber)
            self._outboxes.pop(subscriber, None)
            with self._s.lock:
                sched = self._s.sched
                for req in [*sched.active.values(), *sched.waiting]:
                    if req.sink == subscriber:
                        sched.abort(req.sid)
            self._s.wake.set()

    def _outbox(self, subscriber: str) -> _Outbox:
        box = self._outboxes.get(subscriber)
        if box is None:
            box = self._outboxes[subscriber] = _Outbox()
        return box

    async def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, subscriber: str
    ) -> None:
        """Queue a request whose tokens go to `subscriber`'s stream. Returns once queued (the
        admission ack); raises EngineDead or QueueFull instead."""
        req = Request(request_id, list(prompt_ids), params, sink=subscriber)
        if subscriber in self._gone:  # its stream has ended: nobody would read the tokens
            raise EngineDead("the request's token stream has closed")
        with self._s.lock:
            if self._error:
                raise EngineDead(self._error)
            held = self._s.sched.held
            if held >= self.cfg.max_streams + self.cfg.max_queue:
                raise QueueFull(f"the server is at capacity ({held} requests in progress)", 1.0)
            self._outbox(subscriber)  # before its stream may start
            self._s.sched.add(req)
        self._s.wake.set()

    async def abort(self, request_id: str) -> None:
        with self._s.lock:
            self._s.sched.abort(request_id)
        self._s.wake.set()

    async def stats(self) -> dict:
        with self._s.lock:
            queued, active = len(self._s.sched.waiting), len(self._s.sched.active)
        return {
            "healthy": self._error is None,
            "error": self._error,
            "queue_depth": queued,
            "active_streams": active,
            "kv_slots_used": self._kv_used,
            "kv_slots_total": self.cfg.shard.engine.num_slots,
            "control": self.cfg.control,
            "bucket_budgets": self._bucket_budgets(),
            "warmup_shapes": self._warmup_shapes,
            **self._stats.snapshot(),
        }

    # ---- step loop (its own thread) --------------------------------------------------------
    def _step_loop(self) -> None:
        # Up to cfg.pipeline Commands are in flight: the next is planned and sent while the
        # shards run the current one, so the Ray round trip and this loop's own work overlap
        # the shards' (a Command planned before the previous result is in may name a stream
        # that finished there; the shards skip it and keep the planned shape, `apply_command`;
        # and it admits nobody while an unapplied one admits, `Scheduler.plan`). A Command's
        # wall time is from when the shards could start it (it was sent, and the previous
        # result was in) to its result: back to back, the interval between results.
        inflight: deque[tuple[Command, object, float]] = deque()
        last = time.perf_counter()
        while not self._stopping:
            try:
                while len(inflight) < self.cfg.pipeline and not self._stopping:
                    cmd = self._next_command()
                    if cmd is None:
                        break
                    inflight.append((cmd, self._group.submit(cmd), time.perf_counter()))
                if not inflight:
                    if self._s.wake.wait(timeout=HEARTBEAT_S):
                        self._s.wake.clear()
                        continue
                    # idle: an empty command finds a dead shard before a request does
                    handle = self._group.submit(HEARTBEAT)
                    inflight.append((HEARTBEAT, handle, time.perf_counter()))
                cmd, handle, sent = inflight.popleft()
                res = self._group.result(handle)
            except Exception as e:  # noqa: BLE001 - any shard failure is fatal to the replica
                if not self._stopping:  # shutdown tears the group down under the loop
                    self._fail(e)
                return
            now = time.perf_counter()
            self._apply(cmd, res, now - max(sent, last))
            last = now

    def _next_command(self) -> Command | None:
        with self._s.lock:
            return self._s.sched.plan()

    def _apply(self, cmd: Command, res: CommandResult, wall_s: float) -> None:
        if cmd is HEARTBEAT:
            self._kv_used = res.kv_slots_used
            return
        with self._s.lock:  # deferred streams move from active back to the queue at once
            report: StepReport = self._s.sched.apply(cmd, res)
        items: list[tuple[Request, TokenDelta | Exception]] = [
            (req, RequestRejected(reason)) for req, reason in report.rejected
        ]
        self._stats.deferred += report.deferred
        items += [(req, TokenDelta(list(out.tokens), out.finished)) for req, out in report.outputs]
        self._deliver(items)
        self._kv_used = res.kv_slots_used
        if report.step_streams:
            self._stats.record_step(report.step_streams, report.committed, wall_s, res.busy_s)

    def _bucket_budgets(self) -> dict[int, int]:
        """batch size -> the tree budget its steps use now: fixed per bucket (keyed by the bucket
        size), or the tuner's current choice (keyed by the batch sizes seen); {} without DDTree."""
        if not self.info.get("speculative"):
            return {}
        if self._tuner is not None:
            return self._tuner.snapshot()
        return {b: self.cfg.bucket(b)[1] for b in self.cfg.buckets}

    def _deliver(self, items: list[tuple[Request, TokenDelta | Exception]]) -> None:
        """A step's items to their subscribers' outboxes: one hand-off to the event loop."""
        if items:
            batch = [(req.sink, req.sid, item) for req, item in items]
            self._loop.call_soon_threadsafe(self._post, batch)

    def _post(self, batch: list[tuple[str, str, TokenDelta | Exception]]) -> None:
        for subscriber, rid, item in batch:  # a subscriber that left: its requests were aborted
            box = self._outboxes.get(subscriber)
            if box is not None:
                box.items.append((rid, item))
                box.ready.set()

    def _fail(self, e: Exception) -> None:
        import ray

        with self._s.lock:  # what clients see; the details (actor ids, pids, ...) are logged
            self._error = "a tensor-parallel shard failed"
            doomed = self._s.sched.drain()
        log.error("router: a shard failed (%s); failing %d requests", one_line(e), len(doomed))
        self._deliver([(req, EngineDead(self._error)) for req in doomed])
        self._loop.call_soon_threadsafe(self._failed.set)
        self._group.close()
        for s in self._shards:  # release devices; survivors may be stuck in a collective
            ray.kill(s)
