"""The serving router's budget tuner (`budgets: auto`). It lives in `ddserve.engine.budget`, beside
the runner whose steps it times, because the offline `LLM` uses it too; re-exported here for the
actors."""

from __future__ import annotations

from ddserve.engine.budget import PLAIN, BudgetTuner, default_candidates

__all__ = ["PLAIN", "BudgetTuner", "default_candidates"]
