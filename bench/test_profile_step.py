"""Unit tests of bench/profile_step.py's attribution, and its CPU smoke run end to end
(`python -m pytest bench/test_profile_step.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from profile_step import METHODS, by_occurrence, category, graph_kernels, innermost  # noqa: E402

from ddserve.model.mla import MLA  # noqa: E402
from ddserve.model.moe import DenseMLP  # noqa: E402


def test_a_stamp_belongs_to_the_innermost_range_containing_it():
    ranges = [
        dict(name="model.layers.0", ts=0.0, dur=100.0),
        dict(name="model.layers.0.self_attn", ts=10.0, dur=50.0),
        dict(name="model.layers.0.self_attn.q_a_proj", ts=12.0, dur=5.0),
        dict(name="model.layers.0.mlp", ts=70.0, dur=20.0),
    ]
    stamps = [(11.0, 0), (13.0, 1), (20.0, 2), (75.0, 3), (95.0, 4), (150.0, 5)]
    got = innermost(stamps, ranges)
    assert got == {
        0: "model.layers.0.self_attn",
        1: "model.layers.0.self_attn.q_a_proj",
        2: "model.layers.0.self_attn",
        3: "model.layers.0.mlp",
        4: "model.layers.0",
        5: "",
    }


def test_graph_kernels_take_their_eager_module_by_name_and_occurrence():
    # eager: main-stream matmul, then the side stream's matmul and SiLU beside the main stream's
    # kernel
    eager = [
        ("mm", "attn.o_proj", 5.0),
        ("mm", "mlp.shared.gate_up", 3.0),
        ("gate", "mlp.gate", 4.0),
        ("silu", "mlp.shared", 1.0),
        ("mm", "mlp.shared.down", 2.0),
    ]
    # the replay interleaves the two streams differently: SiLU before the router's kernel
    names = ["mm", "mm", "silu", "gate", "mm", "extra"]
    assert by_occurrence(eager, names) == [
        "attn.o_proj", "mlp.shared.gate_up", "mlp.shared", "mlp.gate", "mlp.shared.down", None
    ]  # fmt: skip


def test_graph_kernel_durations_average_by_name_and_occurrence_across_replays():
    def k(name, ts, dur):
        return dict(cat="kernel", name=name, ts=ts, dur=dur)

    events = [  # replay 1: a, b (side), c; replay 2: b starts before a
        k("a", 0.0, 2.0), k("b", 1.0, 4.0), k("c", 6.0, 1.0),
        k("b", 10.0, 6.0), k("a", 11.0, 4.0), k("c", 17.0, 3.0),
        dict(cat="cpu_op", name="x", ts=0.0, dur=1.0),
    ]  # fmt: skip
    per, wall = graph_kernels(events, reps=2)
    assert per == [("a", 3.0), ("b", 5.0), ("c", 2.0)]
    assert wall == pytest.approx(((7.0 - 0.0) + (20.0 - 10.0)) / 2)


def test_every_annotated_method_exists():
    # a renamed method would silently leave its kernels to the caller's category
    for name in METHODS:
        assert any(callable(getattr(cls, name, None)) for cls in (MLA, DenseMLP)), name


@pytest.mark.parametrize(
    "path, mlp, kernel, want",
    [
        ("model.layers.3.self_attn.q_a_proj", "MoE", "_mm_kernel", "attention projections"),
        ("model.layers.3.self_attn.q_b_proj", "MoE", "_mm_kernel", "attention projections"),
        ("model.layers.3.self_attn", "MoE", "_mla_latent_kernel", "attention elementwise"),
        ("model.layers.3.self_attn", "MoE", "_tree_attn_inv_kernel", "tree attention"),
        ("model.layers.3.self_attn", "MoE", "_mm_kernel", "absorb bmm"),
        ("model.layers.3.self_attn", "MoE", "_mla_rope_cache_kernel", "attention elementwise"),
        ("model.layers.3", "MoE", "_add_rms_kernel", "RMSNorm"),
        ("model.layers.3.mlp.gate", "MoE", "_select_kernel", "router"),
        ("model.layers.3.mlp.shared_experts.down_proj", "MoE", "_mm_kernel", "shared expert"),
        ("model.layers.3.mlp", "MoE", "_w4_gemm_kernel", "routed MoE"),
        ("model.layers.0.mlp.down_proj", "DenseMLP", "_mm_kernel", "dense layer 0"),
        ("lm_head", None, "_mm_kernel", "lm_head"),
        ("model.layers.3.mlp", "MoE", "ncclDevKernel_AllReduce", "all-reduce"),
    ],
)
def test_kernels_fall_in_their_category(path, mlp, kernel, want):
    assert category(path, mlp, kernel) == want


def test_cpu_smoke_run_attributes_every_op_of_every_configuration(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(HERE / "profile_step.py"), "--small", "--device", "cpu",
           "--batches", "1,2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    budget = rep["budget"]
    got = [(c["kind"], c["batch"], c["tokens"]) for c in rep["configs"]]
    assert got == [
        ("ar", 1, 1),
        ("ar", 2, 2),
        ("ddtree", 1, budget + 1),
        ("ddtree", 2, 2 * (budget + 1)),
    ]
    for c in rep["configs"]:
        view = c["eager"]  # no graphs on the CPU
        cats = view["categories"]
        assert sum(v["kernels"] for v in cats.values()) == view["kernels"] > 0
        assert sum(v["us"] for v in cats.values()) == pytest.approx(view["kernel_us"])
        assert view["kernels_per_layer"] == pytest.approx(view["kernels"] / rep["layers"])
        for name in ("router", "attention projections", "routed MoE", "shared expert", "lm_head"):
            assert cats[name]["kernels"] > 0, name
            assert cats[name]["floor_us"] > 0, name
