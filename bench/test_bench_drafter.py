"""bench/bench_drafter.py on the CPU with tiny shapes: the drafter it builds, and its run end to
end (`python -m pytest bench/test_bench_drafter.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_drafter import SMALL, build  # noqa: E402


def test_the_drafter_holds_each_streams_context_and_drafts_a_block():
    cfg, model, hooks, drafter, width = build(SMALL, 40, 3, "cpu", torch.float32)
    assert width == len(drafter.capture_layers) * SMALL["hidden"]
    assert [drafter.cache.length(sid) for sid in range(3)] == [40, 40, 40]
    rows = torch.tensor(drafter.state_rows([0, 2]))
    logits = drafter.draft_rows(rows, torch.tensor([5, 6]))
    assert logits.shape == (2, SMALL["block"] - 1, SMALL["vocab_slice"])  # one rank's slice
    assert torch.isfinite(logits).all()
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)


def run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "d.json"
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(HERE / "bench_drafter.py"), "--small", "--device", "cpu",
           "--batches", "1,2", "--reps", "2", "--commit", "3", "--out", str(out),
           *extra]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_cpu_run_writes_a_row_per_batch(tmp_path):
    rep = run(tmp_path)
    assert [r["batch"] for r in rep["rows"]] == [1, 2]
    assert rep["copy_bandwidth_bytes_per_s"] is None  # no floor without a GPU copy
    cfg, model, hooks, _, _ = build(SMALL, 8, 1, "cpu", torch.float32)
    assert rep["weights_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    for r in rep["rows"]:
        assert r["draft_s"] > 0 and r["commit_s"] > 0 and r["commit_block_s"] > 0
        assert 0 < r["commit_bytes"] < r["draft_bytes"]


def test_stacked_context_kv_issues_fewer_ops_per_commit(tmp_path):
    """With 4 layers, the commit through the stacked k/v projections dispatches fewer torch ops
    than layer by layer (`--no-stack`)."""
    stacked = run(tmp_path, "--layers", "4")
    per_layer = run(tmp_path, "--layers", "4", "--no-stack")
    assert stacked["stacked"] and not per_layer["stacked"]
    for a, b in zip(stacked["rows"], per_layer["rows"], strict=True):
        assert 0 < a["commit_ops"] < b["commit_ops"] - 20, (a["commit_ops"], b["commit_ops"])


def test_a_rank_shard_reads_its_share_of_the_weights(tmp_path):
    """`--tp 2` times rank 0's shard: half of every split weight, its KV heads' ring, and the
    all-reduces it leaves out reported; a --tp the shapes do not divide is refused."""
    whole = run(tmp_path)
    half = run(tmp_path, "--tp", "2")
    assert half["tp"] == 2 and whole["tp"] == 1
    cfg, model, _, drafter, _ = build(SMALL, 8, 1, "cpu", torch.float32, tp=2)
    assert model.comm.world_size == 2 and drafter.cache.k.shape[-2] == SMALL["kv_heads"] // 2
    assert half["weights_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    assert half["weights_bytes"] < 0.6 * whole["weights_bytes"]  # norms stay whole
    for r in half["rows"]:
        assert r["draft_all_reduces"] == 2 * SMALL["layers"] and r["commit_all_reduces"] == 1
        assert r["draft_all_reduce_bytes"] == 4 * r["batch"] * SMALL["block"] * SMALL["hidden"]
    assert all(r["draft_all_reduces"] == 0 for r in whole["rows"])
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HERE / "bench_drafter.py"), "--small", "--device",
                           "cpu", "--tp", "3"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0 and "--tp 3" in proc.stderr
