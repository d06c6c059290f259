"""Stage 4 data: the frozen target's own greedy continuations of corpus prompts, with the hidden
states the DFlash drafter reads as context.

One sequence is a prompt (a random window of a corpus split, P tokens), then G tokens the target
chose greedily (argmax over the full vocabulary, as ddserve decodes at temperature 0), then the
target's captured hidden states at every position: the outputs of decoder layers `layer_ids`,
concatenated in that order, exactly what ddserve's engine hands the drafter for committed tokens.

The loop is KV-cache free: every step re-runs the target over the whole prefix. Its last step runs
over the first P+G-1 tokens and also captures the hidden states, so no extra forward is needed; the
final token's hidden state is never context (context sits strictly before an anchor, and an anchor
needs a label after it), so it is stored as zeros.

Tokens after the first generated `<|eos|>` are not what ddserve would emit (it stops there):
`lengths` ends each sequence at that EOS (included), and nothing past it is ever a label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ddserve.ddtree.tree import DraftTree, build_tree
from ddserve.train.data import encode_files, read_corpus


class GreedyTarget(Protocol):
    """What the generator needs from the target (`ddserve.train.target_model.TrainTarget`)."""

    def __call__(
        self, input_ids: Tensor, capture_layers: Sequence[int] = ()
    ) -> tuple[Tensor, list[Tensor]]: ...  # [B, T] -> logits [B, T, V], hidden [B, T, H] each


@dataclass
class DraftData:
    """N sequences, right-padded to a common length S."""

    tokens: Tensor  # [N, S] int64, 0 past each length
    hidden: Tensor  # [N, S, k*H] target hidden states at layer_ids (bf16), 0 where never context
    prompt_lens: Tensor  # [N] int64 P: tokens[:P] are corpus text, the rest the target's
    lengths: Tensor  # [N] int64 valid tokens (through the first generated EOS)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def take(self, idx: Tensor) -> DraftData:
        """Rows `idx`, trimmed to their longest valid length."""
        lengths = self.lengths[idx]
        s = int(lengths.max())
        return DraftData(self.tokens[idx, :s], self.hidden[idx, :s], self.prompt_lens[idx], lengths)

    @staticmethod
    def cat(parts: Sequence[DraftData]) -> DraftData:
        s = max(p.tokens.shape[1] for p in parts)
        tokens = torch.cat([F.pad(p.tokens, (0, s - p.tokens.shape[1])) for p in parts])
        hidden = torch.cat([F.pad(p.hidden, (0, 0, 0, s - p.hidden.shape[1])) for p in parts])
        return DraftData(
            tokens,
            hidden,
            torch.cat([p.prompt_lens for p in parts]),
            torch.cat([p.lengths for p in parts]),
        )


def prompt_streams(corpus: str | Path, tokenizer_dir: str | Path, train_text_mb: float,
                   seed: int) -> dict[str, np.ndarray]:  # fmt: skip
    """Token streams to cut prompts from: the whole eval split, and a seeded random subset of
    the train split's files up to `train_text_mb` of text (tokenizing all of it would take a
    fair share of a run, for far more tokens than the prompts need)."""
    texts = read_corpus(corpus)
    rng = np.random.default_rng(seed)
    train, used = [], 0
    for i in rng.permutation(len(texts["train"])):
        if used >= train_text_mb * 1e6:
            break
        train.append(texts["train"][i])
        used += len(texts["train"][i])
    return {"train": encode_files(train, tokenizer_dir)[0],
            "eval": encode_files(texts["eval"], tokenizer_dir)[0]}  # fmt: skip


def sample_windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> Tensor:
    """n random windows [n, length] (int64) of a token stream (start offsets uniform)."""
    if stream.shape[0] <= length:
        raise ValueError(f"a stream of {stream.shape[0]} tokens has no window of {length}")
    starts = rng.integers(0, stream.shape[0] - length, size=n)
    idx = starts[:, None] + np.arange(length)[None, :]  # [n, length]
    return torch.from_numpy(stream[idx].astype(np.int64))


def valid_lengths(tokens: Tensor, prompt_len: int, eos_id: int | None) -> Tensor:
    """[B] tokens up to and including the first EOS at or after `prompt_len` (else all)."""
    b, s = tokens.shape
    if eos_id is None:
        return torch.full((b,), s, dtype=torch.long, device=tokens.device)
    gen = tokens[:, prompt_len:] == eos_id  # [B, G]
    first = torch.where(gen.any(1), gen.int().argmax(1) + 1, gen.shape[1])  # [B]
    return prompt_len + first.long()


@torch.no_grad()
def greedy_with_hidden(
    target: GreedyTarget, prompts: Tensor, new_tokens: int, layer_ids: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """prompts [B, P] -> (tokens [B, P+G] prompt + G greedy tokens, hidden [B, P+G, k*H])."""
    ids = prompts
    for step in range(new_tokens):
        last = step == new_tokens - 1
        logits, hs = target(ids, capture_layers=tuple(layer_ids) if last else ())
        nxt = logits[:, -1].argmax(dim=-1)  # [B]
        ids = torch.cat([ids, nxt[:, None]], dim=1)  # [B, T+1]
    hidden = torch.cat(hs, dim=-1).to(torch.bfloat16)  # [B, P+G-1, k*H]
    return ids, F.pad(hidden, (0, 0, 0, 1))  # [B, P+G, k*H]: the last row is never context


@dataclass(frozen=True)
class GenPlan:
    """How much data to make: batches cycle through `prompt_lens` until `num_seqs` or the clock."""

    num_seqs: int
    prompt_lens: tuple[int, ...] = (32, 64, 128, 256)
    new_tokens: int = 256
    batch: int = 512
    seed: int = 0


def generate(
    target: GreedyTarget,
    stream: np.ndarray,
    plan: GenPlan,
    layer_ids: Sequence[int],
    eos_id: int | None,
    device: torch.device | str,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> DraftData:
    """Greedy continuations of random windows of `stream`; stops early at `deadline`
    (time.monotonic()), after at least one batch."""
    rng = np.random.default_rng(plan.seed)
    parts: list[DraftData] = []
    made, t0 = 0, time.monotonic()
    while made < plan.num_seqs and (not parts or deadline is None or time.monotonic() < deadline):
        p = plan.prompt_lens[len(parts) % len(plan.prompt_lens)]
        b = min(plan.batch, plan.num_seqs - made)
        prompts = sample_windows(stream, b, p, rng).to(device)  # [b, P]
        tokens, hidden = greedy_with_hidden(target, prompts, plan.new_tokens, layer_ids)
        lengths = valid_lengths(tokens, p, eos_id)
        parts.append(DraftData(tokens, hidden, torch.full_like(lengths, p), lengths))
        made += b
        dt = time.monotonic() - t0
        gen = int((lengths - p).sum())
        log(f"gen: {made} seqs (P={p}, +{gen} tokens), {dt:.1f} s, "
            f"{made * plan.new_tokens / max(dt, 1e-9):.0f} generated tok/s")  # fmt: skip
    return DraftData.cat(parts)


# ---- measuring: acceptance of a drafter on held-out continuations ---------------------------

LogitsFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # tokens, hidden, anchors, keep


def every_anchor(prompt_lens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Every anchor ddserve can meet, a in [P, length-2] (the bonus is a generated token with a
    label after it) -> anchors [B, N] (0 past each row's count), keep [B, N]."""
    n = int((lengths - 1 - prompt_lens).clamp_min(1).max())
    anchors = prompt_lens[:, None] + torch.arange(n, device=lengths.device)  # [B, N]
    keep = anchors <= lengths[:, None] - 2
    return torch.where(keep, anchors, 0), keep


def matched_depth(tree: DraftTree, labels: Tensor, valid: Tensor) -> Tensor:
    """Accepted draft tokens per block [N]: the deepest tree node whose path equals the target's
    tokens (labels [N, D] where valid). Parents precede children in the tree's node order."""
    d = (tree.depths - 1).clamp(max=labels.shape[1] - 1)  # [N, M]
    ok = (tree.tokens == labels.gather(1, d)) & valid.gather(1, d)  # [N, M]
    match = torch.ones(ok.shape[0], ok.shape[1] + 1, dtype=torch.bool, device=ok.device)
    for j in range(ok.shape[1]):
        parent_ok = match.gather(1, tree.parents[:, j : j + 1])[:, 0]  # [N]
        match[:, j + 1] = ok[:, j] & parent_ok
    return (tree.depths * match[:, 1:]).amax(dim=1)  # [N]


def chain_depth(logits: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
    """Accepted tokens of the greedy chain draft (top-1 at every depth): leading matches [N]."""
    hit = (logits.argmax(-1) == labels) & valid  # [N, D]
    return hit.long().cumprod(dim=1).sum(dim=1)


def walk(accepted: dict[int, int], start: int, last_full: int) -> list[int]:
    """Decode as the engine does: at anchor a commit accepted[a] + 1 tokens (the accepted drafts
    and the new bonus) and move there, while a block's labels are all known (a <= last_full).
    -> tokens committed by each step."""
    a, steps = start, []
    while a <= last_full:
        steps.append(accepted[a] + 1)
        a += accepted[a] + 1
    return steps


def _sequences(logits_fn: LogitsFn, data: DraftData, depth: int, batch: int):
    """Per sequence: (draft logits [N, D, V], labels [N, D], valid [N, D], anchors, P, length)
    at every anchor of `every_anchor`."""
    for lo in range(0, len(data), batch):
        part = data.take(torch.arange(lo, min(lo + batch, len(data))))
        anchors, keep = every_anchor(part.prompt_lens, part.lengths)
        at = anchors[:, :, None] + torch.arange(1, depth + 1, device=anchors.device)  # [B, N, D]
        valid = keep[:, :, None] & (at < part.lengths[:, None, None])  # [B, N, D]
        labels = part.tokens.gather(1, at.clamp(max=part.tokens.shape[1] - 1).flatten(1))
        labels = labels.view(at.shape)  # [B, N, D]
        logits = logits_fn(part.tokens, part.hidden, anchors, keep).float()  # [B, N, D, V]
        for i in range(anchors.shape[0]):
            k = keep[i]
            yield (logits[i][k], labels[i][k], valid[i][k], anchors[i][k].tolist(),
                   int(part.prompt_lens[i]), int(part.lengths[i]))  # fmt: skip


@torch.no_grad()
def step_commits(logits_fn: LogitsFn, data: DraftData, depth: int, budgets: Sequence[int],
                 batch: int = 8) -> tuple[dict[str, list[list[int]]], Tensor]:  # fmt: skip
    """At temperature 0, per sequence, the tokens each engine step commits with the greedy
    chain draft ("chain") and with DDTree at each budget ("budget_N"), from the first generated
    token on; and the top-1 accuracy per depth [D] over every anchor. Exact for these
    sequences: every committed token is the target's greedy token, which the data holds."""
    kinds = ["chain", *(f"budget_{b}" for b in budgets)]
    commits: dict[str, list[list[int]]] = {k: [] for k in kinds}
    correct, count = torch.zeros(depth), torch.zeros(depth)
    for lg, lb, vd, anchors, p, length in _sequences(logits_fn, data, depth, batch):
        correct += ((lg.argmax(-1) == lb) & vd).sum(0).cpu()
        count += vd.sum(0).cpu()
        found = {"chain": chain_depth(lg, lb, vd)}
        for b in budgets:
            found[f"budget_{b}"] = matched_depth(build_tree(lg, b), lb, vd)
        for kind, acc in found.items():
            accepted = dict(zip(anchors, acc.tolist(), strict=True))
            commits[kind].append(walk(accepted, p, length - 1 - depth))
    return commits, correct / count.clamp_min(1)


def acceptance(logits_fn: LogitsFn, data: DraftData, depth: int, budgets: Sequence[int],
               batch: int = 8) -> dict[str, Any]:  # fmt: skip
    """Held-out summary of `step_commits`: mean committed tokens per step (all steps of all
    sequences), per-depth top-1 accuracy, and the number of chain steps walked."""
    commits, acc = step_commits(logits_fn, data, depth, budgets, batch)
    per_step = {k: sum(map(sum, v)) / max(sum(map(len, v)), 1) for k, v in commits.items()}
    steps = sum(map(len, commits["chain"]))
    return {"acc_per_depth": acc.tolist(), "committed_per_step": per_step, "steps": steps}
