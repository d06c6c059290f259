"""End-to-end engine benchmark: AR vs DDTree steps of ModelRunner on a
random Kimi K2.6 tp=8 rank slice, against the bandwidth floor, over batch sizes and budgets.

    python bench/bench_engine.py --out engine.json              # CUDA: the full rank slice
    python bench/bench_engine.py --small --device cpu --out x.json   # tiny shapes, any device

Per batch size C: plain AR step time; DDTree step time with an oracle drafter at each
`--corrupt` level (controlled acceptance), committed tokens per step, tokens/s, the DDTree/AR
tokens-per-second ratio and the break-even committed length (DDTree step / AR step); the floor
(weights touched + measured distinct experts x expert bytes + KV read, over the measured copy
bandwidth) and step / floor; the split of a DDTree step; GPU memory. Random weights: a real
drafter's acceptance cannot be measured here, only step cost and break-even.

`--drafter dflash` makes every DDTree step also pay a DFlash drafter's cost (random weights in
z-lab/Kimi-K2.5-DFlash's shapes, one rank's shard at `--drafter-tp`, `bench_drafter.py`): its
block forward in the verify graph, the target's hidden states captured at its layers, its
context commit after each step; the tree still comes from the oracle (`CostedOracle`).

    python bench/bench_engine.py --cuda-graphs --budgets 16 --corrupt 0.19 --drafter dflash
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from engine_model import (  # noqa: E402
    EMBED_RMS,
    LM_HEAD_GAIN,
    build_random_model,
    estimate_weight_bytes,
    parameter_bytes,
    rank_slice_config,
)
from engine_probe import copy_bandwidth  # noqa: E402
from engine_report import NOTES, ar_entry, ddtree_entry, print_table, write_json  # noqa: E402
from engine_runs import EngineBench  # noqa: E402

from ddserve.config import ModelConfig  # noqa: E402
from ddserve.engine.config import EngineConfig  # noqa: E402
from ddserve.engine.runner import ModelRunner  # noqa: E402

PRESETS = {
    "full": dict(layers=61, batches="1,5,10", budgets="4,8,16,32", prefix=1024, steps=8, warmup=2,
                 split_steps=2, depth=15, prefill_chunk=2048, copy_mib=1024),
    "small": dict(layers=3, batches="1,2", budgets="2,4", prefix=24, steps=2, warmup=1,
                  split_steps=1, depth=4, prefill_chunk=32, copy_mib=8),
}  # fmt: skip
INIT = (
    "random, on the device: matmul weights N(0, 1/fan_in); INT4 expert values uniform in "
    "[-7, 7] (zero mean) with group scales U(0.5, 1.5)/(sqrt(fan_in) std(int4)); router bias "
    "N(0, 0.01^2); norms 1; "
    f"embedding N(0, {EMBED_RMS:g}^2) and lm_head row perm(t) = unit embedding of t x "
    f"{LM_HEAD_GAIN:g}/sqrt(hidden), so greedy decoding is a robust token permutation "
    "(oracle stays in sync under bf16) while routing stays random per token"
)
HEADROOM = 8 << 30  # bytes left free on the GPU for activations, allocator slack, graphs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--layers", type=int, help="decoder layers (61; fewer if the GPU is short)")
    ap.add_argument("--batches", help="comma list of stream counts C (1,5,10)")
    ap.add_argument("--budgets", help="comma list of DDTree budgets (4,8,16,32)")
    ap.add_argument("--corrupt", default="0,0.3", help="oracle corrupt levels (acceptance knob)")
    ap.add_argument("--prefix", type=int, help="prompt tokens per stream (1024)")
    ap.add_argument("--steps", type=int, help="timed steps per configuration (8)")
    ap.add_argument("--warmup", type=int, help="untimed steps before them (2)")
    ap.add_argument("--split-steps", type=int, help="instrumented DDTree steps for the split (2)")
    ap.add_argument("--depth", type=int, help="drafter depths D, DFlash block - 1 (15)")
    ap.add_argument("--margin", type=float, default=20.0, help="oracle logit margin (20: chain)")
    ap.add_argument("--drafter", choices=("oracle", "dflash"), default="oracle",
                    help="oracle: the oracle's draft alone (next to no cost); dflash: plus "
                         "a K2.5-DFlash-sized drafter's work every step (random "
                         "weights)")  # fmt: skip
    ap.add_argument("--drafter-tp", type=int, default=None,
                    help="the tensor-parallel size whose rank-0 shard of the DFlash drafter "
                         "runs (8; small: 2); 1: the whole drafter")  # fmt: skip
    ap.add_argument("--prefill-chunk", type=int, help="prefill forward size in tokens (2048)")
    ap.add_argument("--copy-mib", type=int, help="size of the bandwidth copy (1024 MiB)")
    ap.add_argument("--graph-reps", type=int, default=5, help="CUDA-graph replays (0: off)")
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="run the engine itself with CUDA-graph replay (EngineConfig.cuda_graphs)",
    )
    ap.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batch-invariant kernels (EngineConfig.batch_invariant, default on)",
    )
    skip = "start no configuration past this many seconds (recorded as skipped)"
    ap.add_argument("--max-seconds", type=float, default=240.0, help=skip)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON output path (default: print)")
    args = ap.parse_args(argv)
    for key, val in PRESETS["small" if args.small else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.drafter_tp is None:
        args.drafter_tp = 2 if args.small else 8
    args.batches = [int(x) for x in str(args.batches).split(",")]
    args.budgets = [int(x) for x in str(args.budgets).split(",")]
    args.corrupt = [float(x) for x in str(args.corrupt).split(",")]
    return args


def fit_layers(args: argparse.Namespace, device: torch.device) -> int:
    """args.layers, reduced until weights + KV + headroom fit in free GPU memory."""
    if device.type != "cuda":
        return args.layers
    free = torch.cuda.mem_get_info(device)[0]
    one = estimate_weight_bytes(ModelConfig.from_hf(rank_slice_config(1, args.small)))
    two = estimate_weight_bytes(ModelConfig.from_hf(rank_slice_config(2, args.small)))
    layers = args.layers
    while layers > 2 and one + (layers - 1) * (two - one) * 1.02 + HEADROOM > free:
        layers -= 1
    return layers


def continuation_length(args: argparse.Namespace) -> int:
    """AR tokens per stream the oracle needs: the most any DDTree run can commit, plus one."""
    per_step = min(args.depth, max(args.budgets)) + 1
    steps = args.warmup + args.steps + 1  # + the eager routing-statistics step (CUDA graphs)
    return max(steps, args.split_steps) * per_step + 1


def setup(args: argparse.Namespace) -> tuple[EngineBench, dict]:
    """Build the model on the device, prefill C_max streams, measure copy bandwidth."""
    device = torch.device(args.device)
    layers = fit_layers(args, device)
    raw = rank_slice_config(layers, args.small)
    mcfg = ModelConfig.from_hf(raw)
    print(f"building a random {'small' if args.small else 'K2.6 rank-slice'} model: {layers} "
          f"layers on {device}", flush=True)  # fmt: skip
    model = build_random_model(mcfg, device, seed=args.seed)
    c_max, max_tokens = max(args.batches), continuation_length(args) + args.depth + 2
    per_stream = args.prefix + max_tokens + max(args.budgets) + 1
    slack = 8 * c_max * (max(args.budgets) + 1)  # block slots a failed step may leave behind
    ecfg = EngineConfig(num_slots=c_max * per_stream + slack, budget=max(args.budgets),
                        prefill_chunk=args.prefill_chunk, seed=args.seed,
                        cuda_graphs=args.cuda_graphs, batch_invariant=args.batch_invariant,
                        graph_buckets=tuple(sorted(set(args.batches))))  # fmt: skip
    if args.cuda_graphs:
        args.graph_reps = 0  # the engine replays its own graphs; no separate probe
    runner = ModelRunner.from_model(model, mcfg, engine_cfg=ecfg)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(2, mcfg.vocab_size, (c_max, args.prefix), generator=gen).tolist()
    bw = copy_bandwidth(device, args.copy_mib << 20)
    print(f"copy bandwidth {bw['bytes_per_s'] / 1e9:.0f} GB/s; prefilling {c_max} x "
          f"{args.prefix} tokens", flush=True)  # fmt: skip
    dflash = None
    if args.drafter == "dflash":
        dflash = costed_dflash(args, runner, layers, c_max, per_stream + slack)
        print(f"DFlash drafter for its cost: rank 0 of tp={args.drafter_tp}, "
              f"{drafter_bytes(dflash) / 1e9:.2f} GB", flush=True)  # fmt: skip
    bench = EngineBench(runner, prompts, max_tokens, args.graph_reps, dflash=dflash)
    report = dict(
        benchmark="engine", notes=NOTES, args=dict(vars(args)), env=environment(device),
        layers=layers, layers_requested=args.layers, bandwidth=bw,
        model=dict(config=raw, weight_bytes=parameter_bytes(model), init=INIT),
        drafter=None if dflash is None else dict(
            shape="K2.5-DFlash" if not args.small else "small", tp=args.drafter_tp,
            weight_bytes=drafter_bytes(dflash), capture_layers=dflash.capture_layers,
            config=dataclasses.asdict(dflash.cfg)),
        prefill=dict(tokens=bench.prefill_tokens, seconds=bench.prefill_s,
                     tokens_per_s=bench.prefill_tokens / bench.prefill_s),
        ar=[], ddtree=[], skipped=[], errors=[], moe=moe_backend(model),
    )  # fmt: skip
    return bench, report


def costed_dflash(args: argparse.Namespace, runner: ModelRunner, layers: int, streams: int,
                  context: int):  # fmt: skip
    """The DFlash drafter whose cost `--drafter dflash` adds: K2.5-DFlash's shapes (small: the
    smoke shapes), block depth + 1, its capture layers spread over the target's `layers`."""
    from bench_drafter import K25_DFLASH, SMALL, drafter_config, random_model

    from ddserve.drafter.model import DFlashDrafter

    shape = dict(SMALL if args.small else K25_DFLASH, target_layers=layers,
                 hidden=runner.model_cfg.hidden_size, vocab=runner.model_cfg.vocab_size,
                 block=args.depth + 1)  # fmt: skip
    cfg = drafter_config(shape, context)
    model = random_model(cfg, runner.device, runner.cfg.torch_dtype, tp=args.drafter_tp,
                         seed=args.seed)  # fmt: skip
    dflash = DFlashDrafter(model, runner.model, max_streams=streams, max_context=context)
    dflash.kernels = runner.kernels  # as the engine sets a drafter it loads
    return dflash


def drafter_bytes(dflash) -> int:
    return sum(p.numel() * p.element_size() for p in dflash.model.parameters())


def moe_backend(model) -> dict:
    """Which MoE kernel ran the prefill: v3 leaves the experts rewritten in place, and a v3
    failure is in moe_triton.V3_ERROR (then v2 ran)."""
    from ddserve.kernels import moe_triton
    from ddserve.kernels.moe_w4_repack import in_place_config

    rewritten = [
        in_place_config(m.w13_packed) is not None
        for m in model.modules()
        if getattr(m, "int4", False) and hasattr(m, "w13_packed")
    ]
    return dict(
        layers_int4=len(rewritten),
        layers_rewritten_for_v3=sum(rewritten),
        v3_error=moe_triton.V3_ERROR,
        env_variant=os.environ.get("DDSERVE_MOE_VARIANT"),
    )


def guarded(report: dict, out: str | None, deadline: float, what: dict, fn) -> dict | None:
    """Run one configuration unless past the deadline; record a skip or an error instead of
    stopping, and rewrite the JSON after each configuration (a killed run keeps its results)."""
    if time.perf_counter() > deadline:
        report["skipped"].append(dict(what, reason="max-seconds"))
        return None
    try:
        entry = fn()
    except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the rest
        report["errors"].append(dict(what, error=f"{type(e).__name__}: {str(e)[:500]}"))
        print(f"error in {what}: {type(e).__name__}: {e}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    report["ar" if what["kind"] == "ar" else "ddtree"].append(entry)
    write_json(out, report, quiet=True)
    return entry


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    bench, report = setup(args)
    runner, bw, deadline = bench.runner, report["bandwidth"], t_start + args.max_seconds
    c_max, ar_by_c = max(args.batches), {}
    # The AR run over all streams makes the oracle's continuation; it is also C_max's AR timing.
    for c in [c_max] + [c for c in args.batches if c != c_max]:
        n = continuation_length(args) - args.warmup if c == c_max else args.steps

        def run_ar(c=c, n=n) -> dict:
            return ar_entry(bench.run_ar(bench.sids[:c], args.warmup, n), c, runner, bw)

        until = math.inf if c == c_max else deadline
        entry = guarded(report, args.out, until, dict(kind="ar", batch=c), run_ar)
        if entry is not None:
            ar_by_c[c] = entry
            print(f"AR C={c}: {entry['step_s']['mean'] * 1e3:.2f} ms/step", flush=True)
    for c, budget, corrupt in itertools.product(args.batches, args.budgets, args.corrupt):
        what = dict(kind="ddtree", batch=c, budget=budget, corrupt=corrupt)
        if c not in ar_by_c:
            report["skipped"].append(dict(what, reason="no AR baseline at this batch size"))
            continue

        def run(c=c, budget=budget, corrupt=corrupt) -> dict:
            res = bench.run_ddtree(
                bench.sids[:c], budget, args.warmup, args.steps, args.split_steps,
                depth=args.depth, corrupt=corrupt, margin=args.margin, seed=args.seed,
            )  # fmt: skip
            return ddtree_entry(res, c, budget, corrupt, runner, bw, ar_by_c[c])

        entry = guarded(report, args.out, deadline, what, run)
        if entry is not None:
            print(f"DDTree C={c} budget={budget} corrupt={corrupt}: "
                  f"{entry['step_s']['mean'] * 1e3:.2f} ms/step, "
                  f"{entry['committed_per_step']:.2f} tok/stream/step", flush=True)  # fmt: skip
    report["memory"] = memory(runner.device)
    report["elapsed_s"] = time.perf_counter() - t_start
    print_table(report)
    write_json(args.out, report)
    return report


def environment(device: torch.device) -> dict:
    env = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), torch=torch.__version__,
               device=str(device))  # fmt: skip
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(note="not measured on CPU")
    free, total = torch.cuda.mem_get_info(device)
    return dict(
        allocated=torch.cuda.memory_allocated(device),
        max_allocated=torch.cuda.max_memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
        device_used=total - free,
        device_total=total,
    )


if __name__ == "__main__":
    main()
