"""An impossible deployment fails in seconds with its cause in one line: from `ddserve serve`
(exit status 2, before Ray starts) and from the application builder `serve run` / `serve deploy`
call with the shipped deploy/serve_config.yaml (before any actor starts)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
import yaml
from serve_proc import ROOT, ddserve_cmd, ddserve_env

from ddserve.serve import preflight
from ddserve.serve.deployment import ServeConfig, build_app
from ddserve.serve.main import root_cause

BOUND_S = 60  # the 2-core CI machine, busy: the failures below take 5-20 s there


@pytest.fixture(scope="module")
def model_dir(tiny_int4_model_dir):
    """A random make-tiny model: it shards at tp = 1, 2, 4 but not 8 (experts of width 128 are
    4 INT4 groups). The embedded default shards at 8 (tests/core/test_default_model.py)."""
    return tiny_int4_model_dir


def _ddserve(*args: str) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run([*ddserve_cmd(), "serve", "--port", "1", *args], env=ddserve_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=BOUND_S)  # fmt: skip
    return proc.returncode, proc.stderr.splitlines(), time.monotonic() - t0


def _first_error(lines: list[str]) -> str:
    return next(ln for ln in lines if ln.startswith("ddserve: error:"))


NO_TWO_GPUS = torch.cuda.device_count() < 2  # where "gpus-missing" fails as it should
CASES = {  # id: (flags, the cause its first error line names)
    "tp3-heads": (["--model", "{tiny}", "--tp", "3"],
                  r"tp=3 .*num_attention_heads = 8 is not divisible"),
    "tp8-int4-groups": (["--model", "{tiny}", "--tp", "8"],
                        r"tp=8 .*moe_intermediate_size.*whole INT4 groups"),
    "missing-model": (["--model", "/nonexistent/ckpt"],
                      r"model directory /nonexistent/ckpt does not exist"),
    "missing-drafter": (["--drafter", "/nonexistent/dflash"],
                        r"drafter directory /nonexistent/dflash does not"),
    "embedded-tp3": (["--tp", "3"], r"tp=3 .*default_model: vocab_size = 4096 is not divisible"),
    "gpus-missing": (["--tp", "2", "--device", "cuda"], r"tp=2 on cuda needs 2 GPUs on one node"),
}  # fmt: skip


def _runs_here(name: str) -> bool:
    return name != "gpus-missing" or NO_TWO_GPUS


@pytest.fixture(scope="module")
def serve_runs(model_dir) -> dict[str, Future]:
    """Each case's `_ddserve` run, as many at once as there are cores (each is seconds of
    imports, then the preflight's refusal); a run's time is its own, from its start."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return {name: pool.submit(_ddserve, *(f.format(tiny=model_dir) for f in flags))
                for name, (flags, _) in CASES.items() if _runs_here(name)}  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.skipif(not _runs_here(n), reason="has GPUs"))
        for n in CASES
    ],
)
def test_ddserve_serve_exits_at_once_naming_the_cause(serve_runs, name) -> None:
    rc, lines, took = serve_runs[name].result()
    assert rc == 2, lines
    assert re.search(CASES[name][1], _first_error(lines)), lines
    assert not any("Started a local Ray" in ln for ln in lines)  # failed before Ray
    assert took < BOUND_S


def _shipped_args() -> dict:
    raw = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    return dict(raw["applications"][0]["args"])


def test_shipped_config_with_a_missing_model_fails_in_the_builder() -> None:
    args = _shipped_args()  # /models/Kimi-K2.6 does not exist here
    with pytest.raises(preflight.DeploymentError, match=f"model directory {args['model']} does"):
        build_app(args)


def test_shipped_config_with_a_missing_drafter_fails_in_the_builder(model_dir) -> None:
    args = {**_shipped_args(), "model": str(model_dir), "drafter": "/nonexistent/dflash"}
    with pytest.raises(preflight.DeploymentError, match="drafter directory /nonexistent/dflash"):
        build_app(args)


def test_shipped_tp8_on_a_model_it_cannot_shard_fails_in_the_builder(model_dir) -> None:
    args = {**_shipped_args(), "model": str(model_dir), "drafter": None}  # tp: 8 as shipped
    with pytest.raises(preflight.DeploymentError, match="tp=8 cannot shard"):
        build_app(args)


@pytest.fixture(scope="module")
def ray_one_cpu():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False,
             logging_level="ERROR")  # fmt: skip
    yield
    ray.shutdown()


@pytest.mark.slow
def test_shipped_config_asking_for_gpus_the_cluster_lacks_fails_in_the_builder(
    model_dir, ray_one_cpu
) -> None:
    import ray

    args = {**_shipped_args(), "model": str(model_dir), "drafter": None, "tp": 2}
    t0 = time.monotonic()
    with pytest.raises(preflight.DeploymentError, match="tp=2 on cuda needs 2 GPUs on one node"):
        build_app(args)
    assert time.monotonic() - t0 < 10
    assert not ray.util.placement_group_table()  # nothing was reserved or started


@pytest.mark.slow
def test_auto_tp_on_cuda_without_gpus_is_a_clear_error(model_dir, ray_one_cpu) -> None:
    args = {**_shipped_args(), "model": str(model_dir), "drafter": None, "tp": None}
    with pytest.raises(preflight.DeploymentError, match="no node .* has a GPU"):
        build_app(args)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_that_shards_the_model_passes(model_dir, tp: int) -> None:
    preflight.check_sharding(model_dir, tp)


def test_gpus_on_separate_nodes_do_not_host_a_strict_pack_replica() -> None:
    nodes = [{"CPU": 16, "GPU": 4}, {"CPU": 16, "GPU": 4}]
    preflight.check_resources("cuda", 4, 0.1, nodes)
    with pytest.raises(preflight.DeploymentError, match="needs 8 GPUs on one node.* is 4"):
        preflight.check_resources("cuda", 8, 0.1, nodes)
    nodes.append({"CPU": 192, "GPU": 8})  # a node type the autoscaler can launch
    preflight.check_resources("cuda", 8, 0.1, nodes)


def test_config_errors_become_one_line() -> None:
    from ddserve.serve.main import one_line_cause

    with pytest.raises(ValueError) as info:
        ServeConfig.model_validate({"max_streams": 40, "budget": 0})
    line = one_line_cause(info.value)
    assert "\n" not in line and "max_streams" in line and "budget" in line


def test_root_cause_is_the_innermost_exception_of_a_replica_traceback() -> None:
    text = """RuntimeError: Traceback (most recent call last):
  File "replica.py", line 1, in initialize
ray.exceptions.RayTaskError(StartupError): ray::Router.start() (pid=1)
ddserve.actors.router.StartupError: a shard failed to start: ValueError: heads = 8 ..."""
    assert root_cause(text) == "StartupError: a shard failed to start: ValueError: heads = 8 ..."
    assert root_cause("Deploying app failed.") is None
