"""The host's time in one launch of the K2.6 rank forward's CUDA graph, whole and with parts
of the model replaced by a pass-through, and the graph's nodes by type and kernel.

    python bench/graph_bisect.py --out bisect.json

Builds the benchmark's model (`bench_engine.setup`, one stream), captures the AR forward graph
with the MoE, its router / shared expert / routed experts, the attention, or only its core
(the tree-attention kernel and its split merge) replaced by a pass-through, and times each
graph's launch with the device idle (host time inside `replay()`, median of --reps) and one
replay on the device (events around it on an idle device, so it also
holds part of the launch). Variants run once each, in a fixed order, and launch times drift
through a run (7.7 us for the first, 26 for the fifth in the committed run): compare their
device times, not their launches. "moe-routed-only" runs the routed experts through
`backend.moe`, with a combine launch that the real layer folds into the shared expert's down
matmul. It also dumps the full graph's nodes (`cudaGraphDebugDotPrint`, next to --out) and
counts them by type and kernel name. The bisected graphs' outputs are meaningless. Run it in a
process that has not used the torch profiler: the profiler leaves CUPTI attached, and every
later launch of a 1,100-node graph then costs 0.2-0.9 ms (`graph_launch.py`'s after-profiler
case).
"""

from __future__ import annotations

import collections
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _util import environment, write_json  # noqa: E402
from bench_engine import parse_args, setup  # noqa: E402
from graph_launch import device_us, launch_times  # noqa: E402

from ddserve.engine import graphs as engine_graphs  # noqa: E402
from ddserve.kernels import backend  # noqa: E402
from ddserve.model import mla as mla_mod  # noqa: E402
from ddserve.model import moe as moe_mod  # noqa: E402


def _launch(graph, reps: int) -> dict:
    t = launch_times(graph, reps)
    return dict(launch_us=statistics.median(t), launch_us_min=min(t), device_us=device_us(graph))


def _moe_router_only(self, x):
    self._route(x)
    return x


def _moe_routed_only(self, x):
    ids, w = self._route(x)
    y, _ = self._routed(x, ids, w, pairs_ok=False)
    return y


def _attend_nothing(q_lat, q_pe, kv_cache, meta, scale):
    return q_lat  # [T, H, R]: the attention's output shape, no kernel


def _moe_shared_only(self, x):
    return self.shared_experts(x)


VARIANTS = {
    "full": {},
    "moe-identity": {(moe_mod.MoE, "forward"): lambda self, x: x},
    "moe-router-only": {(moe_mod.MoE, "forward"): _moe_router_only},
    "moe-routed-only": {(moe_mod.MoE, "forward"): _moe_routed_only},
    "moe-shared-only": {(moe_mod.MoE, "forward"): _moe_shared_only},
    "attn-identity": {(mla_mod.MLA, "forward"): lambda self, h, *a, **k: h},
    "attn-no-core": {(backend, "tree_attention"): lambda device_type: _attend_nothing},
    "both-identity": {
        (moe_mod.MoE, "forward"): lambda self, x: x,
        (mla_mod.MLA, "forward"): lambda self, h, *a, **k: h,
    },
}


def _dot_counts(path: Path) -> dict:
    """Node counts by type and kernel name in a cudaGraphDebugDotPrint file (record labels:
    `label="{TYPE` then, for kernels, `| {ID | n (topoId: m) | mangled name`)."""
    text = path.read_text(errors="replace")
    types = collections.Counter(re.findall(r'label="\{([A-Z_]+)', text))
    names = re.findall(r"\| \{ID \| \d+ \(topoId: \d+\) \| ([A-Za-z0-9_]+)", text)
    kernels = collections.Counter(n[:60] for n in names)
    return dict(bytes=len(text), types=dict(types), kernels=dict(kernels.most_common(40)))


def main() -> None:
    argv = [a for a in sys.argv[1:]]
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        print("--reps N: timed launches per variant (9). Other options: bench_engine.py's "
              "(--batches is always 1 and --cuda-graphs on):\n")  # fmt: skip
    reps = 9
    if "--reps" in argv:
        i = argv.index("--reps")
        reps = int(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args([*argv, "--cuda-graphs", "--batches", "1"])
    bench, rep = setup(args)
    runner = bench.runner
    sids = bench.sids[:1]
    out = dict(env=environment(), benchmark="graph_bisect", layers=rep["layers"], variants=[])
    captured: list = []
    orig_capture = engine_graphs._capture

    def capture(fn, device, debug=False):
        if not debug:
            g, o = orig_capture(fn, device)
            captured.append(g)
            return g, o
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph(keep_graph=True)
        g.enable_debug_mode()
        with torch.cuda.graph(g):
            o = fn()
        captured.append(g)
        return g, o

    for name, patches in [*VARIANTS.items(), ("full-debug", {})]:
        saved = {k: getattr(*k) for k in patches}
        for (cls, attr), fn in patches.items():
            setattr(cls, attr, fn)
        debug = name == "full-debug"
        engine_graphs._capture = lambda fn, device, debug=debug: capture(fn, device, debug)
        try:
            runner._graphs.close()
            captured.clear()
            bench.rewind(sids)
            for _ in range(3):
                runner.ar_step(sids)
            torch.cuda.synchronize()
            row = dict(variant=name, graphs=len(captured), **_launch(captured[-1], reps))
            if debug and args.out:
                dot = Path(args.out).resolve().with_suffix(".dot")
                dot.parent.mkdir(parents=True, exist_ok=True)
                captured[-1].debug_dump(str(dot))  # (torch only warns when it cannot)
                if not dot.exists():
                    raise RuntimeError(f"debug_dump wrote no {dot.name}")
                row["dot"] = _dot_counts(dot)
        except Exception as e:  # noqa: BLE001 - one failed variant must not lose the rest
            row = dict(variant=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            for (cls, attr), fn in saved.items():
                setattr(cls, attr, fn)
            engine_graphs._capture = orig_capture
        out["variants"].append(row)
        print({k: v for k, v in row.items() if k != "dot"}, flush=True)
        if "dot" in row:
            print(row["dot"]["types"], flush=True)
            for k, v in list(row["dot"]["kernels"].items())[:25]:
                print(f"   {v:5d} {k}")
    runner._graphs.close()
    write_json(args.out, out)


if __name__ == "__main__":
    main()
