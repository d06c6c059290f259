"""The scheduler both front ends run: the offline `LLM` and the serving `Router`.

A `Scheduler` owns the requests: those waiting (arrival order) and the admitted streams. Each
iteration it plans one `Command` (cancel aborted streams, admit waiting ones up to `max_streams`,
prefill, one decode step over the streams that have their first token, at the tree budget its
`BudgetPolicy` picks) and then applies the executor's `CommandResult`: rejected streams leave,
deferred ones (out of KV slots for now) go back to the front of the queue, finished ones leave.
It never runs a model: an executor applies the plan on every rank (`command.apply_command`
through the LLM's runner or its TP workers, or the Router's Ray shards).

The Scheduler is plain state with no lock of its own: the Router calls it under its lock (so
the admission count, `held`, and the queue always change together), the LLM from one thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ddserve.engine.budget import BudgetTuner, tokens_at_budgets
from ddserve.engine.command import Command, CommandResult
from ddserve.engine.stream import StepOutput
from ddserve.sampling import SamplingParams


@dataclass
class Request:
    """One request the scheduler holds. `sink`: where its caller delivers its tokens (the
    Router: its subscriber's id; offline: the GenerationOutput)."""

    sid: Hashable
    prompt: list[int]
    params: SamplingParams
    sink: Any = None
    started: bool = False  # the prefill emitted its first token: it decodes from now on


@dataclass
class BudgetPolicy:
    """The decode step's tree budget. Fixed: `budgets[i]` for batches padded to `buckets[i]`
    (None: `budget` for all). Tuned: `tuner.choose(batch size)`, each speculative step recorded
    back (tokens per stream, step seconds). `greedy_only`: batches with a sampled stream use the
    fixed budget (a sample depends on the tree's shape; the offline API keeps seeded samples
    reproducible). `depth`: the drafter's depth, for paired records (what every smaller
    candidate would have committed in the same step, and whether a tree was accepted to its
    full depth); None records the step's own figures only."""

    budget: int
    buckets: tuple[int, ...] = ()
    budgets: tuple[int, ...] | None = None
    tuner: BudgetTuner | None = None
    greedy_only: bool = False
    depth: int | None = None

    def bucket(self, n: int) -> tuple[int, int]:
        """(padded batch size, fixed tree budget) for n streams; unpadded without buckets."""
        if not self.buckets:
            return n, self.budget
        i = next(i for i, b in enumerate(self.buckets) if b >= n)
        return self.buckets[i], (self.budgets[i] if self.budgets else self.budget)

    def choose(self, streams: list[Request]) -> tuple[int, int]:
        """(bucket, budget) for a decode step over `streams` (at least one)."""
        bucket, budget = self.bucket(len(streams))
        if self._tuned(streams):
            # keyed by the real batch size: steps are not padded, so a bucket's batches differ
            budget = self.tuner.choose(len(streams))
        return bucket, budget

    def record(self, streams: list[Request], cmd: Command, res: CommandResult) -> None:
        """The step of `cmd` over `streams` (those it ran: fewer than `cmd.step` when some had
        finished in a result the plan did not see), under the batch size it was chosen for."""
        if not cmd.speculative or not self._tuned(streams):
            return
        outs = [res.outputs[r.sid] for r in streams if r.sid in res.outputs]
        per_stream = sum(len(o.tokens) for o in outs) / len(streams)
        n = len(cmd.step)
        if self.depth is None:
            self.tuner.record(n, cmd.budget, per_stream, res.step_s)
            return
        tokens_at = tokens_at_budgets(outs, cmd.budget, self.tuner.candidates)
        full = min(cmd.budget, self.depth)  # the deepest node a budget-b tree has
        saturated = cmd.budget > 0 and any(len(o.accepted_rows) >= full for o in outs)
        self.tuner.record(n, cmd.budget, per_stream, res.step_s, tokens_at, saturated)

    def _tuned(self, streams: list[Request]) -> bool:
        if self.tuner is None:
            return False
        return not self.greedy_only or all(r.params.greedy for r in streams)


@dataclass
class StepReport:
    """What one applied Command did, for the caller to deliver and count. `outputs` and
    `rejected` are in the order the result gave them, for streams still held; `finished`
    streams have left the scheduler."""

    outputs: list[tuple[Request, StepOutput]] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)
    deferred: int = 0
    step_streams: int = 0  # streams in the decode step (0: no step)
    committed: int = 0  # tokens the decode step emitted


class Scheduler:
    def __init__(
        self,
        max_streams: int,
        policy: BudgetPolicy,
        speculative: bool,
        prefill_chunks: int | None = 1,
    ) -> None:
        self.max_streams, self.policy, self.speculative = max_streams, policy, speculative
        self.prefill_chunks = prefill_chunks
        self.waiting: deque[Request] = deque()
        self.active: dict[Hashable, Request] = {}  # admitted, in admission order
        self._aborted: set[Hashable] = set()
        # Commands planned and not yet applied, and those of them that admit streams (the
        # Router keeps several in flight; the LLM applies each before the next plan)
        self._unapplied = 0
        self._adds_unapplied = 0

    @property
    def held(self) -> int:
        """Requests held: admitted streams plus waiting ones (admission control counts this)."""
        return len(self.active) + len(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, sid: Hashable) -> None:
        """Drop `sid` at the next plan: from the queue, or cancelled on the executor (its slots
        free before that iteration's admissions). Unknown ids are ignored."""
        self._aborted.add(sid)

    def drain(self) -> list[Request]:
        """Every request held (admitted, then waiting), which the scheduler forgets."""
        doomed = [*self.active.values(), *self.waiting]
        self.active.clear()
        self.waiting.clear()
        self._aborted.clear()
        self._unapplied = self._adds_unapplied = 0
        return doomed

    def plan(self, admit: bool = True, prefill: bool = True, step: bool = True) -> Command | None:
        """The next Command (None: nothing to do). Aborts always apply; `admit`, `prefill`,
        `step` pick the iteration's other parts (the Router plans all in one Command; the LLM
        plans admission, then prefill, then a step over the streams that prefill started).
        Planned while an earlier Command is unapplied, the Command is `planned_ahead`, and it
        admits nobody while an unapplied one admits: a stream that one defers (out of KV slots)
        goes back to the front of the queue, ahead of every later arrival."""
        aborted, self._aborted = self._aborted, set()
        if aborted:
            self.waiting = deque(r for r in self.waiting if r.sid not in aborted)
        cancel = [sid for sid in aborted if self.active.pop(sid, None) is not None]
        add: list[Request] = []
        if admit and not self._adds_unapplied:  # cancels run before admissions: their room counts
            room = self.max_streams - len(self.active)
            add = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        started = [r for r in self.active.values() if r.started]
        pending = prefill and (len(started) < len(self.active) or bool(add))
        stepping = started if step else []
        self.active.update((r.sid, r) for r in add)
        if not (cancel or add or pending or stepping):
            return None
        bucket, budget = self.policy.choose(stepping) if stepping else self.policy.bucket(1)
        ahead = self._unapplied > 0
        self._unapplied += 1
        self._adds_unapplied += bool(add)
        return Command(
            cancel=tuple(cancel),
            add=tuple((r.sid, r.prompt, r.params) for r in add),
            prefill=pending,
            step=tuple(r.sid for r in stepping),
            speculative=self.speculative,
            bucket=bucket,
            budget=budget,
            prefill_chunks=self.prefill_chunks,
            planned_ahead=ahead,
        )

    def apply(self, cmd: Command, res: CommandResult) -> StepReport:
        """Take the executor's result: rejected streams leave, deferred ones go back to the
        front of the queue (in arrival order), outputs mark streams started and finished ones
        leave; a decode step is recorded to the budget policy."""
        report = StepReport()
        self._unapplied -= 1
        self._adds_unapplied -= bool(cmd.add)
        for sid, reason in res.rejected.items():
            if (req := self.active.pop(sid, None)) is not None:
                report.rejected.append((req, reason))
        back = [r for sid in res.deferred if (r := self.active.pop(sid, None)) is not None]
        self.waiting.extendleft(reversed(back))
        report.deferred = len(res.deferred)
        # the streams the step ran (one that finished in an earlier result has left `active`)
        stepped = [self.active[s] for s in cmd.step if s in self.active and s in res.outputs]
        for sid, out in res.outputs.items():
            req = self.active.get(sid)
            if req is None:
                continue  # aborted meanwhile
            req.started = True
            report.outputs.append((req, out))
            if out.finished:
                del self.active[sid]
        if stepped:
            report.step_streams = len(stepped)
            report.committed = sum(len(res.outputs[r.sid].tokens) for r in stepped)
            self.policy.record(stepped, cmd, res)
        return report


def run_until_done(scheduler: Scheduler, execute, on_report) -> None:
    """The offline loop: admission, then the prefill of the streams admitted, then a decode
    step over the streams started, until nothing is held. Admission runs alone so that a
    request the engine refuses is reported (and `on_report` may raise) before any forward.
    `execute(cmd) -> CommandResult`; `on_report(cmd, report)`."""
    phases = (
        {"step": False, "prefill": False},
        {"admit": False, "step": False},
        {"admit": False, "prefill": False},
    )
    while scheduler.busy:
        for kwargs in phases:
            cmd = scheduler.plan(**kwargs)
            if cmd is not None:
                on_report(cmd, scheduler.apply(cmd, execute(cmd)))
