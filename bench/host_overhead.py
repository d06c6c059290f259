"""How much of an engine step is host time: the K2.6 rank step (CUDA graphs on, as
`bench_engine.py --cuda-graphs` runs it) against the device time of its graph alone, and where
the host's time goes (cProfile of the same steps).

    python bench/host_overhead.py --batches 1,10 --out host.json

Per configuration (AR at each --batches, DDTree with the perfect oracle at --budgets):
- step_ms: wall time of one engine step (host clock; a step ends with its device-to-host copy
  of the tokens, so the device is done when it returns), median of --steps;
- device_ms: the same steps measured on the device (events around each step), which counts
  the device's idle time while the host prepares a replay;
- replay_ms: the step's graph replayed back to back with the same inputs (device busy time);
- host_top: cProfile's functions by total time over the profiled steps (us per step);
- idle: the device's idle gaps over 3 steps (torch profiler, which slows every launch: read
  the gaps' causes, not their lengths) and the host ops during each;
- launch (once, before any profiling): for the graph each configuration's steps replayed, the
  host's time in one launch with the device idle, alone, right after another graph's replay,
  after an explicit `cudaGraphUpload`, right after a pinned host-to-device copy (the engine's
  order), and while the same graph's previous launch runs.
step_ms - replay_ms is what the host adds to an AR step: input packing, the input copy, the
replay launch, the token copy and the step's bookkeeping. For DDTree it also holds the
benchmark's oracle drafter, which cannot run inside the verify graph (the DFlash drafter does):
its draft (random logits, a scatter of the continuation, a copy into the graph's input) runs
eagerly on the device before each replay.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _util import environment, write_json  # noqa: E402
from bench_engine import continuation_length, parse_args, setup  # noqa: E402

from ddserve.engine import graphs as engine_graphs  # noqa: E402


def _steps(step, sids, n: int) -> tuple[list[float], list[float]]:
    """(host wall s, device s) of n steps."""
    walls, evs = [], []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        step(sids)
        b.record()
        walls.append(time.perf_counter() - t0)
        evs.append((a, b))
    torch.cuda.synchronize()
    return walls, [a.elapsed_time(b) / 1e3 for a, b in evs]


def _replay_ms(g, reps: int = 20) -> float:
    """Back-to-back replays of a step's graph (its inputs as last loaded)."""
    g.graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _host_top(step, sids, n: int, top: int = 15) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step(sids)
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # tottime
    return [
        dict(
            fn=f"{Path(f).name}:{line}:{name}",
            calls_per_step=cc / n,
            tot_us=tt / n * 1e6,
            cum_us=ct / n * 1e6,
        )  # fmt: skip
        for (f, line, name), (cc, _, tt, ct, _) in rows
    ]


def _idle_gaps(step, sids, n: int = 3, min_us: float = 15.0) -> dict:
    """Device idle time between kernels over n steps (torch profiler trace): the gaps longer
    than min_us (inside a graph replay kernels follow each other within ~1 us), and the host
    ops that ran during the longest ones."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step(sids)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])  # fmt: skip
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime")]
    gaps = []
    end = gpu[0]["ts"] + gpu[0]["dur"] if gpu else 0.0
    for e in gpu[1:]:
        if e["ts"] - end > min_us:
            ops = [c for c in cpu if c["ts"] < e["ts"] and c["ts"] + c.get("dur", 0) > end]
            ops.sort(key=lambda c: -c.get("dur", 0))
            host = [f"{c['name'][:50]} {c.get('dur', 0):.0f}" for c in ops[:12]]
            gaps.append(dict(us=e["ts"] - end, next=e["name"][:60], host=host))
        end = max(end, e["ts"] + e["dur"])
    span = (gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]) if gpu else 0.0
    return dict(steps=n, span_us=span, idle_us=sum(g["us"] for g in gaps), gaps=gaps)


def _launch_us(g, before=None, upload=None, queued=None) -> float:
    """CPU time of one `replay()` call of graph g with the device idle (after `before`'s replay
    when given; after `upload(g)` when given), us. `queued()`, when given, runs right before the
    timed launch without a synchronisation in between (the device may still be busy with it)."""
    if before is not None:
        before.graph.replay()
    torch.cuda.synchronize()
    if upload is not None:
        upload(g)
        torch.cuda.synchronize()
    if queued is not None:
        queued()
    t0 = time.perf_counter()
    g.graph.replay()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt * 1e6


def _launch_probe(graphs: list, keys: dict, reps: int = 5) -> dict:
    """How long the host spends launching each graph of `graphs` (the ones the timed steps
    replayed), medians of `reps` (us): alone with the device idle, right after another graph's
    replay, right after a pinned host-to-device copy (the engine's order), while its own
    previous launch runs, and after an explicit `cudaGraphUpload` (CuPy). `keys` maps a graph
    object's id to its capture key. The replays rewrite the KV slots their last inputs named
    with the same values."""
    upload, why = None, None
    try:
        from cupy.cuda import runtime

        def upload(g):
            exec_handle = g.graph.raw_cuda_graph_exec()
            runtime.graphUpload(exec_handle, torch.cuda.current_stream().cuda_stream)
    except Exception as e:  # CuPy missing, or no graphUpload in it
        why = f"{type(e).__name__}: {e}"
    rows = []
    for i, g in enumerate(graphs):
        other = graphs[i - 1] if len(graphs) > 1 else None
        row = dict(kind=type(g).__name__, key=keys.get(id(g)))
        row["alone_us"] = statistics.median(_launch_us(g) for _ in range(reps))
        if other is not None:
            row["after_other_us"] = statistics.median(_launch_us(g, other) for _ in range(reps))
        # the engine's order: the step's inputs copied from pinned memory, then the launch
        src = torch.zeros(64, dtype=torch.long).pin_memory()
        dst = torch.empty(64, dtype=torch.long, device="cuda")
        copy = lambda src=src, dst=dst: dst.copy_(src, non_blocking=True)
        row["after_copy_us"] = statistics.median(_launch_us(g, queued=copy) for _ in range(reps))
        # a second launch of the same graph while its first one runs
        again = lambda g=g: g.graph.replay()
        row["while_running_us"] = statistics.median(
            _launch_us(g, queued=again) for _ in range(reps)
        )
        if upload is not None:
            try:
                row["uploaded_us"] = statistics.median(
                    _launch_us(g, other, upload) for _ in range(reps)
                )
            except Exception as e:
                row["upload_error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return dict(graphs=rows, upload_unavailable=why)


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        print("Options (bench_engine.py's; --cuda-graphs is always on, the DDTree oracle is the "
              "perfect one: --corrupt and --margin are not used):\n")  # fmt: skip
    args = parse_args([*sys.argv[1:], "--cuda-graphs"])
    bench, rep = setup(args)
    runner = bench.runner
    last: list = []  # the graph object each replay used
    originals = {cls: cls.replay for cls in (engine_graphs._Graph, engine_graphs._VerifyGraph)}
    for cls, orig in originals.items():

        def replay(self, *a, __orig=orig, **kw):
            last[:] = [self]
            return __orig(self, *a, **kw)

        cls.replay = replay
    c_max = max(args.batches)
    # the oracle's continuation, long enough for every DDTree step timed or profiled below
    bench.run_ar(bench.sids[:c_max], 0, continuation_length(args))
    out = dict(env=environment(), layers=rep["layers"], prefix=args.prefix, configs=[])
    confs = [("ar", c, None) for c in args.batches]
    confs += [("ddtree", c, b) for c in args.batches for b in args.budgets]

    def start(kind, c, budget):  # rewind the streams (AR) or set the oracle up (DDTree)
        sids = bench.sids[:c]
        if kind == "ar":
            bench.rewind(sids)
            runner.drafter, runner.cfg = None, bench.base_cfg
            return runner.ar_step, sids
        bench._oracle(sids, budget, dict(depth=args.depth, corrupt=0.0, margin=20.0, seed=0))
        return runner.ddtree_step, sids

    # Timing, then cProfile, then the torch profiler: once the profiler has run, CUPTI stays
    # attached to the process and every later launch of a 1,100-node graph costs the host
    # 0.2-0.9 ms (`graph_launch.py`'s after-profiler case), so nothing is timed after it. The
    # JSON is rewritten after each phase (a killed run keeps what it measured).
    rows, used = [], []

    def checkpoint() -> None:  # the results so far, when they go to a file
        if args.out:
            write_json(args.out, out)

    for kind, c, budget in confs:
        step, sids = start(kind, c, budget)
        _steps(step, sids, args.warmup)
        walls, devs = _steps(step, sids, args.steps)
        row = dict(kind=kind, batch=c, budget=budget, replay_ms=_replay_ms(last[0]))
        row.update(step_ms=statistics.median(walls) * 1e3, device_ms=statistics.median(devs) * 1e3)
        rows.append(row)
        used.append(last[0])
        print(f"{kind} C={c} budget={budget}: step {row['step_ms']:.3f} ms, device "
              f"{row['device_ms']:.3f}, replay {row['replay_ms']:.3f}", flush=True)  # fmt: skip
    for cls, orig in originals.items():  # cProfile below sees the engine's own replay
        cls.replay = orig
    out["configs"] = rows
    checkpoint()
    runner.drafter, runner.cfg = None, bench.base_cfg
    graphed = runner._graphs
    keys = {id(g): list(k[:3]) for k, g in [*graphed._graphs.items(), *graphed._verify.items()]}
    out["launch"] = _launch_probe(used, keys)
    for r in out["launch"]["graphs"]:
        print(f"launch {r}", flush=True)
    checkpoint()
    for row in rows:
        step, sids = start(row["kind"], row["batch"], row["budget"])
        row["host_top"] = top = _host_top(step, sids, args.steps)
        print(f"{row['kind']} C={row['batch']} budget={row['budget']}: host", flush=True)
        for t in top[:8]:
            print(f"   {t['tot_us']:8.1f} us {t['calls_per_step']:6.1f}x  {t['fn']}", flush=True)
    checkpoint()
    for row in rows:
        step, sids = start(row["kind"], row["batch"], row["budget"])
        row["idle"] = idle = _idle_gaps(step, sids)
        print(
            f"{row['kind']} C={row['batch']}: device idle {idle['idle_us']:.0f} us over "
            f"{idle['steps']} steps ({idle['span_us']:.0f} us span, under the profiler)",
            flush=True,
        )
        for g in idle["gaps"][:6]:
            print(f"     gap {g['us']:.0f} us before {g['next']}: {'; '.join(g['host'][:6])}")
    runner.drafter, runner.cfg = None, bench.base_cfg
    write_json(args.out, out)


if __name__ == "__main__":
    main()
