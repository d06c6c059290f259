"""Through HTTP, end to end: `ddserve serve` with DDTree (prompts sent all at once, so they share
verify batches and prefill forwards) returns the same greedy completions as `ddserve serve
--no-speculative` with the prompts sent one at a time (`tests/http_exactness.py`; on the CPU:
tp = 2 over gloo, float32)."""

from __future__ import annotations

import json

import pytest
from http_exactness import main as serve_exactness

pytestmark = pytest.mark.slow


def test_served_ddtree_equals_served_plain_decoding_under_other_traffic(tmp_path) -> None:
    out = tmp_path / "x.json"
    code = serve_exactness(["--out", str(out), "--prompts", "6", "--max-tokens", "24"])
    report = json.loads(out.read_text())
    assert report["identical"] == 6 and code == 0, report["first_diff_chars"]
    assert all(len(t) > 0 for t in report["outputs"]["ddtree"])  # real completions compared
