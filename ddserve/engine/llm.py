"""Offline generation API (`from ddserve import LLM, SamplingParams`) and `ddserve generate`."""

from __future__ import annotations

import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddserve.drafter.base import Drafter
from ddserve.engine.budget import BudgetTuner, default_candidates
from ddserve.engine.command import TOO_BIG, Command, CommandResult, apply_command
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.engine.scheduler import BudgetPolicy, Request, Scheduler, StepReport, run_until_done
from ddserve.kvcache import OutOfSlots
from ddserve.sampling import SamplingParams

log = logging.getLogger(__name__)

_ENGINE = EngineConfig()  # the LLM's defaults are the engine's, except:
# a smaller KV pool than a serving replica's: the offline API runs one-off batches, often on a
# laptop's CPU or a single GPU beside other work, and the pool is allocated in full up front
OFFLINE_NUM_SLOTS = 4096


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


def _load_tokenizer(path: Path):
    from ddserve.tokenizer import Tokenizer, has_tokenizer

    return Tokenizer.from_dir(path) if has_tokenizer(path) else None


class LLM:
    """Offline engine. `drafter` is a Drafter instance or a DFlash drafter directory; without one,
    generation is autoregressive. `LLM()` runs the embedded pair (target and drafter). tp > 1
    runs ranks 1.. in spawned gloo worker processes. dtype "auto": float32 on the CPU, bfloat16
    on GPUs (`engine.config.resolve_dtype`).

    Greedy speculative steps pick their tree budget online (`tune_budget`, default on): a
    `BudgetTuner` over plain decoding (budget 0) and `default_candidates(budget)` measures
    committed tokens per second per batch size, so each batch size runs the fastest choice on
    this machine and falls back to plain decoding where no tree pays. The tuner lives as long as
    the LLM (later calls start from what earlier ones measured). Greedy output is the same
    whatever it picks; batches with a sampled stream (temperature > 0) use `budget`, since a
    sample depends on the tree's shape and a seed should give the same text every time.
    `tune_budget=False`: every speculative step uses `budget`."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        drafter: Drafter | str | Path | None = None,
        tp: int = 1,
        budget: int = _ENGINE.budget,
        device: str | None = None,
        num_slots: int = OFFLINE_NUM_SLOTS,
        dtype: str = _ENGINE.dtype,
        prefill_chunk: int = _ENGINE.prefill_chunk,
        max_streams: int = _ENGINE.max_streams,
        seed: int | None = None,
        batch_invariant: bool = _ENGINE.batch_invariant,
        cuda_graphs: bool = _ENGINE.cuda_graphs,
        tune_budget: bool = True,
        cpu_threads: int | None = _ENGINE.cpu_threads,
    ) -> None:
        if model_path is None:  # the embedded pair: its target and, unless given, its drafter
            from ddserve.model.tiny import default_model_dir

            model_path = default_model_dir()
            drafter = drafter if drafter is not None else model_path / "drafter"
        self.model_path = Path(model_path)
        seed = random.randrange(2**31) if seed is None else seed
        cfg = EngineConfig(
            num_slots=num_slots,
            budget=budget,
            prefill_chunk=prefill_chunk,
            dtype=dtype,
            seed=seed,
            max_streams=max_streams,
            batch_invariant=batch_invariant,
            cuda_graphs=cuda_graphs,
            cpu_threads=cpu_threads,
        )
        kwargs = dict(model_path=self.model_path, engine_cfg=cfg, drafter=drafter, device=device)
        self.max_streams, self.tp, self._next_sid = max_streams, tp, 0
        self._group = None
        if tp > 1:
            from ddserve.engine.tp import TPGroup

            self._group = TPGroup(tp, kwargs)
            self.runner = self._group.runner
        else:
            self.runner = ModelRunner(**kwargs)
        self.tokenizer = _load_tokenizer(self.model_path)
        self.tuner = offline_tuner(budget) if tune_budget else None

    @property
    def free_slots(self) -> int:
        return self.runner.free_slots

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A text prompt's ids as the HTTP completions API builds them (`encode_prompt`); token
        ids as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"no tokenizer in {self.model_path}; pass token ids")
            from ddserve.tokenizer import encode_prompt

            return encode_prompt(self.tokenizer, prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: bool = True,
        budget: int | None = None,
    ) -> list[GenerationOutput]:
        """One output per prompt, in order. Streams are admitted up to max_streams at a time and
        as KV slots allow; DDTree steps when speculative and a drafter is set, else AR steps.
        `budget`: this call's tree budget for every speculative step (0: plain steps), instead
        of the tuner's choice (or the engine's budget without a tuner)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        outs = [GenerationOutput(self.encode(p)) for p in prompts]
        for o in outs:
            o.stats.update(steps=0, mean_committed=0.0, committed_per_step=[], budget_per_step=[])
        if speculative and self.runner.drafter is None:
            log.warning("generate(speculative=True) without a drafter: decoding autoregressively")
        spec = speculative and self.runner.drafter is not None
        forwards0 = self.runner.target_forwards
        sched = Scheduler(self.max_streams, self._policy(spec, budget), spec, prefill_chunks=None)
        for o, p in zip(outs, plist, strict=True):
            sched.add(Request(self._new_sid(), o.prompt_token_ids, p, sink=o))
        try:
            run_until_done(sched, self._execute, _collect)
        finally:  # an error leaves no stream behind (a rejected request raises mid-batch)
            if sched.active:
                self._execute(Command(cancel=tuple(sched.active)))
        forwards = self.runner.target_forwards - forwards0
        for o in outs:
            o.stats["target_forwards"] = forwards
            if self.tokenizer is not None:
                o.text = self.tokenizer.decode(o.token_ids)
        return outs

    def _policy(self, speculative: bool, budget: int | None) -> BudgetPolicy:
        """Plain steps when not speculative; else `budget` if given, else the tuner's choice
        (or the engine's budget without a tuner). A sampled stream's tokens depend on the tree
        (lossless in distribution, not token for token), so only greedy batches are tuned:
        seeded sampling stays reproducible."""
        tuned = speculative and budget is None and self.tuner is not None
        return BudgetPolicy(
            budget=self.runner.cfg.budget if budget is None else budget,
            tuner=self.tuner if tuned else None,
            greedy_only=True,
            depth=self.runner.drafter.depth if speculative else None,
        )

    def _execute(self, cmd: Command) -> CommandResult:
        if self._group is not None:
            return self._group.run(cmd)
        return apply_command(self.runner, cmd)

    def _new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid

    def close(self) -> None:
        if self._group is not None:
            self._group.close()  # frees every rank's graphs before its communicator
            self._group = None
        else:
            self.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collect(cmd: Command, report: StepReport) -> None:
    """Tokens into each request's output; a decode step's also into its per-step stats (budget
    0: a plain step). A rejected request raises: OutOfSlots when it cannot fit an empty engine,
    ValueError when the runner refuses it."""
    for _req, reason in report.rejected:
        raise (OutOfSlots if reason.startswith(TOO_BIG) else ValueError)(reason)
    stepped = set(cmd.step)
    for req, so in report.outputs:
        o = req.sink
        o.token_ids.extend(so.tokens)
        if req.sid in stepped:
            c = o.stats["committed_per_step"]
            c.append(len(so.tokens))
            o.stats["budget_per_step"].append(cmd.budget if cmd.speculative else 0)
            o.stats["steps"], o.stats["mean_committed"] = len(c), sum(c) / len(c)
        if so.finished:
            o.finish_reason = so.finished


def offline_tuner(budget: int) -> BudgetTuner:
    """The LLM's budget tuner: plain decoding and `default_candidates(budget)`. A one-shot
    generate has few steps to spend and its text changes as it goes (a docstring's opening
    accepts far less than the lines after it), so: each candidate timed once before exploiting
    (the largest's steps tell every smaller tree's acceptance), estimates that follow the last
    steps (decay 0.5), and a candidate close to the best re-checked soon (explore_every 4: at
    most 1/16 of the best rate goes to exploring)."""
    return BudgetTuner(default_candidates(budget), warmup=1, explore_every=4, decay=0.5)


def main(args) -> int:
    """`ddserve generate`: print each completion; stats go to stderr."""
    logging.basicConfig(level=logging.WARNING)
    model = Path(args.model) if args.model else None
    if model is None:
        from ddserve.model.tiny import default_model_dir

        model = default_model_dir()
    drafter = args.drafter
    if drafter is None and (model / "drafter" / "config.json").exists():
        drafter = model / "drafter"  # a checkpoint's bundled drafter, as `ddserve serve` does
    if args.no_speculative:
        drafter = None  # plain decoding: no drafter to load or keep up to date every step
    elif drafter is None:
        print("ddserve: no drafter given or bundled: decoding autoregressively", file=sys.stderr)
    llm = LLM(
        model, drafter=drafter, tp=args.tp, budget=args.budget, device=args.device,
        batch_invariant=getattr(args, "batch_invariant", True),
        cuda_graphs=getattr(args, "cuda_graphs", False),
    )  # fmt: skip
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        t0 = time.perf_counter()
        outs = llm.generate(args.prompt, params, speculative=not args.no_speculative)
        seconds = time.perf_counter() - t0  # prefill and decode of the whole batch
        for o in outs:
            print(o.text if o.text is not None else o.token_ids)
            print(
                f"[{len(o.token_ids)} tokens, {o.stats['steps']} steps, "
                f"{o.stats['mean_committed']:.2f} tokens/step, {seconds:.2f} s "
                f"({len(o.token_ids) / seconds:.0f} tokens/s), "
                f"budgets {_budget_counts(o.stats['budget_per_step'])}, finish={o.finish_reason}]",
                file=sys.stderr,
            )
    finally:
        llm.close()
    return 0


def _budget_counts(budgets: list[int]) -> str:
    """Steps per tree budget, e.g. "16x20 8x1 0x2", most used first (0: plain decoding)."""
    counts = Counter(budgets)
    return " ".join(f"{b}x{n}" for b, n in counts.most_common()) or "-"
