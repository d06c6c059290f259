"""One request inside the engine: its prompt, committed KV slots, output and stop rules."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from ddserve.sampling import SamplingParams


@dataclass(frozen=True)
class StepOutput:
    """Tokens a stream emitted in one engine call; finished is "stop", "length" or None.

    A stop token (EOS or one of stop_token_ids) is the last token emitted and is included.
    accepted_rows: of a DDTree step, the verify rows (1..budget, in the tree's best-first
    order) of the accepted draft nodes along the path; they tell what a smaller tree would have
    committed (`engine.budget.tokens_at_budgets`)."""

    tokens: list[int]
    finished: str | None = None
    accepted_rows: tuple[int, ...] = ()


@dataclass
class Stream:
    sid: Hashable
    prompt: list[int]
    params: SamplingParams
    seed: int  # sampling seed, identical on every rank
    reserved: int  # most KV slots this stream can ever hold at once
    stop_ids: frozenset[int]
    slots: list[int] = field(default_factory=list)  # KV slots of the committed tokens, in order
    output: list[int] = field(default_factory=list)  # generated tokens; output[-1] is the bonus
    steps: int = 0  # sampling steps taken (the prefill's first token is step 0)
    committed: list[int] = field(default_factory=list)  # tokens emitted per decode step
    finished: str | None = None
    prompt_hidden: list = field(default_factory=list)  # captured prompt states, until prefilled

    @property
    def prefilled(self) -> bool:
        return bool(self.output)

    def emit(self, tokens: list[int], accepted_rows: tuple[int, ...] = ()) -> StepOutput:
        """Append tokens up to the first stop or max_tokens; never past it. `accepted_rows` goes
        into the StepOutput as it is."""
        out: list[int] = []
        for t in tokens:
            out.append(t)
            self.output.append(t)
            if t in self.stop_ids:
                self.finished = "stop"
                break
            if len(self.output) >= self.params.max_tokens:
                self.finished = "length"
                break
        return StepOutput(out, self.finished, accepted_rows)


def stop_ids(params: SamplingParams, eos: int | tuple[int, ...] | None) -> frozenset[int]:
    ids = set(params.stop_token_ids)
    if eos is not None and not params.ignore_eos:
        ids.update((eos,) if isinstance(eos, int) else eos)
    return frozenset(ids)
