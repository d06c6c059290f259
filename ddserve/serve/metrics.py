"""Prometheus text exposition for /metrics (names fixed in docs/architecture.md).

Request and token counters live in the HTTP layer (`HttpCounters`); engine gauges, step counters
and the step-time histogram come from `EngineClient.stats()`. Both are turned into metric
families and written with `prometheus_client` when it imports (it ships with ray[serve]),
otherwise with the small writer below that emits the same text format.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class HttpCounters:
    requests: Counter = field(default_factory=Counter)  # status -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def finish(self, status: str, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        self.requests[status] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens


@dataclass
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    samples: list[tuple[str, dict[str, str], float]]  # (full sample name, labels, value)


def families(http: HttpCounters, engine: dict) -> list[Family]:
    def one(name: str, kind: str, help_: str, value: float) -> Family:
        sample = f"{name}_total" if kind == "counter" else name
        return Family(name, kind, help_, [(sample, {}, float(value))])

    reqs = Family("ddserve_requests", "counter", "Finished HTTP generation requests by status.", [])
    reqs.samples = [
        ("ddserve_requests_total", {"status": s}, float(n))
        for s, n in sorted(http.requests.items())
    ]
    out = [
        reqs,
        one(
            "ddserve_prompt_tokens",
            "counter",
            "Prompt tokens of admitted requests.",
            http.prompt_tokens,
        ),
        one(
            "ddserve_generation_tokens",
            "counter",
            "Completion tokens returned.",
            http.generation_tokens,
        ),
        one(
            "ddserve_queue_depth",
            "gauge",
            "Requests waiting for a stream slot.",
            engine.get("queue_depth", 0),
        ),
        one(
            "ddserve_active_streams",
            "gauge",
            "Streams being decoded.",
            engine.get("active_streams", 0),
        ),
        one("ddserve_steps", "counter", "Decode steps run.", engine.get("steps_total", 0)),
        one(
            "ddserve_stream_steps",
            "counter",
            "Decode steps summed over the streams in each batch.",
            engine.get("stream_steps_total", 0),
        ),
        one(
            "ddserve_committed_tokens",
            "counter",
            "Tokens committed by decode steps.",
            engine.get("committed_tokens_total", 0),
        ),
        one(
            "ddserve_accepted_tokens_per_step",
            "gauge",
            "Mean tokens a stream commits per step since start (committed / stream_steps).",
            engine.get("accepted_tokens_per_step", 0.0),
        ),
        one(
            "ddserve_deferred_admissions",
            "counter",
            "Admissions put back in the queue because the KV pool was full.",
            engine.get("deferred_total", 0),
        ),
        one(
            "ddserve_kv_slots_used",
            "gauge",
            "KV cache token slots in use.",
            engine.get("kv_slots_used", 0),
        ),
        one(
            "ddserve_kv_slots_total",
            "gauge",
            "KV cache token slots.",
            engine.get("kv_slots_total", 0),
        ),
        one(
            "ddserve_healthy",
            "gauge",
            "1 while the engine serves (0 while its tensor-parallel group is being rebuilt).",
            1 if engine.get("healthy", True) else 0,
        ),
        one(
            "ddserve_engine_rebuilds",
            "counter",
            "Times the replica rebuilt its tensor-parallel group after a shard or router died.",
            engine.get("rebuilds_total", 0),
        ),
    ]
    budgets = engine.get("bucket_budgets") or {}
    out.append(
        Family(
            "ddserve_batch_budget",
            "gauge",
            "DDTree budget used at each batch size (fixed per bucket, or the online tuner's).",
            [("ddserve_batch_budget", {"batch": str(b)}, float(n)) for b, n in budgets.items()],
        )
    )
    for key, help_ in (
        ("step_seconds", "Wall time of one decode step as the router sees it."),
        ("control_seconds", "Per-step router and Ray overhead (step wall time minus shard time)."),
    ):
        if key in engine:
            out.append(_histogram(f"ddserve_{key}", help_, engine[key]))
    return out


def _histogram(name: str, help_: str, h: dict) -> Family:
    samples = [(f"{name}_bucket", {"le": _fmt(le)}, float(c)) for le, c in h["buckets"]]
    samples += [(f"{name}_sum", {}, float(h["sum"])), (f"{name}_count", {}, float(h["count"]))]
    return Family(name, "histogram", help_, samples)


def render(http: HttpCounters, engine: dict) -> str:
    fams = families(http, engine)
    try:
        return _render_prometheus_client(fams)
    except ImportError:
        return render_text(fams)


def _render_prometheus_client(fams: list[Family]) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric

    class _Snapshot:
        def collect(self):  # noqa: ANN202 (prometheus_client collector protocol)
            for f in fams:
                m = Metric(f.name, f.help, f.kind)
                for sample, labels, value in f.samples:
                    m.add_sample(sample, labels, value)
                yield m

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return generate_latest(registry).decode()


def render_text(fams: list[Family]) -> str:
    """The Prometheus 0.0.4 text format, written directly."""
    lines = []
    for f in fams:
        lines.append(f"# HELP {f.name}{'_total' if f.kind == 'counter' else ''} {f.help}")
        lines.append(f"# TYPE {f.name}{'_total' if f.kind == 'counter' else ''} {f.kind}")
        for sample, labels, value in f.samples:
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{sample}{'{' + lab + '}' if lab else ''} {_fmt(value)}")
    return "\n".join(lines) + "\n"


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
