"""Server-side counters from the Prometheus text on `/metrics`, read before and after a run.

The speculative-decoding figure is the mean accepted (committed) tokens per stream per step over
the run: delta `ddserve_committed_tokens_total` / delta `ddserve_stream_steps_total` (one stream
taking part in one batched step counts once). Servers without the per-stream counter fall back to
delta `ddserve_steps_total`. Where the server reports them, the router's mean time per batched step
in its shard call (`ddserve_step_seconds`) and the part of it outside the shards' commands
(`ddserve_control_seconds`: Ray and the router), in ms; with the run's duration over its steps
they say how much of a served step is the engine's.
"""

from __future__ import annotations

import httpx

STEPS = "ddserve_steps_total"
STREAM_STEPS = "ddserve_stream_steps_total"
COMMITTED = "ddserve_committed_tokens_total"
COUNTERS = {
    "steps": STEPS,
    "stream_steps": STREAM_STEPS,
    "committed_tokens": COMMITTED,
    "generation_tokens": "ddserve_generation_tokens_total",
    "prompt_tokens": "ddserve_prompt_tokens_total",
    "requests": "ddserve_requests_total",
    "step_seconds": "ddserve_step_seconds_sum",  # the router's time in its steps' shard calls
    "control_seconds": "ddserve_control_seconds_sum",  # of which outside the shards' commands
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value, summed over all its label sets; comment lines are skipped."""
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)[0], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The parsed `/metrics` of the server, or None when it has none (or is unreachable)."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prometheus(resp.text)


def server_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """Server counters' change over the run, and mean accepted tokens per step (or None)."""
    if before is None or after is None:
        return None
    delta = {
        key: after[name] - before.get(name, 0.0) for key, name in COUNTERS.items() if name in after
    }
    steps = delta.get("stream_steps", delta.get("steps"))
    committed = delta.get("committed_tokens")
    delta["accepted_tokens_per_step"] = (
        committed / steps if steps and committed is not None else None
    )
    batch_steps = delta.get("steps")
    for key, out in (("step_seconds", "step_ms_per_step"),
                     ("control_seconds", "control_ms_per_step")):  # fmt: skip
        total = delta.get(key)  # per batched step, in ms
        delta[out] = 1e3 * total / batch_steps if batch_steps and total is not None else None
    return delta
