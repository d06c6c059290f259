"""What a CUDA-graph launch costs the host, by node count and launch attribute.

    python bench/graph_launch.py --out launch.json

A chain of N one-program Triton kernels (each adds 1 to one float) is captured in one graph,
launched with programmatic dependent launch (`launch_pdl`, the forward's kernels) or without,
on one stream or forked over two (the forward's shared-expert side branch). Per case: the
host's time inside `replay()` with the device idle (median of --reps), the device time of one
replay (events around it on an idle device, so it also holds part of the launch), and whether
the chain's result is right (N per replay). This separates the launch's
per-node cost from what the engine's forward graph adds. Last, one 1,100-node PDL graph's launch
while more and more other graphs like it stay instantiated (--alive), and before and after a
torch profiler session.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _util import environment, write_json  # noqa: E402

from ddserve.kernels import pdl  # noqa: E402


@triton.jit
def _bump_kernel(x_ptr, PDL: tl.constexpr):
    pdl.begin(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def _chain(x: torch.Tensor, n: int, use_pdl: bool, side: torch.Tensor | None) -> None:
    opts = {"PDL": True, "launch_pdl": True} if use_pdl else {"PDL": False}
    main = torch.cuda.current_stream()
    other = torch.cuda.Stream() if side is not None else None
    for i in range(n):
        if other is not None and i % 20 == 10:  # fork a short branch, as the MoE does
            other.wait_stream(main)
            with torch.cuda.stream(other):
                for _ in range(3):
                    _bump_kernel[(1,)](side, **opts)
            main.wait_stream(other)
        _bump_kernel[(1,)](x, **opts)


def launch_times(graph, reps: int) -> list[float]:
    """The host's time inside each of `reps` `replay()` calls, the device idle before each (us)."""
    host = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return host


def device_us(graph) -> float:
    """One replay between two events on an idle device (so it also holds part of the launch)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3


def case(n: int, use_pdl: bool, two_streams: bool, reps: int) -> dict:
    x = torch.zeros(1, device="cuda")
    side = torch.zeros(1, device="cuda") if two_streams else None
    _chain(x, n, use_pdl, side)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(x, 2, use_pdl, side)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        _chain(x, n, use_pdl, side)
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    host = launch_times(g, reps)
    x.zero_()
    dev = device_us(g)
    right = float(x.item()) == float(n)
    del g
    return dict(
        nodes=n, pdl=use_pdl, two_streams=two_streams, launch_us=statistics.median(host),
        launch_us_min=min(host), device_us=dev, result_right=right,
    )  # fmt: skip


def alive(n: int, counts: list[int], reps: int) -> list[dict]:
    """Launch time of one graph of n PDL nodes while k other graphs like it are instantiated."""
    x = torch.zeros(1, device="cuda")
    _chain(x, n, True, None)
    torch.cuda.synchronize()
    kept, rows = [], []
    for k in counts:
        while len(kept) < k + 1:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _chain(x, n, True, None)
            kept.append(g)
        g = kept[0]
        g.replay()
        host = launch_times(g, reps)
        rows.append(dict(nodes=n, other_graphs=k, launch_us=statistics.median(host)))
        print(f"nodes {n} with {k:3d} other graphs alive: launch {rows[-1]['launch_us']:.1f} us",
              flush=True)  # fmt: skip
    return rows


def after_profiler(n: int, reps: int) -> dict:
    """Launch time of one graph of n PDL nodes before and after a torch profiler session (one
    eager op traced): the profiler leaves CUPTI attached to the process."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.zeros(1, device="cuda")
    _chain(x, n, True, None)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _chain(x, n, True, None)
    g.replay()

    def launch() -> float:
        return statistics.median(launch_times(g, reps))

    before = launch()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        x.add_(1)
        torch.cuda.synchronize()
    row = dict(nodes=n, before_us=before, after_us=launch())
    print(f"nodes {n}: launch {row['before_us']:.1f} us before a profiler session, "
          f"{row['after_us']:.1f} us after it", flush=True)  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", default="100,300,1100", help="chain lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=15, help="timed launches per case")
    ap.add_argument(
        "--alive",
        default="0,1,3,7,15,31",
        help="counts of other instantiated graphs for the graphs-alive case",
    )
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("graph_launch.py needs a CUDA device")
    rows = []
    for n in (int(v) for v in args.nodes.split(",")):
        for use_pdl in (False, True):
            for two in (False, True):
                r = case(n, use_pdl, two, args.reps)
                rows.append(r)
                print(
                    f"nodes {n:5d} pdl {use_pdl!s:5} two streams {two!s:5}: launch "
                    f"{r['launch_us']:7.1f} us (min {r['launch_us_min']:.1f}), device "
                    f"{r['device_us']:7.1f} us, right {r['result_right']}", flush=True,
                )  # fmt: skip
    counts = sorted(int(v) for v in args.alive.split(","))
    many = alive(1100, counts, args.reps)
    prof = after_profiler(1100, args.reps)
    write_json(args.out, dict(env=environment(), benchmark="graph_launch", cases=rows, alive=many,
                              after_profiler=prof))  # fmt: skip


if __name__ == "__main__":
    main()
