"""One configuration object per layer (ServeConfig -> RouterConfig -> ShardSpec -> EngineConfig),
one set of defaults, one set of batching rules."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from ddserve.actors.router import RouterConfig
from ddserve.actors.shard import ShardSpec
from ddserve.cli import build_parser
from ddserve.engine.config import EngineConfig, check_batching
from ddserve.serve import preflight
from ddserve.serve.deployment import ServeConfig

ENGINE = EngineConfig()


def test_configs_are_built_by_keyword_only() -> None:
    with pytest.raises(TypeError):
        EngineConfig(4096)  # type: ignore[misc]
    with pytest.raises(TypeError):
        ShardSpec("m")  # type: ignore[misc]
    with pytest.raises(TypeError):
        RouterConfig(ShardSpec(model_path="m"))  # type: ignore[misc]


def test_serve_defaults_are_the_engine_and_router_defaults_but_fewer_streams() -> None:
    serve = ServeConfig()
    assert (serve.num_slots, serve.budget, serve.prefill_chunk) == (
        ENGINE.num_slots, ENGINE.budget, ENGINE.prefill_chunk)  # fmt: skip
    assert tuple(serve.buckets) == ENGINE.graph_buckets
    assert (serve.dtype, serve.batch_invariant) == (ENGINE.dtype, ENGINE.batch_invariant)
    router = RouterConfig(shard=ShardSpec(model_path="m"))
    for name in ("speculative", "max_queue", "control", "shard_cpus", "placement_timeout_s",
                 "warmup", "warmup_max_prefix"):  # fmt: skip
        assert getattr(serve, name) == getattr(router, name), name
    assert serve.max_streams == 10 < ENGINE.max_streams  # the one default serving names


def test_llm_defaults_are_the_engine_defaults_but_a_smaller_kv_pool() -> None:
    from ddserve.engine.llm import LLM, OFFLINE_NUM_SLOTS

    params = inspect.signature(LLM).parameters
    for f in fields(EngineConfig):
        if f.name in params and f.name not in ("num_slots", "seed"):
            assert params[f.name].default == getattr(ENGINE, f.name), f.name
    assert params["num_slots"].default == OFFLINE_NUM_SLOTS < ENGINE.num_slots
    assert params["seed"].default is None  # drawn per LLM, as serving draws one per start


def test_generate_cli_budget_is_the_engine_budget() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.budget == ENGINE.budget


def test_serve_config_resolves_into_router_shard_and_engine_configs(monkeypatch) -> None:
    monkeypatch.setattr(preflight, "node_shapes", lambda: [{"CPU": 4.0}])
    args = {"tp": 2, "max_streams": 4, "buckets": [1, 2, 4], "budgets": [16, 8, 4], "budget": 8,
            "num_slots": 4096, "prefill_chunk": 64, "seed": 7}  # fmt: skip
    serve = ServeConfig.model_validate(args)
    router, _ = serve.resolve()
    spec, engine = router.shard, router.shard.engine
    assert (spec.world_size, spec.device) == (2, "cpu")
    assert engine == EngineConfig(num_slots=4096, budget=16, prefill_chunk=64, dtype="float32",
                                  seed=7, max_streams=4, graph_buckets=(1, 2, 4))  # fmt: skip
    assert (router.max_streams, router.buckets, router.budgets) == (4, (1, 2, 4), (16, 8, 4))
    assert router.bucket(3) == (4, 4)


@pytest.mark.parametrize(
    ("serve", "router", "match"),
    [
        ({"buckets": [1, 2], "max_streams": 3}, {"buckets": (1, 2), "max_streams": 3},
         "max_streams"),
        ({"budgets": [8, 4]}, {"budgets": (8, 4)}, "one budget per bucket"),
        ({"buckets": [4, 2], "max_streams": 4}, {"buckets": (4, 2), "max_streams": 4},
         "increasing"),
    ],
)  # fmt: skip
def test_serve_and_router_configs_refuse_the_same_batching(serve, router, match) -> None:
    with pytest.raises(ValueError, match=match):
        ServeConfig.model_validate(serve)
    with pytest.raises(ValueError, match=match):
        engine = EngineConfig(
            graph_buckets=router.get("buckets", ENGINE.graph_buckets),
            max_streams=router.get("max_streams", ENGINE.max_streams),
        )
        RouterConfig(shard=ShardSpec(model_path="m", engine=engine), budgets=router.get("budgets"))


def test_the_engine_may_run_more_streams_than_its_largest_bucket() -> None:
    # the offline engine runs a batch beyond its graph buckets eagerly; the router pads every
    # batch to a bucket, so only the router needs one for each batch size
    EngineConfig(max_streams=32, graph_buckets=(1, 2, 4))
    with pytest.raises(ValueError, match="max_streams"):
        check_batching(buckets=(1, 2, 4), budget=16, num_slots=4096, max_streams=32)


def test_the_kv_pool_must_leave_room_beside_the_tree_budget() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        EngineConfig(num_slots=17, budget=16)
    with pytest.raises(ValueError, match="num_slots"):
        ServeConfig.model_validate({"budget": 64, "num_slots": 64})


def test_serve_cli_help_states_the_serve_config_defaults() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    helps = {a.dest: a.help for a in sub.choices["serve"]._actions}
    serve = ServeConfig()
    for name in ("max_streams", "budget", "num_slots", "max_queue"):
        assert str(getattr(serve, name)) in helps[name], name
