"""Temperature > 0: the sampler draws from the filtered softmax, and DDTree's output distribution
equals autoregressive sampling (two-sample chi-square), while a wrong acceptance rule is caught."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

import ddserve.ddtree.verify as verify_mod
from ddserve.ddtree.accept import accept
from ddserve.ddtree.sampling import select_tokens
from ddserve.drafter.testing import _ContextDrafter
from ddserve.sampling import SamplingParams
from tests.engine_helpers import (  # noqa: F401 (single_thread is a fixture)
    greedy_reference,
    make_runner,
    single_thread,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def reference_probs(logits: np.ndarray, t: float, top_k: int, top_p: float) -> np.ndarray:
    """Filtered sampling distribution, written independently: top-k, then nucleus, renormalised."""
    p = np.exp((logits - logits.max()) / t)
    p /= p.sum()
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: top_k or len(p)]] = True
    p = np.where(keep, p, 0.0) / p[keep].sum()
    mass = 0.0
    for i in order:
        if mass >= top_p:
            p[i] = 0.0
        mass += p[i] if p[i] else 0.0
    return p / p.sum()


@pytest.mark.parametrize(
    "t,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.7)]
)
def test_select_tokens_draws_the_filtered_softmax(t: float, top_k: int, top_p: float) -> None:
    n, v = 20000, 12
    logits = torch.randn(v, generator=torch.Generator().manual_seed(3)) * 1.5
    rows = logits.expand(n, 1, v)
    toks = select_tokens(
        rows,
        torch.full((n,), t),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        torch.arange(n),
        torch.full((n,), 7),
    )[:, 0]
    p = reference_probs(logits.double().numpy(), t, top_k, top_p)
    counts = np.bincount(toks.numpy(), minlength=v)
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0], n * p[p > 0]).pvalue > 1e-3


def test_select_tokens_is_greedy_at_zero_and_reproducible() -> None:
    logits = torch.randn(4, 3, 50)
    args = (torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), torch.ones(4))
    a = select_tokens(logits, *args, torch.arange(4), torch.tensor([1, 1, 1, 1]))
    b = select_tokens(logits, *args, torch.arange(4), torch.tensor([1, 1, 1, 1]))
    assert torch.equal(a, b)
    assert torch.equal(a[0], logits[0].argmax(-1)) and torch.equal(a[2], logits[2].argmax(-1))


PROMPT = [5, 6, 7, 8]
N = 600
PARAMS = dict(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)


def sample(runner, speculative: bool, seed0: int, multi: list | None = None) -> list[tuple]:
    """First three tokens of N streams; `multi` collects steps that committed several tokens."""
    for i in range(N):
        runner.add_stream(i, PROMPT, SamplingParams(seed=seed0 + i, **PARAMS))
    out = {sid: list(so.tokens) for sid, so in runner.prefill().items()}
    while runner.streams:
        step = runner.ddtree_step if speculative else runner.ar_step
        for sid, so in step(list(runner.streams)).items():
            out[sid] += so.tokens
            if multi is not None and len(so.tokens) > 1:
                multi.append(sid)
    return [tuple(out[i]) for i in range(N)]


def same_distribution(a: list, b: list) -> float:
    """Two-sample chi-square p-value over categories, rare ones pooled."""
    ca, cb = Counter(a), Counter(b)
    cats = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rest_a, rest_b = len(a) - sum(ca[k] for k in cats), len(b) - sum(cb[k] for k in cats)
    table = [[ca[k] for k in cats] + [rest_a], [cb[k] for k in cats] + [rest_b]]
    table = [row for row in zip(*table, strict=True) if sum(row) > 0]
    return chi2_contingency(np.array(table).T).pvalue


class ContextOracle(_ContextDrafter):
    """Proposes the greedy continuation of the stream's exact context (prompt + first token),
    with N(0, 1) noise on the other logits, so sampled streams get plausible drafts."""

    def __init__(self, table: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__(vocab, depth=3)
        self.table = table

    def draft(self, sids: list, bonus: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        out = torch.randn(len(sids), self.depth, self.vocab_size, generator=gen)
        for b, sid in enumerate(sids):
            guess = self.table.get((*self._ctx[sid], int(bonus[b])), [])
            for d, t in enumerate(guess[: self.depth]):
                out[b, d, t] += 4.0
        return out


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    vocab = make_runner(tiny_model_dir).model_cfg.vocab_size
    plain = make_runner(tiny_model_dir, num_slots=N * 25, prefill_chunk=4096)
    ar = sample(plain, speculative=False, seed0=10_000)
    firsts = [t for t, c in Counter(s[0] for s in ar).items() if c >= 5]
    contexts = [PROMPT + [t] for t in firsts]
    greedy = greedy_reference(tiny_model_dir, contexts, 3, ignore_eos=True)
    table = {tuple(c): g for c, g in zip(contexts, greedy, strict=True)}
    new = lambda: make_runner(
        tiny_model_dir, 8, ContextOracle(table, vocab), num_slots=N * 25, prefill_chunk=4096
    )
    return new, ar


def marginals(samples: list[tuple[int, ...]]) -> list[list]:
    return [[s[1] for s in samples], [s[2] for s in samples], [s[1:] for s in samples]]


def test_ddtree_sampling_matches_ar(setup) -> None:
    new, ar = setup
    multi: list = []
    dd = sample(new(), speculative=True, seed0=50_000, multi=multi)
    assert len(multi) > N // 5  # drafts were accepted often, so the walk was exercised
    for a, b in zip(marginals(ar), marginals(dd), strict=True):
        assert same_distribution(a, b) > 1e-3


def test_wrong_acceptance_rule_is_caught(setup, monkeypatch) -> None:
    """Accepting a draft token whenever it is in the target's top-k is biased; the test sees it."""
    new, ar = setup
    runner, seen = new(), {}
    real_sample = runner._sample

    def spy(sts, logits):
        seen["logits"] = logits
        return real_sample(sts, logits)

    def wrong_accept(tree, target):
        topk = seen["logits"].topk(PARAMS["top_k"], dim=-1).indices  # [B, N+1, k]
        rows = torch.arange(tree.budget + 1)
        child = tree.parents[:, None, :] == rows[None, :, None]  # [B, N+1, N]
        in_topk = (tree.tokens[:, None, :, None] == topk[:, :, None, :]).any(-1)  # [B, N+1, N]
        ok = child & in_topk
        first = tree.tokens.gather(1, ok.int().argmax(-1))  # [B, N+1]
        return accept(tree, torch.where(ok.any(-1), first, target))

    monkeypatch.setattr(runner, "_sample", spy)
    monkeypatch.setattr(verify_mod, "accept", wrong_accept)
    dd = sample(runner, speculative=True, seed0=50_000)
    assert (
        min(same_distribution(a, b) for a, b in zip(marginals(ar), marginals(dd), strict=True))
        < 1e-3
    )
