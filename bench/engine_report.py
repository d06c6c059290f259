"""The engine benchmark's numbers: bandwidth floor (bytes a step must read / copy bandwidth),
JSON entries, table."""

from __future__ import annotations

import json
import os
import statistics

from engine_model import parameter_bytes, weight_bytes_per_layer
from engine_probe import uniform_distinct
from engine_runs import RunResult

from ddserve.engine.runner import ModelRunner

NOTES = [
    "Random weights: a real drafter's acceptance cannot be measured. The oracle drafter's "
    "acceptance is a controlled input (corrupt = probability that a depth's guess is wrong); "
    "the headline is step cost vs budget and batch, and break_even_committed.",
    "Model: one tp=8 rank of Kimi K2.6 run as tp=1 (8 of 64 heads, expert width 2048/8, dense "
    "18432/8, shared expert 2048/8, vocab slice 163840/8 = 20480). A real rank's lm_head is "
    "this slice and its logits would be all-gathered to the full vocabulary; the all-gather "
    "and the 2 all-reduces per layer are not in this run (tp=1, no collectives).",
    "break_even_committed = DDTree step / AR step (tokens one stream must commit per DDTree "
    "step to match AR tokens/s at the same C); speedup_vs_ar = committed_per_step / that. "
    "break_even_committed_graph uses the CUDA-graph-replayed forwards instead (launch overhead "
    "removed); break_even_committed_floor the two bandwidth floors (what a bandwidth-bound "
    "engine would need).",
    "floor = (attention + dense + shared expert + router + norms + lm_head bytes + embedding "
    "rows + distinct experts touched x expert bytes + KV bytes read) / copy bandwidth (bytes "
    "read + written per second of a device-to-device copy); distinct experts are measured per "
    "layer per step from the router's topk_ids; floor_uniform uses 384 x (1 - (1 - 8/384)^T).",
    "graph_forward_s: the step's target forward captured in a CUDA graph and replayed (launch "
    "overhead removed), a lower bound for a captured engine step's forward; the engine itself "
    "runs eagerly here.",
    "DDTree split: draft (oracle on the device) / build (tree) / prep (slots, ids, attention "
    "metadata) / verify (target forward) / accept_commit (sampling, acceptance, the one "
    "device-to-host copy, bookkeeping), from separate instrumented steps.",
]

TP8_COLLECTIVE_S = 12e-6  # one all-reduce inside a CUDA graph, as measured on 2 H200s


def stats(xs: list[float]) -> dict[str, float]:
    return dict(mean=statistics.fmean(xs), median=statistics.median(xs), min=min(xs), max=max(xs))


def floor(
    res: RunResult, runner: ModelRunner, bw: dict, tokens_per_forward: int, num_streams: int
) -> dict:
    """Bytes one step must read and the time that takes at the measured copy bandwidth."""
    cfg = runner.model_cfg
    pb = parameter_bytes(runner.model)
    _, expert_b = weight_bytes_per_layer(cfg)
    fixed = sum(v for k, v in pb.items() if k not in ("experts", "embedding"))
    emb_rows = tokens_per_forward * cfg.hidden_size * runner.model.dtype.itemsize
    distinct_step = statistics.fmean(sum(layers) for layers in res.distinct)
    moe_layers = len(res.distinct[0])
    uni = uniform_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, tokens_per_forward)
    kv_elem = runner.kv.pool.element_size() * cfg.kv_latent_dim * cfg.num_hidden_layers
    q_len = tokens_per_forward // num_streams
    kv = statistics.fmean(res.kv_tokens) * kv_elem + tokens_per_forward * kv_elem
    experts = distinct_step * expert_b
    total = fixed + emb_rows + experts + kv
    total_uniform = total - experts + uni * moe_layers * expert_b
    rate = bw["bytes_per_s"]
    return dict(
        bytes=dict(fixed_weights=fixed, embedding_rows=emb_rows, experts=experts, kv_read=kv),
        total_bytes=total,
        expert_bytes_each=expert_b,
        moe_layers=moe_layers,
        distinct_experts_per_layer=distinct_step / moe_layers,
        distinct_experts_layer_min=min(map(min, res.distinct)),
        distinct_experts_layer_max=max(map(max, res.distinct)),
        uniform_distinct_per_layer=uni,
        kv_tokens_per_stream=statistics.fmean(res.kv_tokens) / num_streams + q_len,
        floor_s=total / rate,
        floor_uniform_s=total_uniform / rate,
        tp8_collectives_s=(2 * cfg.num_hidden_layers + 1) * TP8_COLLECTIVE_S,
    )


def _common(res: RunResult, c: int, tokens_per_forward: int, runner: ModelRunner, bw: dict):
    st = stats(res.step_s)
    committed = statistics.fmean(res.committed) / c  # tokens per stream per step
    fl = floor(res, runner, bw, tokens_per_forward, c)
    graph = res.graph_forward_s
    return dict(
        batch=c,
        tokens_per_forward=tokens_per_forward,
        steps=len(res.step_s),
        step_s=st,
        committed_per_step=committed,
        tokens_per_s=c * committed / st["mean"],
        floor=fl,
        step_over_floor=st["mean"] / fl["floor_s"],
        graph_forward_s=graph,
        graph_forward_over_floor=graph / fl["floor_s"] if isinstance(graph, float) else None,
    )


def ar_entry(res: RunResult, c: int, runner: ModelRunner, bw: dict) -> dict:
    return _common(res, c, c, runner, bw)


def ddtree_entry(
    res: RunResult, c: int, budget: int, corrupt: float, runner: ModelRunner, bw: dict, ar: dict
) -> dict:
    e = _common(res, c, c * (budget + 1), runner, bw)
    break_even = e["step_s"]["mean"] / ar["step_s"]["mean"]
    graphs = (e["graph_forward_s"], ar["graph_forward_s"])
    graph_even = graphs[0] / graphs[1] if all(isinstance(g, float) for g in graphs) else None
    return dict(
        e,
        budget=budget,
        corrupt=corrupt,
        ar_step_s=ar["step_s"]["mean"],
        ar_tokens_per_s=ar["tokens_per_s"],
        speedup_vs_ar=e["tokens_per_s"] / ar["tokens_per_s"],
        break_even_committed=break_even,
        break_even_committed_graph=graph_even,
        break_even_committed_floor=e["floor"]["floor_s"] / ar["floor"]["floor_s"],
        matches_ar_greedy=res.matches_ar,
        split_s=res.split_s,
    )


def _ms(x) -> str:
    return f"{x * 1e3:8.2f}" if isinstance(x, float) else f"{'-':>8}"


def _x(x) -> str:
    return f"{x:6.2f}" if isinstance(x, float) else f"{'-':>6}"


def print_table(report: dict) -> None:
    """One row per configuration; be = break-even committed tokens per stream per step
    (eager step / graph-replayed forward / bandwidth floor)."""
    print(f"{'C':>3} {'budget':>6} {'corr':>5} {'step ms':>8} {'AR ms':>8} {'commit':>6} "
          f"{'tok/s':>8} {'xAR':>6} {'be':>6} {'be-gr':>6} {'be-fl':>6} {'experts':>11} "
          f"{'floor ms':>8} {'step/fl':>7} {'graph ms':>8}")  # fmt: skip
    rows = [(e, "AR", "") for e in report["ar"]]
    rows += [(e, e["budget"], e["corrupt"]) for e in report["ddtree"]]
    for e, budget, corr in rows:
        fl = e["floor"]
        experts = f"{fl['distinct_experts_per_layer']:.0f}({fl['uniform_distinct_per_layer']:.0f})"
        print(
            f"{e['batch']:>3} {budget!s:>6} {corr!s:>5} {_ms(e['step_s']['mean'])} "
            f"{_ms(e.get('ar_step_s', e['step_s']['mean']))} {e['committed_per_step']:6.2f} "
            f"{e['tokens_per_s']:8.1f} {_x(e.get('speedup_vs_ar'))} "
            f"{_x(e.get('break_even_committed'))} {_x(e.get('break_even_committed_graph'))} "
            f"{_x(e.get('break_even_committed_floor'))} {experts:>11} {_ms(fl['floor_s'])} "
            f"{e['step_over_floor']:7.1f} {_ms(e['graph_forward_s'])}"
        )
    print("experts = measured distinct per layer (uniform-routing expectation); floor at "
          f"{report['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s copy bandwidth")  # fmt: skip
    for s in report["skipped"]:
        print(f"skipped: {s}")
    for s in report["errors"]:
        print(f"error: {s}")


def write_json(path: str | None, report: dict, quiet: bool = False) -> None:
    """Write (atomically: a reader never sees half a file) or, without a path, print."""
    text = json.dumps(report, indent=1)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        if not quiet:
            print(f"wrote {path}")
    elif not quiet:
        print(text)
