"""Stage 4 data: the frozen target's own greedy continuations of corpus prompts, with the hidden
states the DFlash drafter reads as context.

One sequence is a prompt (a random window of a corpus split, P tokens), then G tokens the target
chose greedily (argmax over the full vocabulary, as ddserve decodes at temperature 0), then the
target's captured hidden states at every position: the outputs of decoder layers `layer_ids`,
concatenated in that order, exactly what ddserve's engine hands the drafter for committed tokens.

`cached_greedy_with_hidden` decodes with a key/value cache over `TrainTarget`'s own modules (one
prefill, then one row per step; each fed token's captured layers are its hidden states);
`greedy_with_hidden` re-runs the whole prefix every step (the reference a test holds the cached
loop to). The final token is never fed, and its hidden state is never context (context sits
strictly before an anchor, and an anchor needs a label after it): it is stored as zeros.

Tokens after the first generated `<|eos|>` are not what ddserve would emit (it stops there):
`lengths` ends each sequence at that EOS (included), and nothing past it is ever a label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ddserve.ddtree.tree import DraftTree, build_tree
from ddserve.model.rope import apply_rope
from ddserve.train.data import encode_files, read_corpus

if TYPE_CHECKING:
    from ddserve.train.target_model import Attention, TrainTarget


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
    target: TrainTarget, prompts: Tensor, new_tokens: int, layer_ids: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """prompts [B, P] -> (tokens [B, P+G] prompt + G greedy tokens, hidden [B, P+G, k*H]).
    Re-runs the prefix every step; the last step (over P+G-1 tokens) also captures."""
    ids = prompts
    for step in range(new_tokens):
        last = step == new_tokens - 1
        logits, hs = target(ids, capture_layers=tuple(layer_ids) if last else ())
        nxt = logits[:, -1].argmax(dim=-1)  # [B]
        ids = torch.cat([ids, nxt[:, None]], dim=1)  # [B, T+1]
    hidden = torch.cat(hs, dim=-1).to(torch.bfloat16)  # [B, P+G-1, k*H]
    return ids, F.pad(hidden, (0, 0, 0, 1))  # [B, P+G, k*H]: the last row is never context


class _KVCache:
    """One layer's expanded keys [B, T, NH, Dk] and values [B, T, NH, Dv], filled left to right."""

    def __init__(self, b: int, t: int, heads: int, dk: int, dv: int, like: Tensor) -> None:
        self.k = like.new_zeros(b, t, heads, dk)
        self.v = like.new_zeros(b, t, heads, dv)


def _cached_attention(attn: Attention, x: Tensor, cos: Tensor, sin: Tensor, cache: _KVCache,
                      start: int) -> Tensor:  # fmt: skip
    """TrainTarget's MLA (`target_model.Attention.forward`) for new rows x [B, Tn, D] at
    positions start.., their keys/values appended to `cache`; cos/sin [Tn, 1, P]."""
    q_nope, q_pe = attn._query(x).split([attn.nope, attn.rope_dim], dim=-1)  # [B, Tn, NH, .]
    q_pe = apply_rope(q_pe, cos, sin, attn.interleave)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.rank, attn.rope_dim], dim=-1)
    k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin, attn.interleave)  # [B, Tn, 1, P]
    kv = attn.kv_b_proj(attn.kv_a_layernorm(c_kv)).unflatten(-1, (attn.heads, -1))
    k_nope, v = kv.split([attn.nope, attn.v_dim], dim=-1)
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)  # [B, Tn, NH, Dk]
    end = start + x.shape[1]
    cache.k[:, start:end] = torch.cat([k_nope, k_pe.to(k_nope.dtype).expand_as(q_pe)], dim=-1)
    cache.v[:, start:end] = v
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), cache.k[:, :end].transpose(1, 2), cache.v[:, :end].transpose(1, 2),
        is_causal=start == 0, scale=attn.scale,
    )  # [B, NH, Tn, Dv]: a prefill is causal from 0, a one-row step sees every key  # fmt: skip
    return attn.o_proj(o.transpose(1, 2).flatten(2))  # [B, Tn, D]


def _cached_forward(target: TrainTarget, ids: Tensor, start: int, caches: list[_KVCache],
                    layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:  # fmt: skip
    """ids [B, Tn] at positions start.. -> (last-row logits [B, V], hidden [B, Tn, k*H])."""
    m = target.model
    pos = torch.arange(start, start + ids.shape[1], device=ids.device)
    cos, sin = m.rotary_emb.cos_sin(pos, torch.float32)  # [Tn, P]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [Tn, 1, P]
    x, captured = m.embed_tokens(ids), {}  # [B, Tn, D]
    for i, layer in enumerate(m.layers):
        h = _cached_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, caches[i], start)
        x = x + h
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        captured[i] = x
    logits = target.lm_head(m.norm(x[:, -1]))  # [B, V]
    return logits, torch.cat([captured[i] for i in layer_ids], dim=-1)


@torch.no_grad()
def cached_greedy_with_hidden(
    target: TrainTarget, prompts: Tensor, new_tokens: int, layer_ids: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """`greedy_with_hidden` for a `TrainTarget`, with a key/value cache: one prefill, then one
    row per step (its captured layers are that token's hidden states)."""
    b, p = prompts.shape
    total, cfg = p + new_tokens, target.cfg
    like = target.model.embed_tokens.weight
    dk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    heads = cfg.num_attention_heads
    caches = [_KVCache(b, total, heads, dk, dv, like) for _ in range(cfg.num_hidden_layers)]
    width = len(layer_ids) * cfg.hidden_size
    tokens = prompts.new_zeros(b, total)
    hidden = torch.zeros(b, total, width, dtype=torch.bfloat16, device=prompts.device)
    tokens[:, :p] = prompts
    logits, hidden[:, :p] = _cached_forward(target, prompts, 0, caches, layer_ids)
    for t in range(p, total):
        tokens[:, t] = logits.argmax(dim=-1)  # [B]
        if t + 1 < total:  # the last token's hidden state is never context
            logits, hidden[:, t : t + 1] = _cached_forward(
                target, tokens[:, t : t + 1], t, caches, layer_ids
            )
    return tokens, hidden


@dataclass(frozen=True)
class GenPlan:
    """How much data to make: batches cycle through `prompt_lens` until `num_seqs` or the clock."""

    num_seqs: int
    prompt_lens: tuple[int, ...] = (32, 64, 128, 256)
    new_tokens: int = 256
    batch: int = 1024
    seed: int = 0
    kv_cache: bool = True  # cached_greedy_with_hidden (a TrainTarget), else greedy_with_hidden


def generate(
    target: TrainTarget,
    stream: np.ndarray,
    plan: GenPlan,
    layer_ids: Sequence[int],
    eos_id: int | None,
    device: torch.device | str,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> DraftData:
    """Greedy continuations of random windows of `stream`, written into tensors allocated once
    for `plan.num_seqs` on `device`; stops early at `deadline` (time.monotonic()), after at
    least one batch."""
    rng = np.random.default_rng(plan.seed)
    s, width = max(plan.prompt_lens) + plan.new_tokens, len(layer_ids) * target.cfg.hidden_size
    out = DraftData(
        torch.zeros(plan.num_seqs, s, dtype=torch.long, device=device),
        torch.zeros(plan.num_seqs, s, width, dtype=torch.bfloat16, device=device),
        torch.zeros(plan.num_seqs, dtype=torch.long, device=device),
        torch.zeros(plan.num_seqs, dtype=torch.long, device=device),
    )
    greedy = cached_greedy_with_hidden if plan.kv_cache else greedy_with_hidden
    made, batches, t0 = 0, 0, time.monotonic()
    while made < plan.num_seqs and (not made or deadline is None or time.monotonic() < deadline):
        p = plan.prompt_lens[batches % len(plan.prompt_lens)]
        rows = slice(made, min(made + plan.batch, plan.num_seqs))
        prompts = sample_windows(stream, rows.stop - made, p, rng).to(device)  # [b, P]
        tokens, hidden = greedy(target, prompts, plan.new_tokens, layer_ids)  # [b, P+G], ...
        out.tokens[rows, : tokens.shape[1]] = tokens
        out.hidden[rows, : tokens.shape[1]] = hidden
        out.prompt_lens[rows] = p
        out.lengths[rows] = valid_lengths(tokens, p, eos_id)
        made, batches, dt = rows.stop, batches + 1, time.monotonic() - t0
        gen = int((out.lengths[rows] - p).sum())
        log(f"gen: {made} seqs (P={p}, +{gen} tokens), {dt:.1f} s, "
            f"{made * plan.new_tokens / max(dt, 1e-9):.0f} generated tok/s")  # fmt: skip
    return DraftData(out.tokens[:made], out.hidden[:made], out.prompt_lens[:made],
                     out.lengths[:made])  # fmt: skip


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
