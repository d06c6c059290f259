"""The engine benchmark (bench/bench_engine.py), run as a program on CPU with its --small preset:
it runs, its JSON is internally consistent, and its measurements obey what the engine guarantees.
(Its harness's own unit tests, which import bench/ modules, are in bench/test_engine_harness.py.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddserve.config import ModelConfig
from ddserve.model.deepseek import DeepseekV3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--small", "--device", "cpu", "--steps", "2", "--warmup", "1"]


def bench_engine(out: Path, *args: str) -> dict:
    """Run bench/bench_engine.py with the --small CPU preset and return the JSON it wrote."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "1")
    script = ROOT / "bench" / "bench_engine.py"
    cmd = [sys.executable, str(script), *SMALL, *args, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return bench_engine(tmp_path_factory.mktemp("bench") / "engine.json")


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def test_every_configuration_ran(report):
    args = report["args"]
    assert {e["batch"] for e in report["ar"]} == set(args["batches"])
    want = {(c, b, x) for c in args["batches"] for b in args["budgets"] for x in args["corrupt"]}
    assert {(e["batch"], e["budget"], e["corrupt"]) for e in report["ddtree"]} == want
    assert report["skipped"] == [] and report["errors"] == []


def test_throughput_and_break_even_follow_from_step_times(report):
    ar = {e["batch"]: e for e in report["ar"]}
    for e in report["ar"]:
        assert e["committed_per_step"] == 1.0
        assert close(e["tokens_per_s"], e["batch"] / e["step_s"]["mean"])
    for e in report["ddtree"]:
        step, ar_step = e["step_s"]["mean"], ar[e["batch"]]["step_s"]["mean"]
        assert close(e["tokens_per_s"], e["batch"] * e["committed_per_step"] / step)
        assert close(e["break_even_committed"], step / ar_step)
        floor_ratio = e["floor"]["floor_s"] / ar[e["batch"]]["floor"]["floor_s"]
        assert close(e["break_even_committed_floor"], floor_ratio)
        assert e["break_even_committed_graph"] is None  # no CUDA graphs on CPU
        assert close(e["speedup_vs_ar"], e["tokens_per_s"] / ar[e["batch"]]["tokens_per_s"])
        assert close(e["speedup_vs_ar"], e["committed_per_step"] / e["break_even_committed"])


def test_floor_is_positive_and_the_ratio_uses_it(report):
    rate = report["bandwidth"]["bytes_per_s"]
    for e in report["ar"] + report["ddtree"]:
        fl = e["floor"]
        assert fl["floor_s"] > 0 and fl["total_bytes"] > 0
        assert close(fl["total_bytes"], sum(fl["bytes"].values()))
        assert close(fl["floor_s"], fl["total_bytes"] / rate)
        assert close(e["step_over_floor"], e["step_s"]["mean"] / fl["floor_s"])


def test_weight_bytes_cover_the_model_and_int4_experts(report):
    cfg = ModelConfig.from_hf(report["model"]["config"])
    shell = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    wb = report["model"]["weight_bytes"]
    assert sum(wb.values()) == sum(p.numel() * p.element_size() for p in shell.parameters())
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    per_expert = (2 * i * h) // 2 + (2 * i * h // 32) * 2 + (h * i) // 2 + (h * i // 32) * 2
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert wb["experts"] == moe_layers * cfg.n_routed_experts * per_expert
    e = report["ar"][0]["floor"]
    assert e["expert_bytes_each"] == per_expert and e["moe_layers"] == moe_layers
    assert e["bytes"]["fixed_weights"] == sum(wb.values()) - wb["experts"] - wb["embedding"]


def test_distinct_experts_are_measured_within_their_bounds(report):
    cfg = ModelConfig.from_hf(report["model"]["config"])
    e_num, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for e in report["ar"] + report["ddtree"]:
        fl, t = e["floor"], e["tokens_per_forward"]
        assert k <= fl["distinct_experts_layer_min"] <= fl["distinct_experts_layer_max"]
        assert fl["distinct_experts_layer_max"] <= min(e_num, t * k)
        assert close(fl["uniform_distinct_per_layer"], e_num * (1 - (1 - k / e_num) ** t))
    one = next(e for e in report["ar"] if e["batch"] == 1)["floor"]
    assert one["distinct_experts_per_layer"] == k  # one token picks exactly k experts


def test_kv_read_counts_prefix_and_block(report):
    cfg = ModelConfig.from_hf(report["model"]["config"])
    per_token = cfg.kv_latent_dim * 2 * cfg.num_hidden_layers  # bf16 latent, every layer
    prefix = report["args"]["prefix"]
    for e in report["ar"] + report["ddtree"]:
        fl = e["floor"]
        assert close(fl["bytes"]["kv_read"], fl["kv_tokens_per_stream"] * e["batch"] * per_token)
        assert fl["kv_tokens_per_stream"] > prefix


def test_perfect_oracle_commits_full_chains_equal_to_ar(report):
    depth = report["args"]["depth"]
    for e in report["ddtree"]:
        assert e["matches_ar_greedy"] == 1.0  # DDTree output == AR greedy, token for token
        full = min(depth, e["budget"]) + 1
        if e["corrupt"] == 0.0:
            assert e["committed_per_step"] == full
        else:
            assert 1.0 <= e["committed_per_step"] <= full


def test_split_has_every_stage(report):
    for e in report["ddtree"]:
        split = e["split_s"]
        assert set(split) == {"draft", "build", "prep", "verify", "accept_commit"}
        assert all(v > 0 for v in split.values())


def test_max_seconds_skips_and_records_configurations(tmp_path):
    args = ("--max-seconds", "0", "--batches", "1,2", "--budgets", "2")
    rep = bench_engine(tmp_path / "x.json", *args)
    assert [e["batch"] for e in rep["ar"]] == [2]  # the continuation run always happens
    assert rep["ddtree"] == []
    kinds = sorted((s["kind"], s["batch"]) for s in rep["skipped"])
    assert kinds == [("ar", 1), ("ddtree", 1), ("ddtree", 1), ("ddtree", 2), ("ddtree", 2)]
