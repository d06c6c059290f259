"""Kernel selection: no environment read at import, one declared set of environment overrides
resolved into an engine's `KernelConfig`, and the MoE's v3 -> v2 fallback rules.

The import check runs in a subprocess (a fresh interpreter, so every kernel module really is
imported there) that records every environment lookup made by ddserve's own code while importing
all of `ddserve.kernels`. The fallback checks replace the two MoE variants with stubs: no kernel
runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_interp import require_triton

require_triton()  # the child imports the Triton kernel modules
ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import importlib, json, os, pkgutil, sys

seen = []
_getitem = type(os.environ).__getitem__


def _recording_getitem(self, key):
    frame = sys._getframe(1)
    while frame.f_code.co_filename.endswith(("os.py", "os>", "_collections_abc.py", "abc>")):
        frame = frame.f_back  # os.environ.get / `in` -> the code that asked
    if "/ddserve/" in frame.f_code.co_filename:
        seen.append(f"{key} ({frame.f_code.co_filename.rsplit('/', 1)[-1]})")
    return _getitem(self, key)


type(os.environ).__getitem__ = _recording_getitem  # get() and `in` go through __getitem__
import ddserve.kernels as pkg

names = [m.name for m in pkgutil.iter_modules(pkg.__path__)]
for name in names:
    importlib.import_module(f"ddserve.kernels.{name}")
print("RESULT " + json.dumps(dict(modules=names, read=seen)))
"""


def test_no_kernel_module_reads_the_environment_at_import():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDSERVE_")}
    env.pop("TRITON_INTERPRET", None)
    env.update(PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    rec = json.loads(line[len("RESULT ") :])
    assert {"backend", "moe_triton", "tree_attn_invariant", "invariant_configs"} <= set(
        rec["modules"]
    )
    assert rec["read"] == []


def _int4_experts():
    from ddserve.kernels.moe_ref import ExpertWeights, quantize_int4

    w13p, s13 = quantize_int4(torch.randn(2, 64, 64))
    w2p, s2 = quantize_int4(torch.randn(2, 64, 32))
    return ExpertWeights(w13_packed=w13p, w13_scale=s13, w2_packed=w2p, w2_scale=s2)


def test_every_environment_override_is_declared_in_config():
    from ddserve.kernels.config import ENV_OVERRIDES

    names = set()
    for path in (ROOT / "ddserve" / "kernels").glob("*.py"):
        names |= set(re.findall(r"DDSERVE_\w+", path.read_text()))
    assert names == set(ENV_OVERRIDES)


def test_kernel_config_takes_arguments_then_the_environment():
    from ddserve.kernels.config import KernelConfig

    env = {"DDSERVE_MOE_VARIANT": "v2"}
    assert KernelConfig.resolve(True, env={}) == KernelConfig(batch_invariant=True)
    assert KernelConfig.resolve(False, env=env) == KernelConfig(False, moe_variant="v2")
    assert KernelConfig.resolve(True, moe_variant="v3", env=env).moe_variant == "v3"
    with pytest.raises(ValueError, match="v1"):
        KernelConfig.resolve(True, env={"DDSERVE_MOE_VARIANT": "v1"})


def test_side_stream_is_on_unless_the_environment_turns_it_off():
    from ddserve.kernels.config import KernelConfig

    assert KernelConfig.resolve(True, env={}).side_stream
    for off in ("0", "off", "False"):
        assert not KernelConfig.resolve(True, env={"DDSERVE_SIDE_STREAM": off}).side_stream


def test_split_matmuls_inside_a_side_branch_take_their_own_scratch(monkeypatch):
    from ddserve.kernels import backend
    from ddserve.kernels import invariant as inv

    dev = torch.device("cpu")
    main = inv.scratch(dev)
    monkeypatch.setattr(backend, "_on_side", True)  # as inside `side_branch` on a GPU
    side = inv.scratch(dev)
    assert side is not main and side is inv.scratch(dev)
    monkeypatch.setattr(backend, "_on_side", False)
    assert inv.scratch(dev) is main


def test_side_branch_on_the_cpu_runs_its_body_in_place():
    from ddserve.kernels import backend

    x = torch.ones(3)
    before = torch.cuda.current_stream() if torch.cuda.is_available() else None
    with backend.side_branch(x) as join:
        assert not backend.on_side_stream()
        y = x * 2
    join()
    assert torch.equal(y, torch.full((3,), 2.0))
    if before is not None:
        assert torch.cuda.current_stream() == before


@pytest.fixture
def moe(monkeypatch):
    """`moe_triton` with v3 chosen by default and both variants stubbed (v2 returns ones)."""
    from ddserve.kernels import moe_triton

    def v2(x, *args, **kwargs):
        return torch.ones_like(x)

    monkeypatch.setattr(moe_triton, "V3_ERROR", None)
    monkeypatch.setattr(moe_triton, "default_variant", lambda x, w: "v3")
    monkeypatch.setattr(moe_triton, "fused_moe_v2", v2)
    monkeypatch.setitem(moe_triton.VARIANTS, "v2", v2)
    return moe_triton


def _call(moe_triton):
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    return moe_triton.fused_moe(x, torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1),
                                _int4_experts())  # fmt: skip


def test_v3_compile_failure_falls_back_to_v2_and_is_recorded(moe, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(moe, "fused_moe_v3", fails)
    assert torch.equal(_call(moe), torch.ones(3, 64, dtype=torch.bfloat16))
    assert moe.V3_ERROR.startswith("RuntimeError: PassManager::run failed")


def test_v3_out_of_memory_is_raised_not_a_fallback(moe, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("out of memory")

    monkeypatch.setattr(moe, "fused_moe_v3", oom)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _call(moe)
    assert moe.V3_ERROR is None


def test_the_engine_config_names_the_moe_variant_without_fallback(moe, monkeypatch):
    from ddserve.kernels import backend
    from ddserve.kernels.config import KernelConfig

    def v3(*args, **kwargs):
        raise AssertionError("v3 ran")

    monkeypatch.setattr(moe, "fused_moe_v3", v3)
    monkeypatch.setitem(moe.VARIANTS, "v3", v3)
    with backend.kernel_mode(KernelConfig(batch_invariant=True, moe_variant="v2")):
        assert torch.equal(_call(moe), torch.ones(3, 64, dtype=torch.bfloat16))
    with backend.kernel_mode(KernelConfig(moe_variant="v3")), pytest.raises(AssertionError):
        _call(moe)  # named: raised, not a fallback
    assert moe.V3_ERROR is None
