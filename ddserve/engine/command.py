"""One scheduler iteration as a value: the `Command` the `Scheduler` plans, the `CommandResult`
rank 0 returns, and `apply_command`, which every rank's runner applies it with.

Every executor (the offline LLM's own runner, its gloo/NCCL worker processes, the serving Ray
shards) applies the same Command on every rank in the same order (cancel, admit, prefill,
decode step), so the ranks' collectives pair up and their bookkeeping stays identical.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddserve.engine.stream import StepOutput
from ddserve.kvcache import OutOfSlots
from ddserve.sampling import SamplingParams

if TYPE_CHECKING:
    from ddserve.engine.runner import ModelRunner

TOO_BIG = "request does not fit in the KV cache"  # how a rejection for size begins


@dataclass(frozen=True)
class Command:
    """One iteration. `cancel` runs first (its slots are free for this iteration's admissions);
    `add` streams are admitted in order; `prefill` runs up to `prefill_chunks` prompt chunks
    (None: every pending prompt to its end); `step` lists prefilled streams for one decode step:
    `speculative` picks ddtree_step over ar_step; `bucket`/`budget` are the padded batch size
    and its tree budget (0: the empty tree, a plain step, which the budget tuner picks where
    drafting does not pay). `planned_ahead`: planned before the results of earlier Commands
    were in (the Router keeps several in flight), so a `step` stream may have finished in one
    of them: the executor skips it and keeps the planned bucket's shape."""

    cancel: tuple[Hashable, ...] = ()
    add: tuple[tuple[Hashable, list[int], SamplingParams], ...] = ()
    prefill: bool = False
    step: tuple[Hashable, ...] = ()
    speculative: bool = False
    bucket: int = 0
    budget: int = 0
    prefill_chunks: int | None = 1
    planned_ahead: bool = False


@dataclass
class CommandResult:
    admitted: list[Hashable] = field(default_factory=list)
    rejected: dict[Hashable, str] = field(default_factory=dict)  # can never run: reason
    deferred: list[Hashable] = field(default_factory=list)  # out of KV slots for now: re-queue
    outputs: dict[Hashable, StepOutput] = field(default_factory=dict)
    step_s: float = 0.0  # time in the decode step
    busy_s: float = 0.0  # time in the whole command
    kv_slots_used: int = 0


def apply_command(runner: ModelRunner, cmd: Command) -> CommandResult:
    """Apply `cmd` to this rank's runner. In a Command `planned_ahead`, `step` streams the
    runner no longer holds (they finished in an earlier Command) are skipped, and the step keeps
    the planned bucket's graph. A stream that does not fit in the KV slots
    left is deferred, with every later one in `add` (arrival order is kept); one that does not
    fit in an empty engine, or that the runner refuses (ValueError), is rejected."""
    t0 = time.perf_counter()
    res = CommandResult()
    for sid in cmd.cancel:
        runner.cancel(sid)
    for i, (sid, prompt, params) in enumerate(cmd.add):
        try:
            runner.add_stream(sid, prompt, params)
            res.admitted.append(sid)
        except OutOfSlots as e:
            if not runner.streams:  # an empty engine cannot hold it: it never will
                res.rejected[sid] = f"{TOO_BIG}: {e}"
                continue
            res.deferred.extend(s for s, _, _ in cmd.add[i:])
            break
        except ValueError as e:
            res.rejected[sid] = str(e)
    if cmd.prefill:
        res.outputs.update(runner.prefill(max_chunks=cmd.prefill_chunks))
    step = list(cmd.step)
    if cmd.planned_ahead:  # streams that finished in an earlier Command: padding rows instead
        step = [sid for sid in step if sid in runner.streams]
    pad = cmd.bucket if len(step) < len(cmd.step) else 0  # the planned shape, already captured
    if step:
        t1 = time.perf_counter()
        if cmd.speculative:
            res.outputs.update(runner.ddtree_step(step, cmd.budget, pad))  # 0: plain step
        else:
            res.outputs.update(runner.ar_step(step, pad))
        res.step_s = time.perf_counter() - t1
    res.kv_slots_used = runner.cfg.num_slots - runner.free_slots
    res.busy_s = time.perf_counter() - t0
    return res
