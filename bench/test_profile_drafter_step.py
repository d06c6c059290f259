"""bench/profile_drafter_step.py end to end on the CPU (--small, eager: no graphs there): the
oracle and each variant timed, then profiled, one row per batch size in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_cpu_run_times_and_profiles_every_variant(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent}:{HERE}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(HERE / "profile_drafter_step.py"), "--small", "--device", "cpu",
           "--batches", "1,2", "--budgets", "4", "--steps", "2", "--warmup", "1",
           "--variants", "default,separate-mlp,commit-after-step", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["variants"] == ["default", "separate-mlp", "commit-after-step"]
    assert rep["failed"] == {}
    assert [r["batch"] for r in rep["rows"]] == [1, 2]
    for row in rep["rows"]:
        for name in ("oracle", "default", "separate-mlp", "commit-after-step"):
            assert row[name]["step_ms"] > 0 and row[name]["kernels_per_step"] > 0
        # the drafter's work adds ops to every step
        assert row["default"]["kernels_per_step"] > row["oracle"]["kernels_per_step"]
        assert row["grown"]
