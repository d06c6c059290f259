"""CPU wall clock of plain decoding vs DDTree for a target + DFlash drafter (default: the embedded
pair), in the offline engine and, with --cli, through `ddserve generate` end to end.

    python3 bench/cpu_speed.py --out bench/results/cpu_speed.json
    python3 bench/cpu_speed.py --cli --out cpu_speed.json     # + `ddserve generate` timings

Engine: `LLM`s (tp 1, temperature 0, one prompt at a time, --max-tokens each). Modes: `ar`
(plain decoding, no drafter loaded), `ddtree_<b>` (every step at budget b, for each of --budgets;
one LLM with the drafter serves them all) and `auto` (the budget
tuner over plain decoding and `default_candidates(--auto-budget)`, started fresh for every run,
as a one-shot `ddserve generate` starts it). Each repeat runs every mode on every prompt in turn,
so the slow phases of a shared machine hit the modes alike; per (mode, prompt) the median of the
repeats is kept. Reported per mode: tokens/s over all prompts (tokens / summed median seconds,
prefill included) and the speed-up over `ar`. Every mode's tokens must equal `ar`'s (asserted).

--cli: `ddserve generate` with and without --no-speculative, alternating, --cli-repeats times on
the first prompt at the README's default settings (only --prompt and --max-tokens given, and
--model when not the embedded pair):
median wall clock of the whole command (interpreter start, model load, generation) and of the
generation alone (the seconds its stats line prints), and their ratios.

Older engines (no budget tuner, no per-call budget) are measured too: one LLM per budget, no
`auto` mode; so the same script gives before/after figures.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# held-out-style function headers: the README's example prompt, then (--heldout) the first ones of
# bench/heldout_prompts.json
DEFAULT_PROMPTS = ["def read_lines(path):"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target checkpoint (default: the embedded one)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter dir (default: MODEL/drafter)")
    ap.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    ap.add_argument("--heldout", type=int, default=3,
                    help="also the first N prompts of bench/heldout_prompts.json")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="4,8,16,32", help="fixed DDTree budgets timed")
    ap.add_argument("--auto-budget", type=int, default=16, help="largest tree the tuner may use")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: engine's)")
    ap.add_argument("--cli", action="store_true", help="also time `ddserve generate`")
    ap.add_argument("--cli-repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    return ap.parse_args(argv)


def prompts(a: argparse.Namespace) -> list[str]:
    out = list(a.prompt or DEFAULT_PROMPTS)
    if a.heldout:
        doc = json.loads((ROOT / "bench" / "heldout_prompts.json").read_text())
        out += [p["prompt"] for p in doc["prompts"][: a.heldout]]
    return out


def make_llms(a: argparse.Namespace, model: Path, drafter: Path, budgets: list[int]):
    """mode -> (LLM, generate kwargs, fresh tuner or None); new engines share one LLM."""
    from ddserve import LLM

    new = "budget" in inspect.signature(LLM.generate).parameters
    kw = dict(device="cpu", seed=0, num_slots=4096, max_streams=1)
    if a.threads is not None and "cpu_threads" in inspect.signature(LLM).parameters:
        kw["cpu_threads"] = a.threads
    plain = LLM(model, **kw)  # no drafter: plain decoding pays for none
    modes = {"ar": (plain, dict(speculative=False), None)}
    if new:
        shared = LLM(model, drafter=drafter, budget=max(budgets + [a.auto_budget]), **kw)
        modes |= {f"ddtree_{b}": (shared, dict(budget=b), None) for b in budgets}
        modes["auto"] = (shared, {}, a.auto_budget)
        return modes, True
    for b in budgets:
        modes[f"ddtree_{b}"] = (LLM(model, drafter=drafter, budget=b, **kw), {}, None)
    return modes, False


def run_engine(a: argparse.Namespace, model: Path, drafter: Path) -> dict:
    from ddserve import SamplingParams

    budgets = [int(b) for b in a.budgets.split(",") if b.strip()]
    modes, new = make_llms(a, model, drafter, budgets)
    texts = prompts(a)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    runs: dict[str, dict[int, list[dict]]] = {m: {i: [] for i in range(len(texts))} for m in modes}
    for rep in range(a.repeats + 1):  # repeat 0 warms every shape up, untimed
        for i, text in enumerate(texts):
            for mode, (llm, kwargs, auto) in modes.items():
                if auto is not None:  # a fresh tuner, as a one-shot `ddserve generate` has
                    from ddserve.engine.llm import offline_tuner

                    llm.tuner = offline_tuner(auto)
                t0 = time.perf_counter()
                out = llm.generate(text, params, **kwargs)[0]
                seconds = time.perf_counter() - t0
                if auto is not None:
                    llm.tuner = None
                if rep:
                    runs[mode][i].append(dict(
                        seconds=seconds, tokens=out.token_ids, steps=out.stats["steps"],
                        budgets=out.stats.get("budget_per_step", []),
                    ))  # fmt: skip
        print(f"repeat {rep}/{a.repeats} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return summarize(runs, texts, new)


def summarize(runs: dict, texts: list[str], new: bool) -> dict:
    ref = {i: runs["ar"][i][0]["tokens"] for i in runs["ar"]}
    result = {"modes": {}, "exact": True}
    for mode, per_prompt in runs.items():
        rows, total_tokens, total_s = [], 0, 0.0
        for i, reps in per_prompt.items():
            same = all(r["tokens"] == ref[i] for r in reps)
            result["exact"] &= same
            med = statistics.median(r["seconds"] for r in reps)
            n = len(reps[0]["tokens"])
            total_tokens, total_s = total_tokens + n, total_s + med
            rows.append(dict(
                prompt=texts[i][:60], tokens=n, steps=reps[0]["steps"],
                committed_per_step=round((n - 1) / max(1, reps[0]["steps"]), 2),
                median_s=round(med, 3), all_s=[round(r["seconds"], 3) for r in reps],
                tokens_per_s=round(n / med, 1), same_tokens_as_ar=same,
                budgets_used=_counts(reps[-1]["budgets"]),
            ))  # fmt: skip
        result["modes"][mode] = dict(tokens_per_s=round(total_tokens / total_s, 1), prompts=rows)
    ar = result["modes"]["ar"]["tokens_per_s"]
    for m in result["modes"].values():
        m["speedup_vs_ar"] = round(m["tokens_per_s"] / ar, 2)
    if not result["exact"]:
        raise AssertionError("a DDTree mode's tokens differ from plain decoding's")
    return result


def _counts(budgets: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in budgets:
        out[str(b)] = out.get(str(b), 0) + 1
    return out


STATS = re.compile(r"\[(\d+) tokens, (\d+) steps, ([\d.]+) tokens/step, ([\d.]+) s")


def run_cli(a: argparse.Namespace, model: Path, prompt: str) -> dict:
    """`ddserve generate` at the README's defaults, DDTree and --no-speculative alternating."""
    model_arg = ["--model", str(model)] if a.model else []  # the embedded pair: as the README
    base = [sys.executable, "-m", "ddserve", "generate", *model_arg,
            "--prompt", prompt, "--max-tokens", str(a.max_tokens)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs: dict[str, list[dict]] = {"ddtree": [], "no_speculative": []}
    for _ in range(a.cli_repeats):
        for mode, extra in (("ddtree", []), ("no_speculative", ["--no-speculative"])):
            t0 = time.perf_counter()
            p = subprocess.run(base + extra, capture_output=True, text=True, env=env, check=True)
            wall = time.perf_counter() - t0
            m = STATS.search(p.stderr)
            gen = float(m.group(4)) if m else None
            runs[mode].append(dict(wall_s=round(wall, 3), generate_s=gen, out=p.stdout,
                                   stats=p.stderr.strip().splitlines()[-1]))  # fmt: skip
    same = len({r["out"] for rs in runs.values() for r in rs}) == 1
    res = {"command": " ".join(base[2:]), "same_output": same}
    for mode, rs in runs.items():
        res[mode] = dict(
            median_wall_s=statistics.median(r["wall_s"] for r in rs),
            median_generate_s=(
                statistics.median(r["generate_s"] for r in rs) if rs[0]["generate_s"] else None
            ),
            runs=[{k: v for k, v in r.items() if k != "out"} for r in rs],
        )
    d, n = res["ddtree"], res["no_speculative"]
    res["speedup_wall"] = round(n["median_wall_s"] / d["median_wall_s"], 2)
    if d["median_generate_s"] and n["median_generate_s"]:
        res["speedup_generate"] = round(n["median_generate_s"] / d["median_generate_s"], 2)
    if not same:
        raise AssertionError("ddserve generate printed different text with and without DDTree")
    return res


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    from ddserve.model.tiny import default_model_dir

    model = Path(a.model) if a.model else default_model_dir()
    drafter = Path(a.drafter) if a.drafter else model / "drafter"
    report = dict(
        machine=dict(
            platform=platform.platform(),
            cpus=os.cpu_count(),
            affinity=len(os.sched_getaffinity(0)),
            torch=torch.__version__,
            load_avg_start=os.getloadavg(),
        ),
        settings=dict(
            model=str(model),
            drafter=str(drafter),
            max_tokens=a.max_tokens,
            repeats=a.repeats,
            budgets=a.budgets,
            auto_budget=a.auto_budget,
            dtype="float32 (auto on CPU)",
        ),
    )
    report["engine"] = run_engine(a, model, drafter)
    report["settings"]["torch_threads"] = torch.get_num_threads()
    if a.cli:
        report["cli"] = run_cli(a, model, prompts(a)[0])
    report["machine"]["load_avg_end"] = os.getloadavg()
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    modes = report["engine"]["modes"]
    summary = {m: (v["tokens_per_s"], v["speedup_vs_ar"]) for m, v in modes.items()}
    cli = {k: v for k, v in report.get("cli", {}).items() if k.startswith("speedup")}
    print(json.dumps(dict(engine=summary, cli=cli), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
