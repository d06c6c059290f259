"""Timed runs of the engine benchmark: AR steps and DDTree steps over C prefilled streams.

All streams are prefilled once. Every run first rewinds its streams to the state right after
prefill (frees the slots committed since, truncates the output), so each configuration starts at
the same prefix without re-prefilling. The AR run over all streams also yields the greedy
continuation that the oracle drafter proposes in the DDTree runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from engine_probe import (
    Clock,
    RouteRecorder,
    capture_forward_inputs,
    graph_replay_seconds,
    split_seconds,
    stage_marks,
)

from ddserve.drafter.testing import OracleDrafter
from ddserve.engine.runner import ModelRunner
from ddserve.sampling import SamplingParams


class DeviceOracle(OracleDrafter):
    """OracleDrafter's proposals (same guesses, `corrupt` rule and `margin`) with the N(0, noise)
    logits drawn on the target's device: the parent draws them on the host, and its randn of
    [B, D, V] plus a 4*B*D*V-byte host-to-device copy would swamp the draft stage of a real
    drafter. One [B, D] tensor of guesses is copied per step. The noise comes from one device
    generator seeded with `seed`, so each stream's rows (and its tree's off-path tokens) differ
    and every rank, running the same steps, draws the same."""

    _gen: torch.Generator | None = None

    def draft(self, sids: list, bonus: torch.Tensor) -> torch.Tensor:
        dev = bonus.device
        if self._gen is None:
            self._gen = torch.Generator(device=dev).manual_seed(self.seed)
        guess = torch.tensor([self.guesses(s) for s in sids]).to(dev)[..., None]  # [B, D, 1]
        out = torch.randn(len(sids), self.depth, self.vocab_size, device=dev, generator=self._gen)
        margin = torch.full(guess.shape, self.margin, device=dev)  # [B, D, 1]
        return out.mul_(self.noise).scatter_add_(2, guess, margin)  # [B, D, V]


@dataclass
class RunResult:
    """Per timed step: seconds, tokens committed over all streams, committed-prefix tokens
    (KV slots every stream attends to), and per-layer distinct experts of its forward."""

    step_s: list[float] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)
    distinct: list[list[int]] = field(default_factory=list)
    routed_tokens: list[int] = field(default_factory=list)
    graph_forward_s: float | str | None = None
    split_s: dict[str, float] = field(default_factory=dict)
    matches_ar: float | None = None


class EngineBench:
    """The runner, its C_max prefilled streams, and the post-prefill state to rewind to."""

    def __init__(
        self, runner: ModelRunner, prompts: list[list[int]], max_tokens: int, graph_reps: int = 5
    ) -> None:
        self.runner, self.clock, self.graph_reps = runner, Clock(runner.device), graph_reps
        self.base_cfg = runner.cfg
        self.recorder = RouteRecorder(runner.model)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.sids = list(range(len(prompts)))
        for sid, prompt in zip(self.sids, prompts, strict=True):
            runner.add_stream(sid, prompt, params)
        a = self.clock.mark()
        runner.prefill()
        self.prefill_s = self.clock.seconds(a, self.clock.mark())
        self.prefill_tokens = sum(len(p) for p in prompts)
        self.snap = {s: (len(st.slots), len(st.output)) for s, st in runner.streams.items()}
        self.continuation: dict[tuple[int, ...], list[int]] = {}

    def rewind(self, sids: list[int]) -> None:
        """Back to the state right after prefill (KV of the prompt, first token emitted)."""
        for sid in sids:
            st = self.runner.streams[sid]
            n_slots, n_out = self.snap[sid]
            self.runner.allocator.free(st.slots[n_slots:])
            del st.slots[n_slots:], st.output[n_out:]
            st.steps, st.finished = 1, None
            st.committed.clear()

    def _step(self, step, sids: list[int], res: RunResult | None = None) -> tuple | None:
        """One engine step; with `res`, record it and return its (start, end) marks."""
        kv = sum(len(self.runner.streams[s].slots) for s in sids)
        a = self.clock.mark()
        outs = step(sids)
        b = self.clock.mark()
        if any(o.finished for o in outs.values()):
            raise RuntimeError("a stream finished mid-benchmark; raise max_tokens")
        if res is None:
            return None
        res.committed.append(sum(len(o.tokens) for o in outs.values()))
        res.kv_tokens.append(kv)
        return a, b

    def _timed(self, step, sids: list[int], warmup: int, steps: int) -> RunResult:
        res = RunResult()
        for _ in range(warmup):
            self._step(step, sids)
        sink: list = []
        self.recorder.clear()
        with self.recorder.active(), capture_forward_inputs(self.runner, sink):
            marks = [self._step(step, sids, res) for _ in range(steps)]
        res.step_s = [self.clock.seconds(a, b) for a, b in marks]  # one sync, after the run
        if self.runner._graphs is not None:  # replays run no Python hooks (and a capture sees
            self.recorder.clear()  # dummy inputs): one eager step gives the routing statistics
            graphs, self.runner._graphs = self.runner._graphs, None
            try:
                with self.recorder.active():
                    self._step(step, sids)
            finally:
                self.runner._graphs = graphs
        res.distinct, res.routed_tokens = self.recorder.distinct(), self.recorder.tokens()
        self.recorder.clear()
        if sink and self.graph_reps > 0:
            res.graph_forward_s = graph_replay_seconds(self.runner, sink[-1], self.graph_reps)
        return res

    def run_ar(self, sids: list[int], warmup: int, steps: int) -> RunResult:
        """`steps` timed AR steps after `warmup`; records each stream's greedy continuation."""
        self.rewind(sids)
        self.runner.drafter, self.runner.cfg = None, self.base_cfg
        res = self._timed(self.runner.ar_step, sids, warmup, steps)
        for sid in sids:
            st = self.runner.streams[sid]
            if len(st.output) > len(self.continuation.get(tuple(st.prompt), ())):
                self.continuation[tuple(st.prompt)] = list(st.output)
        return res

    def _oracle(self, sids: list[int], budget: int, oracle_kw: dict) -> None:
        self.rewind(sids)
        vocab = self.runner.model_cfg.vocab_size
        drafter = DeviceOracle(self.continuation, vocab, **oracle_kw)
        for sid in sids:
            drafter.add_stream(sid, self.runner.streams[sid].prompt, None)
        self.runner.drafter = drafter
        self.runner.cfg = replace(self.base_cfg, budget=budget)

    def run_ddtree(
        self, sids: list[int], budget: int, warmup: int, steps: int, split_steps: int, **oracle_kw
    ) -> RunResult:
        """Timed DDTree steps, then (from the same start) `split_steps` instrumented steps whose
        stage times are averaged into `split_s`."""
        self._oracle(sids, budget, oracle_kw)
        res = self._timed(self.runner.ddtree_step, sids, warmup, steps)
        res.matches_ar = self._match_fraction(sids)
        self._oracle(sids, budget, oracle_kw)
        for _ in range(split_steps):
            marks: list = []
            with stage_marks(self.runner, self.clock, marks):
                a = self.clock.mark()
                self.runner.ddtree_step(sids)
                b = self.clock.mark()
            for name, s in split_seconds(self.clock, a, marks, b).items():
                res.split_s[name] = res.split_s.get(name, 0.0) + s / split_steps
        self.runner.cfg = self.base_cfg
        return res

    def _match_fraction(self, sids: list[int]) -> float | None:
        """Fraction of the tokens DDTree emitted that equal the AR greedy continuation (1.0 is
        lossless; below means bf16 verify/AR differences flipped an argmax)."""
        same = total = 0
        for sid in sids:
            st = self.runner.streams[sid]
            cont = self.continuation.get(tuple(st.prompt), [])
            n = min(len(st.output), len(cont))
            same += sum(x == y for x, y in zip(st.output[1:n], cont[1:n], strict=True))
            total += max(n - 1, 0)
        return same / total if total else None
