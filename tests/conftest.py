"""Shared fixtures: tiny random checkpoints of the target architecture, written once per session."""

from __future__ import annotations

import os
from pathlib import Path

# Before anything imports Ray: `ddserve serve` keeps its private Ray on 127.0.0.1 with this
# setting (ddserve.serve.main.RAY_SINGLE_NODE_ENV); a test that attaches to that Ray needs it too,
# or Ray rewrites 127.0.0.1 to the machine's address, where the GCS does not listen.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from ddserve.model.tiny import make_tiny  # noqa: E402
from tests import triton_interp  # noqa: E402

# Tiny shapes gain nothing from intra-op threads, and on a shared 2-core CI machine extra threads
# oversubscribe the cores (10x slower measured). An explicit OMP_NUM_THREADS still wins.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the Triton-interpreter runs that the collected `interpreter` tests will read, in
    the background (tests/triton_interp.py): they take minutes of one core each."""
    if session.config.option.collectonly or importlib.util.find_spec("triton") is None:
        return
    scripts = [item.path for item in session.items if item.get_closest_marker("interpreter")]
    triton_interp.start_runs(dict.fromkeys(scripts))


def pytest_sessionfinish(session: pytest.Session) -> None:
    triton_interp.stop_runs()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (seed 0) with bf16 routed experts."""
    return make_tiny(tmp_path_factory.mktemp("tiny_bf16"), int4=False, seed=0)


@pytest.fixture(scope="session")
def tiny_int4_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (seed 0) with compressed-tensors INT4 routed experts."""
    return make_tiny(tmp_path_factory.mktemp("tiny_int4"), int4=True, seed=0)
