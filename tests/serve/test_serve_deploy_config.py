"""deploy/serve_config.yaml, cluster.yaml and the serve CLI flags, checked with Ray's schemas."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from ddserve.actors.router import RouterConfig
from ddserve.actors.shard import ShardSpec
from ddserve.cli import build_parser
from ddserve.engine.config import EngineConfig
from ddserve.serve.deployment import ServeConfig
from ddserve.serve.main import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _router(*, budget: int = 16, buckets: tuple[int, ...] = (1, 2, 4, 8, 12, 16),
            max_streams: int = 10, **kw) -> RouterConfig:  # fmt: skip
    engine = EngineConfig(budget=budget, graph_buckets=buckets, max_streams=max_streams)
    return RouterConfig(shard=ShardSpec(model_path="m", engine=engine), **kw)


def test_serve_config_is_a_valid_serve_deploy_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)  # fmt: skip
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    cfg = ServeConfig.model_validate(app.args)
    assert cfg.tp == 8 and cfg.max_streams <= max(cfg.buckets)
    assert [d.name for d in app.deployments] == ["OpenAIServer"]


def test_cluster_yaml_passes_the_ray_launcher_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(raw))  # what `ray up` does before launching anything
    workers = [
        t for name, t in raw["available_node_types"].items() if name != raw["head_node_type"]
    ]
    assert any("p5e.48xlarge" in t["node_config"]["InstanceType"] for t in workers)
    assert any("pip install -e" in c for c in raw["setup_commands"])


def test_unknown_deployment_args_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_stream"):
        ServeConfig.model_validate({"max_stream": 4})


def test_serve_cli_flags_become_valid_deployment_args() -> None:
    args = build_parser().parse_args(["serve", "--tp", "4", "--max-streams", "6", "--budget", "8",
                                      "--no-speculative"])  # fmt: skip
    cfg = ServeConfig.model_validate(config_from_args(args))
    assert (cfg.tp, cfg.max_streams, cfg.budget, cfg.speculative) == (4, 6, 8, False)
    assert config_from_args(build_parser().parse_args(["serve"])).get("model") is None
    more = ["serve", "--buckets", "1,2,4", "--budgets", "16,8,4", "--num-slots", "4096",
            "--max-streams", "4", "--dtype", "float32", "--served-model-name", "k2",
            "--max-queue", "5"]  # fmt: skip
    cfg = ServeConfig.model_validate(config_from_args(build_parser().parse_args(more)))
    assert (cfg.buckets, cfg.budgets, cfg.num_slots) == ([1, 2, 4], [16, 8, 4], 4096)
    assert (cfg.dtype, cfg.served_model_name, cfg.max_queue) == ("float32", "k2", 5)
    with pytest.raises(SystemExit):  # argparse explains and exits 2
        build_parser().parse_args(["serve", "--buckets", "1,two"])


def test_batches_pad_to_the_smallest_bucket_with_its_budget() -> None:
    cfg = _router(budget=16, buckets=(1, 2, 4, 8), budgets=(16, 12, 8, 4), max_streams=8)
    assert [cfg.bucket(n) for n in (1, 2, 3, 4, 5, 8)] == [(1, 16), (2, 12), (4, 8), (4, 8),
                                                           (8, 4), (8, 4)]  # fmt: skip
    with pytest.raises(ValueError, match="max_streams"):
        _router(buckets=(1, 2), max_streams=3)
    with pytest.raises(ValueError, match="budget"):
        _router(budget=4, budgets=(8,) * 6)


def test_online_budgets_are_configured_and_bounded() -> None:
    args = build_parser().parse_args(["serve", "--budgets", "auto", "--budget", "32"])
    assert ServeConfig.model_validate(config_from_args(args)).budgets == "auto"
    _router(budget=16, budget_candidates=(4, 8, 16))
    with pytest.raises(ValueError, match="candidates"):
        _router(budget=16, budget_candidates=(4, 32))  # above the engine's KV reservation
    with pytest.raises(ValueError, match="not both"):
        _router(max_streams=2, buckets=(1, 2), budgets=(8, 4), budget_candidates=(4, 8))


@pytest.mark.parametrize(
    "bad",
    [{"buckets": [4, 2]}, {"max_streams": 12, "buckets": [1, 2, 4, 8]}, {"budgets": [8, 4]},
     {"budget": 64, "num_slots": 64}],
)  # fmt: skip
def test_inconsistent_deployments_fail_when_the_config_is_read(bad) -> None:
    with pytest.raises(ValueError):
        ServeConfig.model_validate(bad)


def test_cuda_graphs_and_batch_invariance_defaults_and_flags() -> None:
    def cfg(*flags: str) -> ServeConfig:
        return ServeConfig.model_validate(
            config_from_args(build_parser().parse_args(["serve", *flags]))
        )

    default = cfg()
    assert default.batch_invariant is True and default.cuda_graphs is None
    assert default.graphs_on("cuda", "bfloat16") and not default.graphs_on("cpu", "float32")
    assert not default.graphs_on("cuda", "float32")  # graphs need 16-bit compute
    assert not cfg("--no-cuda-graphs").graphs_on("cuda", "bfloat16")
    assert cfg("--cuda-graphs").graphs_on("cpu", "float32")  # explicit: the engine warns, eager
    assert cfg("--no-batch-invariant").batch_invariant is False


def test_serve_cli_waits_briefly_for_local_resources_and_can_skip_warmup() -> None:
    local = config_from_args(build_parser().parse_args(["serve", "--no-warmup"]))
    assert local["placement_timeout_s"] == 60.0 and local["warmup"] is False
    joined = config_from_args(build_parser().parse_args(["serve", "--address", "10.0.0.1:6379"]))
    cfg = ServeConfig.model_validate(joined)
    assert cfg.placement_timeout_s == 600.0 and cfg.warmup  # an autoscaler may launch a node
