"""The CPU engine needs no GPU-only package: `ddserve generate` (DDTree with the bundled drafter,
and plain decoding) runs in a process where importing triton, cupy or sgl_kernel fails, and
nothing on its path even tries to import them (kernel modules load behind the backend choice).

The child process installs a meta-path blocker before anything else is imported, so this holds
whether or not those packages are installed here. torch's own optional probes (torch._dynamo
tries `import triton` inside a try) meet the blocker too; only ddserve's imports are recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import importlib.abc, json, sys

GPU_ONLY = ("triton", "cupy", "sgl_kernel")
tried = []  # [module, importing module] of every import of ddserve's that reached the blocker


def importer() -> str:
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?")


class BlockGpuOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in GPU_ONLY:
            if importer().startswith("ddserve"):
                tried.append([name, importer()])
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, BlockGpuOnly())
from ddserve.cli import main

model = sys.argv[1]
base = ["generate", "--model", model, "--prompt", "Hello", "--max-tokens", "8", "--device", "cpu"]
codes = [main([*base, "--no-speculative"]), main(base)]
print(json.dumps({"codes": codes, "tried": tried}))
"""


def test_generate_runs_with_gpu_packages_unimportable(tiny_int4_model_dir: Path) -> None:
    assert (tiny_int4_model_dir / "drafter" / "config.json").exists()  # DDTree runs too
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_int4_model_dir)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    *texts, report = proc.stdout.splitlines()
    result = json.loads(report)
    assert result == {"codes": [0, 0], "tried": []}
    ar, ddtree = texts  # greedy: the DDTree completion is the autoregressive one
    assert ar == ddtree
    stats = [ln for ln in proc.stderr.splitlines() if "tokens/step" in ln]
    assert len(stats) == 2 and "8 tokens" in stats[1], proc.stderr[-2000:]


def test_without_torch_the_command_says_how_to_install_it(monkeypatch, capsys) -> None:
    """Every subcommand runs the model: with no torch importable, `ddserve` exits 2 with the
    install step instead of a traceback from deep inside the engine."""
    import importlib.util

    from ddserve import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert cli.main(["generate", "--prompt", "def f():"]) == 2
    err = capsys.readouterr().err
    assert "PyTorch is not installed" in err and "pip install torch==2.13.0" in err
