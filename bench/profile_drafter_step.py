"""Where a DFlash drafter's time goes inside the engine's DDTree step: the K2.6 rank step (CUDA
graphs, as `bench_engine.py --cuda-graphs` runs it) with the oracle's draft alone, then paying a
K2.5-DFlash-sized drafter's cost (`--drafter-tp`'s rank shard, `CostedOracle`), kernel by kernel
under the torch profiler (which sees the kernels of graph replays too).

    python bench/profile_drafter_step.py --batches 1,10 --budgets 16 --out prof.json

Per batch size C: the oracle alone, then the drafter's work under each of `--variants` (comma
list of `drafter_variants.py`'s: default, commit-after-step, eager-commit, gathered,
separate-mlp, or several joined by '+'; default "default,commit-after-step"), each with its own
verify graph: the mean step wall time over `--steps` steps, every configuration timed before any is
profiled (a profiler session leaves every later graph launch slower, `host_overhead.py`); then
over 3 profiled steps the device's kernel time per step grouped by kernel name (count and us
per step), and the kernels whose time grew most from the oracle to the first variant. Only the
first budget of `--budgets` runs; the oracle is the perfect one (`--corrupt` 0).

    python bench/profile_drafter_step.py --batches 1,10 --budgets 16 \\
        --variants default,commit-after-step,commit-after-step+eager-commit,gathered
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _util import environment, write_json  # noqa: E402
from bench_engine import continuation_length, parse_args, setup  # noqa: E402
from drafter_variants import variant  # noqa: E402


def kernel_times(step, sids, n: int = 3) -> dict[str, list[float]]:
    """Kernel name -> [count, us] per step over n profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # elsewhere (a CPU smoke run) the CPU's top-level ops
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step(sids)
        sync()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA or (not cuda and e.cpu_parent is None):
            row = out[e.name[:90]]
            row[0] += 1 / n
            row[1] += e.time_range.elapsed_us() / n
    return dict(out)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(bench, runner, sids, budget: int, kw: dict, args, profiled: bool) -> dict:
    """Warm-up steps, then `args.steps` timed steps, or (`profiled`) 3 steps under the profiler."""
    bench._oracle(sids, budget, kw)
    for _ in range(args.warmup + 1):
        runner.ddtree_step(sids)
    sync()
    if profiled:
        kernels = kernel_times(runner.ddtree_step, sids)
        return dict(kernel_ms=sum(us for _, us in kernels.values()) / 1e3,
                    kernels_per_step=sum(n for n, _ in kernels.values()),
                    kernels=kernels)  # fmt: skip
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        runner.ddtree_step(sids)  # ends with its device-to-host copy
        walls.append(time.perf_counter() - t0)
    return dict(step_ms=statistics.mean(walls) * 1e3)


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        print("Options: bench_engine.py's (--cuda-graphs and --drafter dflash always on).\n")
    argv, variants = list(sys.argv[1:]), ["default", "commit-after-step"]
    if "--variants" in argv:  # this script's own option; the rest are bench_engine.py's
        i = argv.index("--variants")
        variants = argv[i + 1].split(",")
        del argv[i : i + 2]
    args = parse_args([*argv, "--cuda-graphs", "--drafter", "dflash"])
    bench, rep = setup(args)
    runner, dflash, budget = bench.runner, bench.dflash, args.budgets[0]
    bench.run_ar(bench.sids[: max(args.batches)], 0, continuation_length(args))
    out = dict(env=environment(), layers=rep["layers"], drafter=rep["drafter"], budget=budget,
               prefix=args.prefix, variants=variants, rows=[])  # fmt: skip
    kw = dict(depth=args.depth, corrupt=0.0, margin=20.0, seed=0)
    for name in variants:
        variant(name, dflash)  # unknown names fail before any run
    per = {c: {} for c in args.batches}
    failed: dict[str, str] = {}  # variant -> its error (a candidate may not run on this device)
    # every timing first, then every profile: once the profiler has run, CUPTI stays attached
    # and each later graph launch costs the host more (host_overhead.py)
    for profiled in (False, True):
        for c in args.batches:
            for name in ["oracle", *variants]:
                if name in failed:
                    continue
                bench.dflash = None if name == "oracle" else dflash
                bench._costed.clear()  # a new drafter object: the verify graph captured afresh
                try:
                    with contextlib.nullcontext() if name == "oracle" else variant(name, dflash):
                        res = run(bench, runner, bench.sids[:c], budget, kw, args, profiled)
                except Exception as e:  # noqa: BLE001 - reported; the other variants still run
                    if name == "oracle":
                        raise
                    failed[name] = repr(e)[:500]
                    print(f"C={c} {name}: failed: {failed[name]}", flush=True)
                    for done in per.values():
                        done.pop(name, None)
                    continue
                per[c].setdefault(name, {}).update(res)
                row = per[c][name]
                what = (f"kernels {row['kernel_ms']:.2f} ms ({row['kernels_per_step']:.0f})"
                        if profiled else f"step {row['step_ms']:.2f} ms")  # fmt: skip
                print(f"C={c} {name}: {what}", flush=True)
    bench.dflash = dflash
    out["failed"] = failed
    ran = [v for v in variants if v not in failed]
    for c in args.batches:
        if not ran:
            out["rows"].append(dict(batch=c, **per[c]))
            continue
        grown = []
        first = per[c][ran[0]]["kernels"]
        for k in set(per[c]["oracle"]["kernels"]) | set(first):
            a = per[c]["oracle"]["kernels"].get(k, [0.0, 0.0])
            b = first.get(k, [0.0, 0.0])
            grown.append(dict(kernel=k, us=b[1] - a[1], count=b[0] - a[0]))
        grown.sort(key=lambda g: -g["us"])
        print(f"C={c}: kernels that grew most from the oracle to {ran[0]}")
        for g in grown[:25]:
            print(f"   +{g['us']:8.1f} us  +{g['count']:5.1f}x  {g['kernel']}", flush=True)
        out["rows"].append(dict(batch=c, **per[c], grown=grown[:60]))
    write_json(args.out, out)


if __name__ == "__main__":
    main()
