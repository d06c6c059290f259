"""Where a K2.6 rank step's time goes: per-category kernel time and launch counts of one target
forward, replayed from a CUDA graph (as the engine runs it) and eager, against byte floors.

    python bench/profile_step.py --out profile.json                  # H200: 61-layer rank slice
    python bench/profile_step.py --small --device cpu --out x.json   # smoke run (CPU ops)

For each configuration (AR at each --batches, DDTree verify of --budget at each --batches):
1. the engine's own inputs of one such forward are captured (random K2.6 rank slice at tp=8
   shapes, --prefix prompt tokens per stream, oracle drafter for the verify tree);
2. eager profile with every module of the model annotated (torch.profiler user annotations):
   each kernel is attributed to the innermost module that launched it, then to a category;
3. the same forward captured in a CUDA graph and profiled over --reps replays: kernel durations
   by position in the replay, each matched to the eager kernel of the same name and occurrence
   (`by_occurrence`: the graph replays the eager launches, but with the shared expert on a
   second stream their interleaving in time differs), so graph time is attributed to the same
   categories;
4. floors: bytes the category must read (weights; distinct routed experts measured by routing;
   KV latents of every key) over the measured copy bandwidth.
JSON per configuration: categories (us per step, kernels, floor us), the top kernels, kernels per
layer, the graph's wall time and its gaps between kernels. --variants profiles each configuration
under several kernel launch variants in one process (same weights, same inputs): "default"
(programmatic dependent launch with its L2 prefetches), "no-<kernel>-prefetch" (matmul, router,
attention), "no-prefetch", "no-pdl", "no-side-stream" (the MoE's shared expert on the main
stream), "side-first" (the shared expert's branch forked before the router instead of after
it: `side_first_moe_forward`), "no-latent-fusion" (`MLA.latent_fusion` off: q_a_layernorm in a
launch of its own and the query's RoPE in `mla_rope_cache`), "moe-rolled" / "moe-depth2" /
"moe-pfaN" (the MoE's step loop not unrolled / two weight steps in flight / each step asks L2
for the lines of the step N ahead at every T, 0: none; same bits), "moe-split8" (the up
projection's K in 8 ranges: other bits, timing only), "router-splitN" (the router gate's K in N
ranges: other bits, timing only), "matmul-pfNk" (each dense matmul program asks L2 for up to N
KiB of its weights before the PDL wait instead of `invariant.PREFETCH_BYTES`; same bits),
"moe-pairs-fp32" (the down GEMM's per-pair outputs in fp32, not bf16: other bits, timing only),
"moe-pairs-uptoN" (the MoE's top-k combine in the shared down matmul's epilogue up to N tokens,
not `moe_triton.PAIRS_MAX_TOKENS`; same bits).
With PDL a kernel may start before its predecessor ends and wait on the device, so its profiled
duration includes that wait: compare variants by the replay's wall time. On CPU there is no
graph: leaf CPU ops stand in for kernels (a smoke run of the attribution code).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _util import capture_graph, environment, write_json  # noqa: E402
from bench_engine import parse_args as engine_args  # noqa: E402
from bench_engine import setup  # noqa: E402
from engine_model import parameter_bytes, weight_bytes_per_layer  # noqa: E402
from engine_probe import RouteRecorder, capture_forward_inputs  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from ddserve.kernels import backend, invariant, moe_triton, moe_v3, pdl, router  # noqa: E402
from ddserve.model.mla import MLA  # noqa: E402
from ddserve.model.moe import MoE, reduce_partials  # noqa: E402

# launch variants: PDL with every prefetch, without one kernel's, without any, no PDL at all;
# the shared expert on the main stream (no side stream), or its branch forked before the router;
# the latent path unsplit (q_a_layernorm's own launch, the query's RoPE in mla_rope_cache);
# the routed MoE's step loop never unrolled (moe_v3 UNROLL False), two weight steps in flight,
# its up GEMM's L2 asks PFA steps ahead at every T (0: none); all the same bits
VARIANTS = ("default", "no-matmul-prefetch", "no-router-prefetch", "no-attention-prefetch",
            "no-prefetch", "no-pdl", "no-side-stream", "side-first",
            "no-latent-fusion", "moe-rolled", "moe-depth2", "moe-pfa0", "moe-pfa2",
            "moe-pfa3", "moe-pfa4", "moe-pfa6", "moe-split8", "router-split14",
            "router-split28", "matmul-pf64k", "matmul-pf128k", "matmul-pf256k",
            "moe-pairs-fp32", "moe-pairs-upto0", "moe-pairs-upto16",
            "moe-pairs-upto1024")  # fmt: skip

CATEGORIES = (
    "tree attention",
    "router",
    "attention projections",
    "absorb bmm",
    "routed MoE",
    "attention elementwise",
    "shared expert",
    "RMSNorm",
    "dense layer 0",
    "lm_head",
    "embedding",
    "all-reduce",
    "other",
)
PROJ = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj")


def category(path: str, mlp_kind: str | None, kernel: str) -> str:
    """The category of a kernel launched inside module `path` (mlp_kind: the class of the
    layer's `mlp`, DenseMLP or MoE)."""
    k = kernel.lower()
    if "nccl" in k or "allreduce" in k or "all_reduce" in k:
        return "all-reduce"
    if "rms" in k or path.endswith(("layernorm", ".norm")):
        return "RMSNorm"
    if ".self_attn" in path:
        if path.endswith(PROJ):
            return "attention projections"
        if "tree_attn" in k or "combine" in k:
            return "tree attention"
        if "_mm_kernel" in k or "sum_splits" in k or "gemm" in k or "gemv" in k:
            return "absorb bmm"
        return "attention elementwise"
    if ".mlp" in path:
        if mlp_kind == "DenseMLP":
            return "dense layer 0"
        if ".mlp.gate" in path or "router" in k:
            return "router"
        if ".mlp.shared_experts" in path:
            return "shared expert"
        return "routed MoE"
    if path.startswith("lm_head"):
        return "lm_head"
    if "embed" in path:
        return "embedding"
    return "other"


# Methods that launch a submodule's work outside that submodule's forward, annotated as it:
# MLA's q_a_proj + kv_a_proj_with_mqa as one matmul on the CUDA invariant path, and q_b_proj with
# the query's RoPE (`MLA._query_rope`, `linear_rope`); the MoE calls its shared expert's
# gate/up + SiLU (`DenseMLP.activation`) and down_proj, not its forward.
METHODS = {
    "_down_projections": "kv_a_proj_with_mqa",
    "_query_rope": "q_b_proj",
    "activation": "activation",
}


@contextlib.contextmanager
def annotated(model: torch.nn.Module):
    """Every named module's forward (and the `METHODS`) inside a profiler annotation of its
    qualified name."""
    originals = []
    for name, mod in model.named_modules():
        if not name:
            continue
        attrs = [("forward", name)] + [
            (m, f"{name}.{label}") for m, label in METHODS.items() if hasattr(mod, m)
        ]
        for attr, label in attrs:
            orig = getattr(mod, attr)

            def wrapped(*a, __f=orig, __n=label, **kw):
                with record_function(__n):
                    return __f(*a, **kw)

            originals.append((mod, attr, mod.__dict__.get(attr)))
            setattr(mod, attr, wrapped)
    try:
        yield
    finally:
        for mod, attr, orig in originals:
            if orig is None:
                delattr(mod, attr)
            else:
                setattr(mod, attr, orig)


def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def innermost(stamps: list[tuple[float, int]], ranges: list[dict]) -> dict[int, str]:
    """For each (timestamp, key), the name of the innermost range containing it (or "")."""
    events = [(r["ts"], 0, r) for r in ranges] + [(r["ts"] + r["dur"], -1, r) for r in ranges]
    events += [(ts, 1, key) for ts, key in stamps]
    events.sort(key=lambda e: (e[0], e[1]))
    stack: list[dict] = []
    out: dict[int, str] = {}
    for _, kind, item in events:
        if kind == 0:
            stack.append(item)
        elif kind == -1:
            if item in stack:
                stack.remove(item)
        else:
            out[item] = stack[-1]["name"] if stack else ""
    return out


def eager_kernels(events: list[dict], cuda: bool) -> list[tuple[str, str, float]]:
    """[(kernel name, innermost module, duration us)] in launch order."""
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    if cuda:
        kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
        launch = {
            e["args"]["correlation"]: e["ts"]
            for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver")
            and "correlation" in e.get("args", {})
        }
        stamps = [
            (launch.get(k["args"].get("correlation"), -1.0), i) for i, k in enumerate(kernels)
        ]
    else:  # leaf CPU ops stand in for kernels
        ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
        kernels = [o for i, o in enumerate(ops) if not _has_child(ops, i)]
        stamps = [(k["ts"], i) for i, k in enumerate(kernels)]
    where = innermost(stamps, ranges)
    return [(k["name"], where.get(i, ""), float(k["dur"])) for i, k in enumerate(kernels)]


def _has_child(ops: list[dict], i: int) -> bool:
    end = ops[i]["ts"] + ops[i]["dur"]
    j = i + 1
    return j < len(ops) and ops[j]["ts"] < end and ops[j].get("tid") == ops[i].get("tid")


def graph_kernels(events: list[dict], reps: int) -> tuple[list[tuple[str, float]], float]:
    """([(name, mean duration us)] of one replay in the first replay's order, mean wall us of one
    replay). A kernel's duration is averaged over the replays by name and occurrence (two
    streams may interleave differently from one replay to the next)."""
    ks = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    n = len(ks) // reps
    durs: dict[tuple[str, int], float] = defaultdict(float)
    order: list[tuple[str, int]] = []
    for r in range(reps):
        taken: dict[str, int] = defaultdict(int)
        for e in ks[r * n : (r + 1) * n]:
            key = (e["name"], taken[e["name"]])
            taken[e["name"]] += 1
            durs[key] += float(e["dur"]) / reps
            if r == 0:
                order.append(key)
    walls = [
        max(e["ts"] + e["dur"] for e in ks[r * n : (r + 1) * n]) - ks[r * n]["ts"]
        for r in range(reps)
    ]
    return [(k[0], durs[k]) for k in order], sum(walls) / reps if walls else 0.0


def by_occurrence(eager: list[tuple[str, str, float]], names: list[str]) -> list[str | None]:
    """The eager module path of each graph kernel in `names`: the k-th launch of a kernel name in
    the replay is the k-th of that name in the eager run (None where the eager run has fewer).
    Matching by name and occurrence rather than by position keeps the attribution right when
    kernels run on two streams (the MoE's shared expert): their interleaving in time differs
    between the eager run and a replay, but each name's own sequence does not."""
    seen: dict[str, list[str]] = defaultdict(list)
    for name, path, _ in eager:
        seen[name].append(path)
    taken: dict[str, int] = defaultdict(int)
    out: list[str | None] = []
    for name in names:
        k = taken[name]
        taken[name] += 1
        out.append(seen[name][k] if k < len(seen[name]) else None)
    return out


def summarize(rows: list[tuple[str, str, float]], floors: dict[str, float], layers: int) -> dict:
    """rows: (kernel, category, us) -> the per-category table and top kernels."""
    cats: dict[str, dict] = {
        c: dict(us=0.0, kernels=0, floor_us=floors.get(c, 0.0)) for c in CATEGORIES
    }
    top: dict[str, list[float]] = defaultdict(list)
    for name, cat, us in rows:
        cats[cat]["us"] += us
        cats[cat]["kernels"] += 1
        top[name].append(us)
    tops = sorted(((sum(v), len(v), k) for k, v in top.items()), reverse=True)[:25]
    return dict(
        kernel_us=sum(us for _, _, us in rows),
        kernels=len(rows),
        kernels_per_layer=len(rows) / layers,
        categories={c: v for c, v in cats.items() if v["kernels"] or v["floor_us"]},
        top_kernels=[dict(name=k[:120], us=s, count=n) for s, n, k in tops],
    )


def floors_us(model, meta, recorder: RouteRecorder, bw: float, ntok: int) -> dict[str, float]:
    """Bytes each category must read per forward (`engine_model`'s weight bytes by role; the
    distinct experts routed to; every key's latent), over the copy bandwidth, in us."""
    cfg, by = model.cfg, parameter_bytes(model)
    kv_b = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".self_attn.kv_b_proj." in n)  # fmt: skip
    distinct = recorder.distinct()  # [forward][layer]
    keys = int(meta.prefix_lens.sum()) + int(meta.q_lens.sum())
    floors = {
        "attention projections": by["attention"] - kv_b,
        "absorb bmm": kv_b,
        "router": by["router"],
        "shared expert": by["shared_expert"],
        "dense layer 0": by["dense_mlp"],
        "lm_head": by["lm_head"],
        "embedding": by["embedding"] * ntok / cfg.vocab_size,
        "RMSNorm": by["norms"],
        "routed MoE": sum(distinct[-1]) * weight_bytes_per_layer(cfg)[1] if distinct else 0.0,
        "tree attention": keys * cfg.kv_latent_dim * 2 * cfg.num_hidden_layers,
    }
    return {k: v / bw * 1e6 for k, v in floors.items()}


def profile_forward(runner, inputs, args, recorder, bw) -> dict:
    model, cuda = runner.model, runner.device.type == "cuda"
    ids, positions, meta, absorbed = inputs
    mlp_kind = {
        f"model.layers.{i}": type(layer.mlp).__name__ for i, layer in enumerate(model.model.layers)
    }

    def forward():
        with backend.kernel_mode(runner.kernels):
            return model(ids, positions, runner.kv.pool, meta, runner.capture, absorbed)

    forward()  # compile / autotune outside the profile
    recorder.clear()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with recorder.active(), annotated(model), profile(activities=acts) as prof:
        forward()
        if cuda:
            torch.cuda.synchronize()
    eager = eager_kernels(trace_events(prof), cuda)

    def cat_of(name: str, path: str) -> str:
        layer = ".".join(path.split(".")[:3])
        return category(path, mlp_kind.get(layer), name)

    floors = floors_us(model, meta, recorder, bw, int(ids.numel()))
    layers = model.cfg.num_hidden_layers
    out = dict(eager=summarize([(n, cat_of(n, p), us) for n, p, us in eager], floors, layers))
    if not cuda:
        return out
    graph = capture_graph(forward)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as gprof:
        for _ in range(args.reps):
            graph.replay()
        torch.cuda.synchronize()
    per, wall = graph_kernels(trace_events(gprof), args.reps)
    del graph
    paths = by_occurrence(eager, [n for n, _ in per])
    matched = sum(1 for p in paths if p is not None)
    rows = [
        (n, "other" if p is None else cat_of(n, p), us)
        for (n, us), p in zip(per, paths, strict=True)
    ]
    g = summarize(rows, floors, layers)
    g.update(wall_us=wall, gaps_us=wall - g["kernel_us"], matched_to_eager=matched)
    out["graph"] = g
    return out


def use_router_fma() -> None:
    """Every router call of this process takes the FMA gate configuration (bench only)."""
    from ddserve.kernels import router

    base = router.router_config
    router.router_config = lambda e, d: router.RouterConfig(16, 8, 64, 4, base(e, d).split, 4)


@contextlib.contextmanager
def variant(runner, name: str):
    """The runner's kernel configuration, the PDL prefetches and the model's switches set for one
    launch variant, and restored after it."""
    kernels, prefetch, moe_forward = runner.kernels, pdl.PREFETCH, MoE.forward
    router_config, matmul_pf = router.router_config, invariant.PREFETCH_BYTES
    moe_config, pairs_max = dict(moe_v3.CONFIG), moe_triton.PAIRS_MAX_TOKENS
    attention = [(m, m.latent_fusion) for m in runner.model.modules() if isinstance(m, MLA)]
    if name == "no-pdl":
        runner.kernels = dataclasses.replace(kernels, pdl=False)
    elif name == "no-side-stream":
        runner.kernels = dataclasses.replace(kernels, side_stream=False)
    elif name == "side-first":
        MoE.forward = side_first_moe_forward
    elif name == "no-latent-fusion":
        for mod, _ in attention:
            mod.latent_fusion = False
    elif name == "moe-rolled":
        moe_v3.CONFIG["UNROLL"] = False
    elif name == "moe-depth2":
        moe_v3.CONFIG["DEPTH"] = 2
    elif name.startswith("moe-pfa"):
        moe_v3.CONFIG["PFA"] = int(name.removeprefix("moe-pfa"))
    elif name == "moe-split8":  # other bits: the up projection's K in 8 ranges
        moe_v3.CONFIG["SPLIT"] = 8
    elif name == "moe-pairs-fp32":  # other bits: fp32 per-pair outputs
        moe_v3.CONFIG["PAIRS"] = "fp32"
    elif name.startswith("moe-pairs-upto"):
        moe_triton.PAIRS_MAX_TOKENS = int(name.removeprefix("moe-pairs-upto"))
    elif name.startswith("matmul-pf"):
        invariant.PREFETCH_BYTES = int(name.removeprefix("matmul-pf").removesuffix("k")) << 10
    elif name.startswith("router-split"):
        split = int(name.removeprefix("router-split"))
        router.router_config = lambda e, d: router_config(e, d)._replace(split=split)
    elif name == "no-prefetch":
        pdl.PREFETCH = frozenset()
    elif name.endswith("-prefetch"):  # no-<kernel>-prefetch
        pdl.PREFETCH = prefetch - {name.removeprefix("no-").removesuffix("-prefetch")}
    try:
        yield
    finally:
        runner.kernels, pdl.PREFETCH, MoE.forward = kernels, prefetch, moe_forward
        router.router_config, invariant.PREFETCH_BYTES = router_config, matmul_pf
        moe_v3.CONFIG.update(moe_config)
        moe_triton.PAIRS_MAX_TOKENS = pairs_max
        for mod, fused in attention:
            mod.latent_fusion = fused


def side_first_moe_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    """`MoE.forward` with the shared expert's branch forked before the router (it then runs
    beside the router too); the same kernels and bits."""
    shared = self.shared_experts
    with backend.side_branch(x) as join:
        h = shared.activation(x)
    try:
        y, topk = self._routed(x, *self._route(x), pairs_ok=True)
    finally:
        join()
    return reduce_partials(self.comm, shared.down_proj(h, add=y, add_topk=topk))


def capture_inputs(bench, sids: list[int], budget: int | None, depth: int) -> tuple:
    """The engine's own forward inputs of one AR step (budget None) or one DDTree verify."""
    sink: list = []
    runner = bench.runner
    if budget is None:
        bench.rewind(sids)
        runner.drafter, runner.cfg = None, bench.base_cfg
    else:  # rewinds, installs the oracle drafter and the budget
        bench._oracle(sids, budget, dict(depth=depth, corrupt=0.0, margin=20.0, seed=0))
    with capture_forward_inputs(runner, sink):
        (runner.ar_step if budget is None else runner.ddtree_step)(sids)
    runner.cfg = bench.base_cfg
    return sink[-1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--layers", type=int, help="decoder layers (61)")
    ap.add_argument("--batches", default=None, help="stream counts (1,5,10; small: 1,2)")
    ap.add_argument("--budget", type=int, default=None, help="DDTree budget (16; small: 4)")
    ap.add_argument("--prefix", type=int, help="prompt tokens per stream (1024)")
    ap.add_argument("--reps", type=int, default=3, help="profiled graph replays")
    ap.add_argument(
        "--router-fma",
        action="store_true",
        help="the router's gate as fp32 FMA chains (16x8 tiles) instead of the tensor-core default",
    )
    ap.add_argument(
        "--variants",
        default="default",
        help=f"comma list of kernel launch variants profiled per configuration, of {VARIANTS}",
    )
    ap.add_argument(
        "--kinds", default="ar,ddtree", help="forwards to profile: ar (decode), ddtree (verify)"
    )
    ap.add_argument("--out", default=None, help="JSON output path (default: print)")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if not kinds or set(kinds) - {"ar", "ddtree"}:
        ap.error(f"--kinds: a comma list of ar, ddtree, not {args.kinds!r}")
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    budget = args.budget or (4 if args.small else 16)
    if args.router_fma:
        use_router_fma()
    eargs = [
        *(["--small"] if args.small else []),
        "--budgets",
        str(budget),
        "--steps",
        "1",
        "--warmup",
        "0",
        "--split-steps",
        "0",
        "--corrupt",
        "0",
        "--graph-reps",
        "0",
    ]
    for flag, val in (
        ("--device", args.device),
        ("--layers", args.layers),
        ("--batches", args.batches),
        ("--prefix", args.prefix),
    ):
        if val is not None:
            eargs += [flag, str(val)]
    ea = engine_args(eargs)
    bench, rep = setup(ea)
    runner, bw = bench.runner, rep["bandwidth"]["bytes_per_s"]
    recorder = RouteRecorder(runner.model)
    c_max = max(ea.batches)
    bench.run_ar(bench.sids[:c_max], 0, ea.depth + 2)  # the oracle's continuation
    report = dict(
        router_fma=args.router_fma,
        benchmark="profile_step",
        env=environment(),
        layers=rep["layers"],
        prefix=ea.prefix,
        budget=budget,
        bandwidth_bytes_per_s=bw,
        configs=[],
    )
    for kind, c in [(k, c) for k in ("ar", "ddtree") if k in kinds for c in ea.batches]:
        sids = bench.sids[:c]
        for name in variants:
            try:
                inputs = capture_inputs(bench, sids, None if kind == "ar" else budget, ea.depth)
                with variant(runner, name):
                    res = profile_forward(runner, inputs, args, recorder, bw)
            except Exception as e:  # noqa: BLE001 - a failed configuration must not lose the rest
                err = f"{type(e).__name__}: {e}"
                report["configs"].append(dict(kind=kind, batch=c, variant=name, error=err))
                print(f"{kind} C={c} {name}: {err}", flush=True)
                continue
            res.update(kind=kind, batch=c, variant=name, tokens=int(inputs[0].numel()))
            report["configs"].append(res)
            print_config(res)
            write_json(args.out, report) if args.out else None
    if args.out is None:
        print(json.dumps(report, indent=1))
    return report


def print_config(res: dict) -> None:
    view = res.get("graph") or res["eager"]
    mode = "graph" if "graph" in res else "eager"
    wall = f", replay wall {view['wall_us']:.0f} us" if "wall_us" in view else ""
    print(
        f"\n{res['kind']} C={res['batch']} {res['variant']} ({res['tokens']} tokens), {mode}: "
        f"{view['kernel_us']:.0f} us kernels, {view['kernels']} kernels "
        f"({view['kernels_per_layer']:.1f}/layer){wall}",
        flush=True,
    )
    for cat, v in sorted(view["categories"].items(), key=lambda kv: -kv[1]["us"]):
        print(
            f"  {cat:24s} {v['us']:9.1f} us {v['kernels']:6d} kernels"
            f"  floor {v['floor_us']:7.1f} us"
        )


if __name__ == "__main__":
    main()
