"""Evaluate a target + DFlash drafter pair (default: the embedded default) on held-out prompts.

    python3 bench/eval_pair.py --out pair.json --plot pair.png             # CUDA: bf16, graphs
    python3 bench/eval_pair.py --device cpu --out cpu.json --plot cpu.png  # CPU: a smaller run

Offline engine (one `LLM`, tp = 1, no Ray), temperature 0, prompts from
bench/heldout_prompts.json (function headers of held-out modules, `ddserve.train.prompts`):

(a) acceptance: mean committed tokens per DDTree step (tokens / decode steps, summed over the
    prompts; the prefill's first token is not a step) at each of --budgets. Batched: every prompt,
    up to --acc-streams streams at a time, refilled from the queue as streams finish. At
    temperature 0 a stream's tokens and steps do not depend on its batch.
(b) speed: wall-clock output tokens/s of AR (no draft), of DDTree at each of --speed-budgets
    (16, the engine's default budget, among them) and of "auto" (`LLM.generate` as it runs by
    default: its budget tuner picks a budget in 0 (plain), 4, 8, 16 per batch size by measured
    rate), at each --concurrency C: the first --speed-prompts prompts decoded C streams at a
    time, refilled as streams finish (prefill included). Reported: tokens/s, and DDTree / AR
    at the default budget, for auto, and at the best budget.
(c) exactness: for every DDTree run, how many prompts' tokens equal AR's.

Warm-up: the acceptance pass runs first (every step shape once); every timed configuration with
--cuda-graphs, and auto always, also runs once untimed first (graphs captured, the tuner's first
measurements made outside the timing). The fixed-budget loop is `LLM.generate`'s with the budget
given per step (`ModelRunner.ddtree_step`), so one engine (budget = the largest) serves every
budget. --max-minutes stops cleanly: the running configuration is abandoned, everything
finished is in the JSON (rewritten after each one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from collections import deque
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddserve import LLM, SamplingParams  # noqa: E402
from ddserve.engine.budget import BudgetTuner, default_candidates  # noqa: E402
from ddserve.engine.config import EngineConfig, resolve_dtype  # noqa: E402

DEFAULT_BUDGET = EngineConfig().budget  # LLM() and `ddserve serve`
PRESETS = {  # what each device runs unless told otherwise
    "cuda": dict(num_prompts=64, max_tokens=128, concurrency="1,5,10", speed_prompts=10,
                 speed_budgets="4,8,16,32,64", acc_streams=16, repeats=1),
    "cpu": dict(num_prompts=16, max_tokens=64, concurrency="1,5,10", speed_prompts=10,
                speed_budgets="8,16,32", acc_streams=8, repeats=2),
}  # fmt: skip


class Deadline(Exception):
    """--max-minutes passed during a configuration."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target checkpoint (default: the embedded one)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter dir (default: MODEL/drafter)")
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "heldout_prompts.json"))
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay CUDA graphs (default: on for CUDA with a 16-bit dtype)",
    )
    ap.add_argument("--budgets", default="1,4,8,16,32,64", help="acceptance budgets")
    ap.add_argument("--speed-budgets", default=None, help="timed (cuda 4,..,64; cpu 8,16,32)")
    ap.add_argument("--concurrency", default=None, help="streams at once (1,5,10)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per prompt (cuda 128, cpu 64)")
    ap.add_argument("--num-prompts", type=int, default=None, help="acceptance (cuda 64, cpu 16)")
    ap.add_argument("--speed-prompts", type=int, default=None, help="prompts timed (10)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (1; cpu 2): fastest")
    ap.add_argument("--acc-streams", type=int, default=None, help="acceptance batch (16 / 8)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: engine's)")
    ap.add_argument("--max-minutes", type=float, default=4.5, help="stop cleanly after this")
    ap.add_argument("--out", default=None, help="JSON output (default: print)")
    ap.add_argument("--plot", default=None, help="PNG: committed tokens per step vs budget")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for key, val in PRESETS["cuda" if args.device.startswith("cuda") else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.dtype = resolve_dtype(args.dtype, args.device)
    if args.cuda_graphs is None:
        args.cuda_graphs = args.device.startswith("cuda") and args.dtype != "float32"
    ints = lambda s: [int(x) for x in str(s).split(",") if x]  # noqa: E731
    args.budgets, args.concurrency = ints(args.budgets), ints(args.concurrency)
    args.speed_budgets = sorted(set(ints(args.speed_budgets)) | {DEFAULT_BUDGET})
    return args


def decode(runner, prompts, params, streams: int, budget: int | None, deadline: float):
    """`LLM.generate`'s loop: up to `streams` streams at a time, AR steps (budget None) or DDTree
    steps of `budget` nodes. Returns (tokens per prompt, decode steps per prompt)."""
    toks, steps = [[] for _ in prompts], [0] * len(prompts)
    queue, active, sids = deque(range(len(prompts))), {}, itertools.count()
    try:
        while queue or active:
            if time.perf_counter() > deadline:
                raise Deadline
            while queue and len(active) < streams:
                sid = ("eval", next(sids))
                runner.add_stream(sid, prompts[queue[0]], params)
                active[sid] = queue.popleft()
            collect(runner.prefill(), active, toks)
            ready = [s for s in active if runner.streams[s].prefilled]
            if ready:
                out = runner.ar_step(ready) if budget is None else runner.ddtree_step(ready, budget)
                for sid in out:
                    steps[active[sid]] += 1
                collect(out, active, toks)
    finally:
        for sid in active:
            runner.cancel(sid)
    return toks, steps


def collect(outs: dict, active: dict, toks: list[list[int]]) -> None:
    for sid, so in outs.items():
        toks[active[sid]] += so.tokens
        if so.finished:
            del active[sid]


def timed(runner, prompts, params, streams, budget, deadline) -> tuple[list, list, float]:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    toks, steps = decode(runner, prompts, params, streams, budget, deadline)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return toks, steps, time.perf_counter() - t0


def summary(toks, steps, seconds, ref=None) -> dict:
    """Tokens, decode steps, committed per step (decode tokens / steps), tokens/s, exactness."""
    n, s = sum(map(len, toks)), sum(steps)
    out = dict(prompts=len(toks), tokens=n, steps=s, seconds=round(seconds, 3),
               tokens_per_s=round(n / seconds, 2),
               committed_per_step=round((n - len(toks)) / s, 4) if s else None)  # fmt: skip
    if ref is not None:
        out["identical"] = sum(a == b for a, b in zip(toks, ref, strict=True))
    return out


def environment(args, runner) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(),
               device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
               threads=torch.get_num_threads(), cpus=os.cpu_count())  # fmt: skip
    if runner.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(runner.device)
    env.update({k: v for k, v in os.environ.items() if k.startswith("DDSERVE_")})
    return env


class Eval:
    """The report, rewritten to --out after each configuration."""

    def __init__(self, args) -> None:
        from ddserve.model.tiny import DEFAULT_NAME, default_model_dir

        self.args, self.t0 = args, time.perf_counter()
        self.deadline = self.t0 + 60 * args.max_minutes
        model = Path(args.model) if args.model else default_model_dir()
        drafter = args.drafter or model / "drafter"
        doc = json.loads(Path(args.prompts).read_text())
        self.prompts = doc["prompts"][: args.num_prompts]
        from ddserve.tokenizer import Tokenizer, encode_prompt

        tok = Tokenizer.from_dir(model)
        self.ids = [encode_prompt(tok, p["prompt"]) for p in self.prompts]
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        self.llm = self._engine(model, drafter)
        self.runner = self.llm.runner
        self.report = dict(
            benchmark="eval_pair", args=vars(args), model=str(model), drafter=str(drafter),
            name=model.name if args.model else DEFAULT_NAME,
            env=environment(args, self.runner), load_s=round(time.perf_counter() - self.t0, 1),
            prompts=dict(file=args.prompts, count=len(self.ids),
                         tokens=[len(i) for i in self.ids]),
            acceptance=dict(mode=f"batched, up to {args.acc_streams} streams", ar=None,
                            budgets={}),
            speed=[], skipped=[], partial=False,
        )  # fmt: skip

    def _engine(self, model: Path, drafter) -> LLM:
        a = self.args
        llm = LLM(model, drafter=str(drafter), budget=max([*a.budgets, *a.speed_budgets]),
                  device=a.device, num_slots=16384, dtype=a.dtype, seed=0,
                  max_streams=max([a.acc_streams, *a.concurrency]), cuda_graphs=a.cuda_graphs,
                  batch_invariant=True, cpu_threads=a.threads)  # fmt: skip
        llm.tuner = BudgetTuner(default_candidates(DEFAULT_BUDGET), warmup=1)  # as LLM() has
        return llm

    def tuned(self, ids, streams: int) -> tuple[list, list, float, list]:
        """`LLM.generate` with its budget tuner: (tokens, steps, seconds, budgets used)."""
        if time.perf_counter() > self.deadline:
            raise Deadline
        self.llm.max_streams = streams
        t0 = time.perf_counter()
        outs = self.llm.generate(ids, self.params)
        sec = time.perf_counter() - t0
        used = sorted({b for o in outs for b in o.stats.get("budget_per_step", [])})
        return [o.token_ids for o in outs], [o.stats["steps"] for o in outs], sec, used

    def save(self) -> None:
        self.report["seconds"] = round(time.perf_counter() - self.t0, 1)
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.report, indent=1) + "\n")

    def run(self, what: str, fn):
        """fn() unless past the deadline; a Deadline inside marks the report partial."""
        try:
            if time.perf_counter() > self.deadline:
                raise Deadline
            return fn()
        except Deadline:
            self.report["partial"] = True
            self.report["skipped"].append(what)
            print(f"  {what}: skipped (--max-minutes)", flush=True)
            return None
        finally:
            self.save()

    def acceptance(self) -> None:
        a, acc = self.args, self.report["acceptance"]

        def one(budget):
            toks, steps, sec = timed(self.runner, self.ids, self.params, a.acc_streams, budget,
                                     self.deadline)  # fmt: skip
            return toks, summary(toks, steps, sec, self.ar_toks if budget else None)

        res = self.run("acceptance ar", lambda: one(None))
        if res is None:
            return
        self.ar_toks, acc["ar"] = res
        print(f"  AR: {acc['ar']['tokens']} tokens in {acc['ar']['seconds']} s", flush=True)
        for b in a.budgets:
            res = self.run(f"acceptance budget {b}", lambda b=b: one(b)[1])
            if res is not None:
                acc["budgets"][str(b)] = res
                print(f"  budget {b}: {res['committed_per_step']:.2f} tokens/step, "
                      f"{res['identical']}/{res['prompts']} == AR", flush=True)  # fmt: skip

    def speed(self, c: int) -> None:
        a = self.args
        ids, ref = self.ids[: a.speed_prompts], self.ar_toks[: a.speed_prompts]
        entry = dict(concurrency=c, prompts=len(ids), ar=None, ddtree={}, auto=None)
        self.report["speed"].append(entry)
        for mode in ["ar", *a.speed_budgets, "auto"]:
            name = mode if isinstance(mode, str) else f"budget {mode}"
            res = self.run(f"speed c={c} {name}", lambda mode=mode: self._time(ids, ref, c, mode))
            if res is None:
                continue
            if isinstance(mode, str):
                entry[mode] = res
            else:
                entry["ddtree"][str(mode)] = res
            print(f"  c={c} {name}: {res['tokens_per_s']:.1f} tokens/s", flush=True)
        ar = entry["ar"]
        if ar and entry["ddtree"]:
            rate = lambda r: round(r["tokens_per_s"] / ar["tokens_per_s"], 3)  # noqa: E731
            best = max(entry["ddtree"], key=lambda b: entry["ddtree"][b]["tokens_per_s"])
            entry.update(best_budget=int(best), speedup_best=rate(entry["ddtree"][best]))
            if str(DEFAULT_BUDGET) in entry["ddtree"]:
                entry["speedup_default"] = rate(entry["ddtree"][str(DEFAULT_BUDGET)])
            if entry["auto"]:
                entry["speedup_auto"] = rate(entry["auto"])

    def _time(self, ids, ref, c: int, mode) -> dict:
        """One configuration: a warm-up run (with graphs: the whole run; auto: the tuner learns
        there), then --repeats timed runs; the fastest counts."""
        budget = None if mode == "ar" else mode

        def run() -> tuple[list, list, float, list | None]:
            if mode == "auto":
                return self.tuned(ids, c)
            return (*timed(self.runner, ids, self.params, c, budget, self.deadline), None)

        if self.args.cuda_graphs or mode == "auto":
            run()
        runs = [run() for _ in range(self.args.repeats)]
        toks, steps, sec, used = min(runs, key=lambda r: r[2])
        out = {**summary(toks, steps, sec, ref), "seconds_all": [round(r[2], 3) for r in runs]}
        return out if used is None else {**out, "budgets_used": used}

    def exactness(self) -> dict:
        runs = list(self.report["acceptance"]["budgets"].values())
        for e in self.report["speed"]:
            runs += [*e["ddtree"].values(), *([e["auto"]] if e["auto"] else [])]
        return dict(identical=sum(r["identical"] for r in runs),
                    total=sum(r["prompts"] for r in runs))  # fmt: skip


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = report["acceptance"]["budgets"]
    xs = [int(b) for b in acc]
    ys = [acc[b]["committed_per_step"] for b in acc]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, "o-", label="DDTree (engine, greedy)")
    for x, y in zip(xs, ys, strict=True):
        ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="AR: 1 token per step")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("tree budget (nodes per step)")
    ax.set_ylabel("committed tokens per step")
    env = report["env"]
    ax.set_title(f"{report['name']}: {report['prompts']['count']} held-out prompts x "
                 f"{report['args']['max_tokens']} tokens, {env['device']} {env['dtype']}",
                 fontsize=9)  # fmt: skip
    ax.set_ylim(0, max(ys + [1]) * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ev = Eval(args)
    print(
        f"loaded {ev.report['model']} on {args.device} ({args.dtype}, graphs "
        f"{args.cuda_graphs}) in {ev.report['load_s']} s; {len(ev.ids)} prompts",
        flush=True,
    )
    print("acceptance:", flush=True)
    ev.acceptance()
    if ev.report["acceptance"]["ar"] is not None:
        print("speed:", flush=True)
        for c in args.concurrency:
            ev.speed(c)
    ev.report["exactness"] = ev.exactness()
    ev.save()
    if args.plot and ev.report["acceptance"]["budgets"]:
        plot(ev.report, args.plot)
    x = ev.report["exactness"]
    print(
        f"DDTree == AR: {x['identical']}/{x['total']} prompt runs; "
        f"{'partial, ' if ev.report['partial'] else ''}{ev.report['seconds']} s",
        flush=True,
    )
    if not args.out:
        print(json.dumps(ev.report, indent=1))
    ev.runner.close()
    return ev.report


if __name__ == "__main__":
    main()
