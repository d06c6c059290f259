"""The Scheduler (engine/scheduler.py) with a fake executor: admission, deferral when the KV pool
is full, cancellation, finish handling and the decode step's budget. No model."""

from __future__ import annotations

from collections import deque

import pytest

from ddserve.engine.budget import BudgetTuner
from ddserve.engine.command import Command, CommandResult, apply_command
from ddserve.engine.scheduler import BudgetPolicy, Request, Scheduler, run_until_done
from ddserve.engine.stream import StepOutput
from ddserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=3)


class FakeExecutor:
    """A KV pool of `slots`: a stream holds `len(prompt)` slots from admission until it ends.
    Prefill emits token 0; each decode step emits one token per stream (two when speculative
    with a budget > 0), up to max_tokens."""

    def __init__(self, slots: int = 100) -> None:
        self.free, self.streams, self.commands, self.skipped = slots, {}, [], []

    def __call__(self, cmd: Command) -> CommandResult:
        self.commands.append(cmd)
        res = CommandResult()
        for sid in cmd.cancel:
            self._release(sid)
        for i, (sid, prompt, params) in enumerate(cmd.add):
            if len(prompt) > self.free:
                if not self.streams:
                    res.rejected[sid] = "too big"
                    continue
                res.deferred.extend(s for s, _, _ in cmd.add[i:])
                break
            self.free -= len(prompt)
            self.streams[sid] = [len(prompt), params.max_tokens, 0]
            res.admitted.append(sid)
        if cmd.prefill:
            for sid, st in self.streams.items():
                if st[2] == 0:
                    res.outputs[sid] = self._emit(sid, 1)
        per_step = 2 if cmd.speculative and cmd.budget > 0 else 1
        for sid in cmd.step:  # as `apply_command`: one that has left is skipped if planned ahead
            if sid in self.streams:
                res.outputs[sid] = self._emit(sid, per_step)
            elif cmd.planned_ahead:
                self.skipped.append(sid)
            else:
                raise KeyError(sid)
        for sid, out in res.outputs.items():
            if out.finished:
                self._release(sid)
        res.step_s = 0.01 if cmd.step else 0.0
        return res

    def _emit(self, sid, n: int) -> StepOutput:
        st = self.streams[sid]
        n = min(n, st[1] - st[2])
        st[2] += n
        return StepOutput(list(range(n)), "length" if st[2] >= st[1] else None)

    def _release(self, sid) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            self.free += st[0]


def _sched(max_streams: int = 2, **policy) -> Scheduler:
    return Scheduler(max_streams, BudgetPolicy(budget=8, **policy), speculative=True)


def _req(sid: str, prompt_len: int = 10, params: SamplingParams = GREEDY) -> Request:
    return Request(sid, [1] * prompt_len, params)


def _step(sched: Scheduler, ex: FakeExecutor):
    cmd = sched.plan()
    return cmd, (sched.apply(cmd, ex(cmd)) if cmd is not None else None)


def test_admits_up_to_max_streams_and_the_rest_wait_in_order() -> None:
    sched = _sched(max_streams=2)
    for sid in "abc":
        sched.add(_req(sid))
    cmd, _ = _step(sched, FakeExecutor())
    assert [a[0] for a in cmd.add] == ["a", "b"] and cmd.prefill and not cmd.step
    assert list(sched.active) == ["a", "b"] and [r.sid for r in sched.waiting] == ["c"]
    assert sched.held == 3


def test_streams_decode_from_the_iteration_after_their_first_token() -> None:
    sched, ex = _sched(), FakeExecutor()
    sched.add(_req("a"))
    _step(sched, ex)
    cmd, report = _step(sched, ex)
    assert cmd.step == ("a",) and not cmd.add and not cmd.prefill
    assert report.step_streams == 1 and report.committed == 2


def test_out_of_kv_slots_defers_to_the_front_of_the_queue_without_double_counting() -> None:
    sched, ex = _sched(max_streams=3), FakeExecutor(slots=25)
    for sid in "abc":
        sched.add(_req(sid))
    cmd, report = _step(sched, ex)  # a and b fit; c does not
    assert [a[0] for a in cmd.add] == ["a", "b", "c"]
    assert report.deferred == 1 and list(sched.active) == ["a", "b"]
    assert [r.sid for r in sched.waiting] == ["c"] and sched.held == 3
    sched.add(_req("d"))
    cmd, _ = _step(sched, ex)
    assert [a[0] for a in cmd.add] == ["c"]  # retried first, before later arrivals


def test_a_request_too_big_for_an_empty_engine_is_rejected() -> None:
    sched, ex = _sched(), FakeExecutor(slots=5)
    sched.add(_req("a"))
    _, report = _step(sched, ex)
    assert [(r.sid, why) for r, why in report.rejected] == [("a", "too big")]
    assert not sched.busy


def test_abort_cancels_before_admission_so_the_slot_is_reused_in_the_same_step() -> None:
    sched, ex = _sched(max_streams=1), FakeExecutor(slots=10)
    sched.add(_req("a"))
    sched.add(_req("b"))
    _step(sched, ex)
    sched.abort("a")
    cmd, report = _step(sched, ex)
    assert cmd.cancel == ("a",) and [a[0] for a in cmd.add] == ["b"] and report.deferred == 0
    assert list(sched.active) == ["b"] and sched.held == 1


def test_abort_of_a_waiting_request_drops_it_without_a_cancel() -> None:
    sched = _sched(max_streams=1)
    for sid in "ab":
        sched.add(_req(sid))
    sched.abort("b")
    cmd, _ = _step(sched, FakeExecutor())
    assert cmd.cancel == () and not sched.waiting and sched.held == 1


def test_outputs_after_an_abort_are_dropped() -> None:
    sched, ex = _sched(), FakeExecutor()
    sched.add(_req("a"))
    cmd = sched.plan()
    res = ex(cmd)
    sched.abort("a")
    sched.plan()  # the abort is taken before the result comes back
    assert sched.apply(cmd, res).outputs == []


def test_finished_streams_leave_and_free_room() -> None:
    sched, ex = _sched(max_streams=1), FakeExecutor()
    sched.add(_req("a", params=SamplingParams(max_tokens=1)))
    sched.add(_req("b"))
    _, report = _step(sched, ex)
    assert [(r.sid, o.finished) for r, o in report.outputs] == [("a", "length")]
    assert not sched.active
    cmd, _ = _step(sched, ex)
    assert [a[0] for a in cmd.add] == ["b"]


def test_fixed_budget_per_bucket() -> None:
    policy = BudgetPolicy(budget=8, buckets=(1, 2, 4), budgets=(8, 6, 4))
    assert [policy.bucket(n) for n in (1, 2, 3, 4)] == [(1, 8), (2, 6), (4, 4), (4, 4)]
    assert BudgetPolicy(budget=8).bucket(3) == (3, 8)


def test_the_tuner_chooses_by_batch_size_and_records_speculative_steps() -> None:
    tuner = BudgetTuner((4, 8), warmup=1)
    sched, ex = _sched(tuner=tuner), FakeExecutor()
    sched.add(_req("a", params=SamplingParams(max_tokens=20)))
    _step(sched, ex)
    cmd, _ = _step(sched, ex)
    assert cmd.budget == 8  # warm-up: the largest candidate first
    cmd, _ = _step(sched, ex)
    assert cmd.budget == 4
    assert tuner.rates(1)[8] > 0 and tuner.rates(1)[4] > 0


def test_greedy_only_tuning_gives_sampled_batches_the_fixed_budget() -> None:
    tuner = BudgetTuner((4,), warmup=1)
    sched, ex = _sched(tuner=tuner, greedy_only=True), FakeExecutor()
    sched.add(_req("a", params=SamplingParams(max_tokens=20, temperature=1.0, seed=1)))
    _step(sched, ex)
    cmd, _ = _step(sched, ex)
    assert cmd.budget == 8 and tuner.rates(1) == {0: 0.0, 4: 0.0}


def test_run_until_done_admits_then_prefills_then_steps_the_started_streams() -> None:
    sched, ex = Scheduler(2, BudgetPolicy(budget=0), False, prefill_chunks=None), FakeExecutor()
    for sid in "abc":
        sched.add(_req(sid))
    got: dict[str, int] = {}

    def collect(cmd, report) -> None:
        for req, out in report.outputs:
            got[req.sid] = got.get(req.sid, 0) + len(out.tokens)

    run_until_done(sched, ex, collect)
    assert got == {"a": 3, "b": 3, "c": 3} and not ex.streams
    admit, prefill, step = ex.commands[:3]
    assert admit.add and not admit.prefill and not admit.step  # refusals surface before a forward
    assert prefill.prefill and prefill.prefill_chunks is None and not prefill.add
    assert step.step == ("a", "b") and not step.add  # started by the prefill just before


def test_run_until_done_reports_a_refused_request_before_any_prefill() -> None:
    sched, ex = Scheduler(2, BudgetPolicy(budget=0), False, prefill_chunks=None), FakeExecutor()
    sched.add(_req("a", prompt_len=500))  # more than the whole pool: refused
    sched.add(_req("b"))

    def refuse(cmd, report) -> None:
        if report.rejected:
            raise ValueError(report.rejected[0][1])

    with pytest.raises(ValueError):
        run_until_done(sched, ex, refuse)
    assert not any(c.prefill for c in ex.commands)  # nothing was computed for "b"


def test_no_prefill_is_planned_once_every_stream_has_its_first_token() -> None:
    sched, ex = _sched(), FakeExecutor()
    sched.add(_req("a"))
    _step(sched, ex)
    assert sched.plan(step=False) is None


@pytest.mark.parametrize("lag", [2, 3])
def test_commands_planned_before_earlier_results_lose_nothing_and_emit_nothing_extra(lag) -> None:
    """The Router keeps `lag` Commands in flight: each is planned before the results of the
    ones ahead of it are applied (the executor runs them in order as they are sent). Streams
    that finish in a result the next plan did not see are skipped by the executor; every
    stream still gets exactly max_tokens, and a step counts only the streams it ran."""
    sched, ex = _sched(max_streams=3), FakeExecutor(slots=40)
    lengths = {"a": 2, "b": 7, "c": 4, "d": 5, "e": 3}
    for sid in "abcd":  # d waits: at most 3 streams
        sched.add(_req(sid, params=SamplingParams(max_tokens=lengths[sid])))
    got: dict[str, int] = {}
    finished: list[str] = []
    inflight: deque = deque()
    for it in range(100):
        if it == 3:
            sched.add(_req("e", params=SamplingParams(max_tokens=lengths["e"])))
        while len(inflight) < lag and (cmd := sched.plan()) is not None:
            inflight.append((cmd, ex(cmd)))  # sent: the executor runs it now
        if not inflight:
            break
        cmd, res = inflight.popleft()
        report = sched.apply(cmd, res)
        for req, out in report.outputs:
            assert req.sid not in finished  # nothing after a stream's last token
            got[req.sid] = got.get(req.sid, 0) + len(out.tokens)
            if out.finished:
                finished.append(req.sid)
        assert report.step_streams == sum(1 for s in cmd.step if s in res.outputs)
    assert got == lengths and sorted(finished) == sorted(lengths)
    assert not sched.busy and not ex.streams and ex.free == 40
    assert ex.skipped  # some were planned past their last token, and skipped


def test_a_command_planned_before_the_last_result_is_marked_planned_ahead() -> None:
    sched, ex = _sched(), FakeExecutor()
    sched.add(_req("a", params=SamplingParams(max_tokens=10)))
    first = sched.plan()
    second = sched.plan()
    assert not first.planned_ahead and second.planned_ahead
    sched.apply(first, ex(first))
    sched.apply(second, ex(second))
    assert not sched.plan().planned_ahead  # everything planned was applied


def test_a_deferred_stream_is_admitted_before_later_arrivals_with_commands_in_flight() -> None:
    """Out of KV slots, x is deferred by the Command that admits it; the Command planned while
    that one is in flight admits nobody, so y (arrived later) cannot take the slots first."""
    sched, ex = _sched(max_streams=3), FakeExecutor(slots=25)
    sched.add(_req("a", prompt_len=15, params=SamplingParams(max_tokens=2)))
    sched.add(_req("x", prompt_len=15))
    first = sched.plan()  # admits a and x; x will not fit while a holds 15 of 25 slots
    sched.add(_req("y", prompt_len=5))
    second = sched.plan()  # planned ahead of first's result
    assert [s for s, _, _ in first.add] == ["a", "x"] and not second.add
    order: list[str] = []
    inflight = [(first, ex(first)), (second, ex(second))]
    while inflight:
        cmd, res = inflight.pop(0)
        order += res.admitted
        sched.apply(cmd, res)
        if (nxt := sched.plan()) is not None:
            inflight.append((nxt, ex(nxt)))
    assert order == ["a", "x", "y"]


class _Runner:
    """What `apply_command` reads of a ModelRunner, recording each decode step's arguments."""

    def __init__(self, streams) -> None:
        self.streams = dict.fromkeys(streams)
        self.cfg, self.free_slots, self.steps = type("Cfg", (), {"num_slots": 100}), 100, []

    def prefill(self, max_chunks=None):
        return {}

    def ddtree_step(self, sids, budget, pad_to=0):
        self.steps.append(("ddtree", sids, budget, pad_to))
        return self._out(sids)

    def ar_step(self, sids, pad_to=0):
        self.steps.append(("ar", sids, pad_to))
        return self._out(sids)

    def _out(self, sids):
        for s in sids:  # as `ModelRunner._active`: stepping a stream it does not hold fails
            if s not in self.streams:
                raise KeyError(s)
        return {s: StepOutput([1], None) for s in sids}


def test_apply_command_skips_finished_streams_only_when_planned_ahead_keeping_the_bucket() -> None:
    runner = _Runner(["a", "c"])  # "b" finished in an earlier Command
    plan = dict(step=("a", "b", "c"), speculative=True, bucket=4, budget=6)
    res = apply_command(runner, Command(**plan, planned_ahead=True))
    assert runner.steps == [("ddtree", ["a", "c"], 6, 4)]  # padded to the planned bucket
    assert set(res.outputs) == {"a", "c"}
    apply_command(runner, Command(step=("a", "c"), bucket=2, planned_ahead=True))
    assert runner.steps[-1] == ("ar", ["a", "c"], 0)  # nothing skipped: its own bucket
    with pytest.raises(KeyError):  # not planned ahead: a missing stream is a bug, not skipped
        apply_command(runner, Command(**plan))
