"""The online per-bucket budget choice converges on the budget with the best measured rate."""

from __future__ import annotations

import pytest

from ddserve.actors.budget import BudgetTuner, default_candidates


def simulate(tuner: BudgetTuner, bucket: int, accept, cost, steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        b = tuner.choose(bucket)
        chosen.append(b)
        tuner.record(bucket, b, accept(b), cost(b))
    return chosen


def test_picks_the_budget_with_the_most_tokens_per_second() -> None:
    # acceptance saturates, cost grows linearly: tokens/s = (1 + 3(1 - 0.8^b)) / (1 + 0.1 b)
    accept = lambda b: 1 + 3 * (1 - 0.8**b)
    cost = lambda b: 1 + 0.1 * b
    cands = (1, 2, 4, 8, 16, 32)
    best = max(cands, key=lambda b: accept(b) / cost(b))
    tuner = BudgetTuner(cands, warmup=2, explore_every=10)
    chosen = simulate(tuner, 4, accept, cost, 200)
    assert tuner.best(4) == best == 4
    assert chosen[-100:].count(best) >= 90  # exploits, exploring one step in ten


def test_buckets_are_tuned_independently() -> None:
    tuner = BudgetTuner((4, 16), warmup=1, explore_every=5)
    simulate(tuner, 1, lambda b: 1 + b / 4, lambda b: 1.0, 30)  # small batch: big trees pay
    simulate(tuner, 16, lambda b: 1 + b / 4, lambda b: b / 2, 30)  # big batch: they don't
    assert tuner.snapshot() == {1: 16, 16: 4}


def test_estimates_follow_a_change_in_acceptance() -> None:
    tuner = BudgetTuner((4, 32), warmup=1, explore_every=4, decay=0.5)
    simulate(tuner, 2, lambda b: 1 + b / 4, lambda b: 1.0, 40)  # drafter good: 32 wins
    assert tuner.best(2) == 32
    simulate(tuner, 2, lambda b: 1.0, lambda b: 1 + b / 8, 80)  # drafter useless: plain wins
    assert tuner.best(2) == 0
    trees_only = BudgetTuner((4, 32), warmup=1, explore_every=4, decay=0.5, plain=False)
    simulate(trees_only, 2, lambda b: 1 + b / 4, lambda b: 1.0, 40)
    simulate(trees_only, 2, lambda b: 1.0, lambda b: 1 + b / 8, 80)
    assert trees_only.best(2) == 4


def test_every_candidate_is_tried_before_exploiting() -> None:
    # largest first (its steps also tell the smaller trees' acceptance); plain decoding too
    tuner = BudgetTuner((8, 4, 16), warmup=2)
    assert simulate(tuner, 1, lambda b: 1.0, lambda b: 1.0, 8) == [16, 16, 8, 8, 4, 4, 0, 0]
    assert BudgetTuner((8, 4), plain=False).candidates == (4, 8)


@pytest.mark.parametrize("explore_every", [4, 20])
def test_falls_back_to_plain_decoding_and_bounds_what_exploring_costs(explore_every) -> None:
    # a drafter nobody can use: every tree commits one token, and bigger trees cost more
    accept, cost = lambda b: 1.0, lambda b: 1.0 + b / 8
    tuner = BudgetTuner((4, 8, 16, 32), warmup=1, explore_every=explore_every)
    chosen = simulate(tuner, 1, accept, cost, 3000)
    assert tuner.best(1) == 0 and tuner.snapshot() == {1: 0}
    steady = chosen[10:]  # after the warm-up: tokens per second against plain decoding's 1.0
    rate = len(steady) / sum(cost(b) for b in steady)
    assert rate >= 1 - 1 / (4 * explore_every)
    assert steady.count(0) >= 0.9 * len(steady)


def test_a_close_candidate_is_rechecked_sooner_than_a_poor_one() -> None:
    def explorations(tree_tokens: float) -> int:
        tuner = BudgetTuner((16,), warmup=1, explore_every=4)
        cost = {0: 1.0, 16: 3.0}.get
        chosen = simulate(tuner, 1, lambda b: tree_tokens if b else 1.0, cost, 400)
        assert tuner.best(1) == 0
        return chosen[2:].count(16)

    assert explorations(2.9) > 2 * explorations(1.0) > 0  # just behind plain, far behind


def test_default_candidates_and_bad_settings() -> None:
    assert default_candidates(16) == (4, 8, 16)
    assert default_candidates(24) == (4, 8, 16, 24)
    assert default_candidates(2) == (2,)
    with pytest.raises(ValueError):
        BudgetTuner(())
    with pytest.raises(ValueError):
        BudgetTuner((-1, 4))
    with pytest.raises(ValueError):
        BudgetTuner((4,), explore_every=1)


def test_a_tree_accepted_to_its_full_depth_makes_the_next_step_try_a_bigger_one() -> None:
    tuner = BudgetTuner((4, 8, 16), warmup=1, explore_every=1000)
    simulate(tuner, 1, lambda b: 1.0, lambda b: 1.0 + b, 4)  # warm-up: plain decoding wins
    assert tuner.choose(1) == 0
    tuner.record(1, 0, 1.0, 1.0, saturated=False)
    tuner.record(1, 4, 5.0, 5.0, saturated=True)  # a 4-node chain, all accepted
    assert tuner.choose(1) == 4  # the next larger than the best (plain)...
    tuner.record(1, 4, 1.0, 5.0)
    assert tuner.choose(1) == 0  # ...once
