"""Terminal summary, JSON result file and the sweep plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

_W = 50


def _row(label: str, value: object, width: int = _W) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<{width - 12}}{value!s:>12}"


def _latency_block(title: str, key: str, run: dict) -> list[str]:
    s = run.get(key)
    lines = [f" {title} ".center(_W, "-")]
    if s is None:
        return lines + [_row(f"{key}: no samples", "-")]
    name = key.split("_")[0].upper()
    for stat in ("mean", "median", "p90", "p99"):
        lines.append(_row(f"{stat.capitalize()} {name} (ms):", s[stat]))
    return lines


def format_summary(run: dict) -> str:
    """A vLLM-style result table of one run (a dict from `run.run_point`)."""
    shape = f"rate {run['request_rate']}/s" if run.get("request_rate") else "closed loop"
    lines = [
        " Serving Benchmark Result ".center(_W, "="),
        _row("Load:", f"{shape}, c={run['concurrency']}"),
        _row("Successful requests:", run["completed"]),
        _row("Failed requests:", run["failed"]),
        _row("Cancelled at --duration:", run["cancelled"]),
        _row("Benchmark duration (s):", run["duration_s"]),
        _row("Total input tokens:", run["total_input_tokens"]),
        _row("Total generated tokens:", run["total_output_tokens"]),
        _row("Request throughput (req/s):", run["request_throughput"]),
        _row("Output token throughput (tok/s):", run["output_throughput"]),
        _row("Total token throughput (tok/s):", run["total_token_throughput"]),
    ]
    server = run.get("server") or {}
    acc = server.get("accepted_tokens_per_step")
    lines.append(_row("Accepted tokens per step (server):", acc if acc is not None else "n/a"))
    for key, label in (("step_ms_per_step", "Step shard call (ms, server):"),
                       ("control_ms_per_step", "  of it outside the shards (ms):")):  # fmt: skip
        if server.get(key) is not None:
            lines.append(_row(label, server[key]))
    lines += _latency_block("Time to First Token", "ttft_ms", run)
    lines += _latency_block("Time per Output Token (excl. 1st)", "tpot_ms", run)
    lines += _latency_block("Inter-token Latency (per chunk)", "itl_ms", run)
    lines += _latency_block("End-to-end Latency", "e2e_ms", run)
    for err, n in list(run.get("errors", {}).items())[:5]:
        lines.append(f"  error x{n}: {err[: _W * 2]}")
    lines.append("=" * _W)
    return "\n".join(lines)


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def _stat(runs: Sequence[dict], key: str, stat: str) -> list[float]:
    return [(r.get(key) or {}).get(stat, float("nan")) for r in runs]


def plot_sweep(runs: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """PNG: output throughput, TPOT p50/p99 and TTFT p50/p99 against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: r["concurrency"])
    conc = [r["concurrency"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ax = axes[0]
    ax.plot(conc, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax.plot(conc, [r["total_token_throughput"] for r in runs], "s--", label="total tok/s")
    ax.set_title("Throughput")
    ax.set_ylabel("tokens / s")
    for a, key, name in ((axes[1], "tpot_ms", "TPOT"), (axes[2], "ttft_ms", "TTFT")):
        a.plot(conc, _stat(runs, key, "median"), "o-", label=f"{name} p50")
        a.plot(conc, _stat(runs, key, "p99"), "^--", label=f"{name} p99")
        a.set_title(name)
        a.set_ylabel("ms")
    for a in axes:
        a.set_xlabel("concurrency")
        a.set_xticks(conc)
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        a.legend()
    acc = [(r.get("server") or {}).get("accepted_tokens_per_step") for r in runs]
    if any(a is not None for a in acc):
        text = ", ".join(f"c={c}: {a:.2f}" for c, a in zip(conc, acc, strict=True) if a is not None)
        title = (title + "\n" if title else "") + f"accepted tokens/step: {text}"
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
