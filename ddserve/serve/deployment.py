"""The Ray Serve application: a FastAPI ingress whose replica owns one Router (and its shards).

`build_app(args)` is the application builder `serve run` / `serve deploy` call with the
`args:` of deploy/serve_config.yaml; `ddserve serve` calls it too. One Serve replica = one model
replica (tp shards); scale out with `num_replicas`. A replica whose router or one of its shards
dies rebuilds that tensor-parallel group itself, answering 503 with Retry-After meanwhile
(supervisor.py); after `rebuild_attempts` failed attempts it fails its health check, so Serve
replaces it.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from ddserve.actors.budget import default_candidates
from ddserve.actors.router import RouterConfig
from ddserve.actors.shard import ShardSpec
from ddserve.engine.config import EngineConfig, check_batching
from ddserve.serve import preflight
from ddserve.serve.app import HttpLimits

log = logging.getLogger(__name__)


def _default(cls: type, name: str) -> Any:
    """The default the dataclass `cls` declares for its field `name`."""
    (f,) = [f for f in fields(cls) if f.name == name]
    return f.default


# ServeConfig's defaults are the ones the layers below declare, except where it says why not
_ENGINE, _HTTP = EngineConfig(), HttpLimits()


class ServeConfig(BaseModel):
    """Deployment arguments, validated at the edge; `resolve` turns them into the frozen
    dataclasses of the layers below (RouterConfig, holding ShardSpec, holding EngineConfig)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None  # checkpoint directory; None: the embedded ddserve-code-21m
    drafter: str | None = None  # DFlash drafter directory; None: the model's own `drafter/`
    # default: the checkpoint directory's name (the embedded default's: ddserve-code-21m)
    served_model_name: str | None = None
    tp: int | None = Field(None, ge=1)  # None: 2 on CPU, every GPU of one node
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: bf16 GPU, fp32 CPU
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = _ENGINE.dtype
    speculative: bool = _default(RouterConfig, "speculative")
    # fewer than the engine's 16: more streams make each verify forward touch more distinct
    # experts, so per-stream speed drops as the aggregate rises (docs/operations.md, Tuning)
    max_streams: int = Field(10, ge=1, le=16)
    max_queue: int = Field(_default(RouterConfig, "max_queue"), ge=1)  # every request queues
    budget: int = Field(_ENGINE.budget, ge=1)
    buckets: list[int] = list(_ENGINE.graph_buckets)
    # one per bucket, or "auto": the budget of each batch size is chosen online among powers
    # of two up to `budget`, by measured committed tokens per second
    budgets: list[int] | Literal["auto"] | None = None
    num_slots: int = Field(_ENGINE.num_slots, ge=64)
    prefill_chunk: int = Field(_ENGINE.prefill_chunk, ge=1)
    # base of the per-request seeds of requests that give none; None: drawn at start-up, so
    # unseeded sampling differs across restarts and replicas (every rank gets the same value)
    seed: int | None = None
    control: Literal["compiled", "fanout"] = _default(RouterConfig, "control")
    # Commands in flight from the router to the shards: 2 plans and sends the next step while
    # the shards run this one (hiding the Ray round trip); 1 waits for each result
    pipeline: int = Field(_default(RouterConfig, "pipeline"), ge=1, le=4)
    # replay decode/verify forwards from CUDA graphs, one per bucket and budget; None: on for
    # CUDA devices (a K2.6 rank step: 140-220 ms eager, 19-59 ms replayed; BENCHMARKS.md)
    cuda_graphs: bool | None = None
    # batch-invariant GPU kernels: DDTree output equals plain decoding bit for bit in bf16
    batch_invariant: bool = _ENGINE.batch_invariant
    shard_cpus: float = Field(_default(RouterConfig, "shard_cpus"), gt=0)
    # how long a replica waits for its shards' resources before it fails (an autoscaler may
    # need minutes to launch a GPU node)
    placement_timeout_s: float = Field(_default(RouterConfig, "placement_timeout_s"), gt=0)
    # run every step shape once (compiling kernels, capturing CUDA graphs) before serving, for
    # prefixes up to warmup_max_prefix tokens (longer ones capture their graphs on first use)
    warmup: bool = _default(RouterConfig, "warmup")
    warmup_max_prefix: int = Field(_default(RouterConfig, "warmup_max_prefix"), ge=256)
    # starts tried after a shard or the router died, with back-off, before the replica reports
    # unhealthy and Serve replaces it; 0: no rebuild (the replica is replaced at once)
    rebuild_attempts: int = Field(3, ge=0)
    # per-request limits checked before tokenization (HttpLimits in app.py says what each does)
    max_body_bytes: int = Field(_HTTP.max_body_bytes, ge=1)
    max_prompt_chars: int = Field(_HTTP.max_prompt_chars, ge=1)
    max_prompt_tokens: int | None = Field(_HTTP.max_prompt_tokens, ge=1)
    # the NAME of an environment variable holding the API key clients must send as
    # `Authorization: Bearer <key>`; None: no key. A replica whose variable is unset or empty
    # fails to start.
    api_key_env: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        """The batching rules every layer checks (`check_batching`), when the config is read:
        `serve deploy` fails at once instead of a replica failing its start-up again and again."""
        check_batching(
            buckets=self.buckets, budget=self._engine_budget(), num_slots=self.num_slots,
            max_streams=self.max_streams, budgets=self._fixed_budgets() or None,
            budget_candidates=self._candidates(),
        )  # fmt: skip
        return self

    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.max_body_bytes, self.max_prompt_chars, self.max_prompt_tokens)

    def api_key(self) -> str | None:
        """The key `api_key_env` names, read from this process's environment (None: no key).
        Raises ValueError (one line, naming the variable, never a value) if unset or empty."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is "
                             "unset or empty on the replica")  # fmt: skip
        return key

    def graphs_on(self, device: str, dtype: str) -> bool:
        """`cuda_graphs`, or by default: on where graphs work (CUDA, 16-bit compute)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return device == "cuda" and dtype != "float32"

    def _fixed_budgets(self) -> list[int]:
        return [] if self.budgets in (None, "auto") else list(self.budgets)

    def _candidates(self) -> tuple[int, ...] | None:
        return default_candidates(self.budget) if self.budgets == "auto" else None

    def _engine_budget(self) -> int:
        """The engine's budget (its KV reservation): the largest any bucket may use."""
        return max([self.budget, *self._fixed_budgets()])

    def model_dir(self) -> Path:
        """The checkpoint directory (default: the embedded pair packaged with ddserve)."""
        return Path(self.model) if self.model else _default_model()

    def drafter_dir(self, model: Path) -> str | None:
        """`drafter`, or the checkpoint's own `drafter/` when it has one."""
        if self.drafter is None and (model / "drafter" / "config.json").exists():
            return str(model / "drafter")
        return self.drafter

    def placement(self, nodes: list[dict[str, float]] | None = None) -> Placement:
        """Where and how the shards run, filling defaults from `nodes` (the resources of each
        node; default: the connected Ray cluster's, autoscaler node types included)."""
        nodes = preflight.node_shapes() if nodes is None else nodes
        gpus = max((s.get("GPU", 0) for s in nodes), default=0)
        device = self.device if self.device != "auto" else ("cuda" if gpus >= 1 else "cpu")
        tp = self.tp or (2 if device == "cpu" else int(gpus))
        if tp < 1:
            raise preflight.DeploymentError("device cuda, but no node (or node type) has a GPU")
        dtype = (
            self.dtype if self.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
        )
        return Placement(device, tp, dtype)

    def preflight(self, nodes: list[dict[str, float]] | None) -> None:
        """Raises DeploymentError (one line) when the deployment cannot start on these nodes:
        missing paths, a tp that does not shard the model, resources no node offers. With
        `nodes` None (cluster unknown yet) only the paths and an explicit tp are checked."""
        model = self.model_dir()
        preflight.check_paths(model, self.drafter_dir(model))
        if nodes is None:
            if self.tp is not None:
                preflight.check_sharding(model, self.tp)
            return
        where = self.placement(nodes)
        preflight.check_sharding(model, where.tp)
        preflight.check_resources(where.device, where.tp, self.shard_cpus, nodes)

    def resolve(self) -> tuple[RouterConfig, str]:
        """(RouterConfig, served model name), filling defaults from the running Ray cluster."""
        model = self.model_dir()
        drafter = self.drafter_dir(model)
        where = self.placement()
        engine = EngineConfig(
            num_slots=self.num_slots,
            budget=self._engine_budget(),
            prefill_chunk=self.prefill_chunk,
            dtype=where.dtype,
            seed=self.seed if self.seed is not None else secrets.randbits(31),
            max_streams=self.max_streams,
            cuda_graphs=self.graphs_on(where.device, where.dtype),
            graph_buckets=tuple(self.buckets),
            batch_invariant=self.batch_invariant,
        )
        spec = ShardSpec(
            model_path=str(model),
            world_size=where.tp,
            drafter_path=drafter,
            device=where.device,
            engine=engine,
        )
        cfg = RouterConfig(
            shard=spec,
            speculative=self.speculative and drafter is not None,
            max_queue=self.max_queue,
            budgets=tuple(self._fixed_budgets()) or None,
            budget_candidates=self._candidates(),
            control=self.control,
            pipeline=self.pipeline,
            shard_cpus=self.shard_cpus,
            placement_timeout_s=self.placement_timeout_s,
            warmup=self.warmup,
            warmup_max_prefix=self.warmup_max_prefix,
        )
        return cfg, self.served_model_name or (model.name if self.model else _default_name())


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda"
    tp: int
    dtype: str


def _default_model() -> Path:
    from ddserve.model.tiny import default_model_dir

    return default_model_dir()


def _default_name() -> str:
    from ddserve.model.tiny import DEFAULT_NAME

    return DEFAULT_NAME


@serve.deployment(
    ray_actor_options={"num_cpus": 0.1},
    max_ongoing_requests=1024,
    health_check_period_s=5,
    health_check_timeout_s=30,
)
@serve.ingress()
class OpenAIServer:
    async def __init__(self, config: dict[str, Any]) -> None:
        from ddserve.actors.remote import start_router
        from ddserve.actors.supervisor import RebuildPolicy, SupervisedEngine
        from ddserve.serve.app import ServedModel
        from ddserve.tokenizer import Tokenizer

        serve_cfg = ServeConfig.model_validate(config)
        self._limits, self._api_key = serve_cfg.http_limits(), serve_cfg.api_key()
        # again: `serve run module:build_app` calls the builder before it connects to Ray
        serve_cfg.preflight(preflight.node_shapes())
        cfg, name = serve_cfg.resolve()
        tok = Tokenizer.from_dir(cfg.shard.model_path)
        replica = serve.get_replica_context().replica_id.unique_id

        def start(generation: int) -> Any:  # a fresh name: the dead router's may not be free yet
            suffix = "" if generation == 1 else f"-{generation}"
            return start_router(cfg, name=f"ddserve-router-{replica}{suffix}")

        policy = RebuildPolicy(attempts=serve_cfg.rebuild_attempts)
        self._engine = SupervisedEngine(start, policy)
        info = await self._engine.start()
        engine = cfg.shard.engine
        ctx = min(info["max_position_embeddings"], engine.num_slots - engine.budget - 1)
        self._model = ServedModel(name, ctx, tok, info["vocab_size"])
        log.info(
            "ddserve replica %s: %s tp=%d on %s, speculative=%s, control=%s",
            replica,
            name,
            cfg.shard.world_size,
            cfg.shard.device,
            info["speculative"],
            cfg.control,
        )

    def __serve_build_asgi_app__(self) -> Any:
        from ddserve.serve.app import create_app

        return create_app(self._engine, self._model, limits=self._limits, api_key=self._api_key)

    async def check_health(self) -> None:
        await self._engine.check_health()  # a rebuild under way is healthy: see its docstring

    async def __del__(self) -> None:
        try:
            await self._engine.close()
        except Exception:  # noqa: BLE001 - the router may already be gone
            pass


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder: `serve run ddserve.serve.app:build_app model=/path tp=8`. Raises
    DeploymentError (before any actor starts) when the deployment cannot start."""
    import ray

    nodes = preflight.node_shapes() if ray.is_initialized() else None
    ServeConfig.model_validate(args).preflight(nodes)
    return OpenAIServer.bind(dict(args))
