"""Kernel environment variables are checked at import, and the MoE fast-path fallback rules.

Each check runs in a subprocess (the variables are read when the modules are first imported, and
importing Triton kernel modules here could fix TRITON_INTERPRET for other tests of this process).
An unknown DDSERVE_TREE_ATTN_INVARIANT / DDSERVE_INVARIANT_CONFIGS / DDSERVE_INVARIANT_FP32 must
log a warning naming the valid choices and use the default (m32, "a", "tf32x3"); a valid one must
be honoured. The selection is compared with the preset / set functions called directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.triton_interp import require_triton

require_triton()  # the child imports the Triton kernel modules
ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json

import torch

import ddserve.kernels.invariant_configs as ic
import ddserve.kernels.tree_attn_invariant as ta
import ddserve.kernels.moe_triton_v2 as v2

rec = dict(
    preset=ta.DEFAULT_PRESET,
    config_is_preset=ta.INVARIANT_CONFIG == ta.PRESETS[ta.DEFAULT_PRESET],
    current=ic.current_configs(),
    # what a forward asks for (the KeyError used to surface here), and every set's answer
    dense=list(ic.mm_config(4096, 1024, torch.bfloat16)),
    fp32=list(ic.mm_config(256, 7168, torch.float32)),
    dense_sets={k: list(f(4096, 1024, 1)) for k, f in ic.DENSE_SETS.items()},
    fp32_sets={k: list(f(256, 7168, 1)) for k, f in ic.FP32_SETS.items()},
    presets=sorted(ta.PRESETS),
    oom_falls_back=v2._may_fall_back(torch.cuda.OutOfMemoryError("out of memory")),
    compile_falls_back=v2._may_fall_back(RuntimeError("PassManager::run failed")),
)


def _oom(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("out of memory")


v2.up_tma = _oom  # the TMA up kernel hits an OOM: raised, TMA stays enabled
try:
    v2._up_tma_or_fallback((), {}, True, {"MODE": 0})
    rec["oom_raised"] = False
except torch.cuda.OutOfMemoryError:
    rec["oom_raised"] = True
rec["tma_error"] = v2.TMA_ERROR
print("RESULT " + json.dumps(rec))
"""


def _run(env_vars: dict[str, str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDSERVE_")}
    env.pop("TRITON_INTERPRET", None)
    env.update(env_vars, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :]), proc.stderr


def test_unknown_values_warn_and_fall_back_to_defaults():
    rec, err = _run(
        {
            "DDSERVE_TREE_ATTN_INVARIANT": "m99",
            "DDSERVE_INVARIANT_CONFIGS": "zz",
            "DDSERVE_INVARIANT_FP32": "fp64",
        }
    )
    assert rec["preset"] == "m32" and rec["config_is_preset"]
    assert rec["current"] == {"dense": "a", "fp32": "tf32x3"}
    assert rec["dense"] == rec["dense_sets"]["a"] and rec["fp32"] == rec["fp32_sets"]["tf32x3"]
    for var, bad, choices in (
        ("DDSERVE_TREE_ATTN_INVARIANT", "m99", rec["presets"]),
        ("DDSERVE_INVARIANT_CONFIGS", "zz", rec["dense_sets"]),
        ("DDSERVE_INVARIANT_FP32", "fp64", rec["fp32_sets"]),
    ):
        lines = [ln for ln in err.splitlines() if var in ln]
        assert len(lines) == 1 and repr(bad) in lines[0], err[-3000:]
        assert all(c in lines[0] for c in choices), lines[0]
    # MoE fallbacks: only for errors other than OOM (and never during graph capture)
    assert rec["compile_falls_back"] and not rec["oom_falls_back"]
    assert rec["oom_raised"] and rec["tma_error"] is None


def test_valid_values_are_used_without_warning():
    rec, err = _run(
        {
            "DDSERVE_TREE_ATTN_INVARIANT": "m16",
            "DDSERVE_INVARIANT_CONFIGS": "b",
            "DDSERVE_INVARIANT_FP32": "ieee",
        }
    )
    assert rec["preset"] == "m16" and rec["config_is_preset"]
    assert rec["current"] == {"dense": "b", "fp32": "ieee"}
    assert rec["dense"] == rec["dense_sets"]["b"] and rec["fp32"] == rec["fp32_sets"]["ieee"]
    assert "DDSERVE_" not in err, err[-3000:]
