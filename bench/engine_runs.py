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


class CostedOracle(DeviceOracle):
    """The oracle's proposals at a real drafter's cost: every step also runs a DFlash drafter
    (`dflash`, random weights, e.g. K2.5-DFlash's shapes sharded as one rank of tp = 8) exactly
    as the engine runs one: its block forward inside the verify graph (`state_rows` /
    `draft_rows`), the target's hidden states captured at its layers, its context commit of
    each step's tokens. The tree is built from the oracle's logits (`DeviceOracle`'s guesses
    and margin), to which the drafter's are added times 0 so that no compiler or graph could
    drop its work; the noise is one fixed N(0, noise) draw per stream row, so no generator runs
    inside the graph. Random drafter weights give a cost, never an acceptance."""

    def __init__(self, dflash, continuations, vocab_size: int, depth: int = 8, **kw) -> None:
        super().__init__(continuations, vocab_size, depth=depth, **kw)
        if dflash.depth != depth:
            raise ValueError(f"the drafter drafts {dflash.depth} depths, the oracle {depth}")
        self.dflash, self.capture_layers = dflash, dflash.capture_layers
        self.max_streams, self.pad_row = dflash.max_streams, dflash.pad_row
        dev, rows = dflash.cache.k.device, dflash.max_streams + 1  # + the padding blocks' row
        gen = torch.Generator(device=dev).manual_seed(self.seed)
        self._noise = torch.randn(rows, depth, vocab_size, device=dev, generator=gen)
        self._noise.mul_(self.noise)
        self._guess = torch.zeros(rows, depth, 1, dtype=torch.long, device=dev)

    def add_stream(self, sid, prompt_ids, hidden) -> None:
        super().add_stream(sid, prompt_ids, hidden)
        self.dflash.add_stream(sid, prompt_ids, hidden)

    def remove_stream(self, sid) -> None:
        super().remove_stream(sid)
        if sid in self.dflash.cache:  # another oracle's reset may have taken it already
            self.dflash.remove_stream(sid)

    def reset(self, continuations, **kw) -> None:
        """No streams, the oracle's proposals from `continuations` and `kw`: the same object,
        so the engine replays the verify graphs it captured with it (they are keyed by the
        drafter) instead of capturing new ones."""
        for sid in list(self._ctx):
            self.remove_stream(sid)
        OracleDrafter.__init__(self, continuations, self.vocab_size, **kw)

    def commit_many(self, items) -> None:
        for sid, token_ids, _ in items:
            self.commit(sid, token_ids, None)  # the oracle's token context
        self.dflash.commit_many(items)

    def commit_block(self, sids, token_ids, hidden) -> None:
        """The engine's call: the drafter's own block commit (a graph replay on CUDA)."""
        for sid, toks in zip(sids, token_ids, strict=True):
            self.commit(sid, toks, None)
        self.dflash.commit_block(sids, token_ids, hidden)

    @property
    def step_commits(self) -> bool:
        """The drafter's: its commit inside the verify graph, or its own graph after it."""
        return self.dflash.step_commits

    def commit_state(self, rows, hidden, counts) -> None:
        self.dflash.commit_state(rows, hidden, counts)

    def advance(self, sids, token_ids) -> None:
        for sid, toks in zip(sids, token_ids, strict=True):
            self.commit(sid, toks, None)  # the oracle's token context
        self.dflash.advance(sids, token_ids)

    def rewind(self, sids) -> None:
        self.dflash.rewind(sids)

    def close(self) -> None:
        self.dflash.close()

    def state_rows(self, sids: list) -> list[int]:
        """The drafter's rows; the streams' guesses go to the device now, one copy."""
        rows = self.dflash.state_rows(sids)
        guess = torch.tensor([self.guesses(s) for s in sids])[..., None]  # [B, D, 1]
        self._guess[rows] = guess.to(self._guess.device, non_blocking=True)
        return rows

    def draft_rows(self, rows: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        cost = self.dflash.draft_rows(rows, bonus)  # [B, D, V]
        out = self._noise.index_select(0, rows).add_(cost, alpha=0.0)
        margin = torch.full((rows.shape[0], self.depth, 1), self.margin, device=rows.device)
        return out.scatter_add_(2, self._guess.index_select(0, rows), margin)

    def draft(self, sids: list, bonus: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor(self.state_rows(sids), device=bonus.device)
        return self.draft_rows(rows, bonus)


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
        self,
        runner: ModelRunner,
        prompts: list[list[int]],
        max_tokens: int,
        graph_reps: int = 5,
        dflash=None,
    ) -> None:
        """`dflash`: a DFlashDrafter whose cost the DDTree runs pay (`CostedOracle`), or None
        (the oracle alone)."""
        self.runner, self.clock, self.graph_reps = runner, Clock(runner.device), graph_reps
        self.dflash, self._costed = dflash, {}
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
        if self.dflash is None:
            drafter = DeviceOracle(self.continuation, vocab, **oracle_kw)
        else:  # one per oracle setting, reset: its graphs are captured once
            key = tuple(sorted(oracle_kw.items()))
            drafter = self._costed.get(key)
            if drafter is None:
                drafter = CostedOracle(self.dflash, self.continuation, vocab, **oracle_kw)
                self._costed[key] = drafter
            drafter.reset(self.continuation, **oracle_kw)
            for sid in self.runner.streams:  # another setting's run left its context
                if sid in self.dflash.cache:
                    self.dflash.remove_stream(sid)
        for sid in sids:
            prompt = self.runner.streams[sid].prompt
            drafter.add_stream(sid, prompt, self._prompt_hidden(drafter, len(prompt)))
        self.runner.drafter = drafter
        self.runner.cfg = replace(self.base_cfg, budget=budget)

    def _prompt_hidden(self, drafter, n: int) -> torch.Tensor | None:
        """Random stand-ins for the prompt's captured hidden states (the streams were
        prefilled without a drafter), or None for a drafter that captures none."""
        if not drafter.capture_layers:
            return None
        width = len(drafter.capture_layers) * self.runner.model_cfg.hidden_size
        dtype = self.dflash.model.fc.weight.dtype
        return torch.randn(n, width, device=self.runner.device).to(dtype)

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
