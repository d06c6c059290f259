"""GPU test modules run only where CUDA and triton are both present. Elsewhere each module is
reported as skipped with the reason, before it is imported (they import Triton kernel modules at
the top, which would fail at collection without triton)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _missing() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    if not torch.cuda.is_available():
        return "GPU test: needs CUDA (no CUDA device visible to torch)"
    try:
        if importlib.util.find_spec("triton") is None:
            return "GPU test: needs triton (pip install -e '.[gpu]')"
    except ValueError:  # a module entry without a spec (blocked or stubbed)
        return "GPU test: needs triton (not importable here)"
    return None


class _SkippedModule(pytest.Module):
    """A test module whose collection is reported as skipped instead of importing it."""

    reason = ""

    def collect(self):
        pytest.skip(self.reason)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    reason = _missing()
    if reason is None:
        return None
    module = _SkippedModule.from_parent(parent, path=module_path)
    module.reason = reason
    return module
