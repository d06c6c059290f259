"""`python -m loadtest.run`: load-test an OpenAI-compatible server (e.g. `ddserve serve`).

Bounded by construction: requests go only to --url (a loopback host unless --allow-remote),
each run sends at most --num-prompts requests (<= MAX_REQUESTS) and is cut off after --duration
seconds (<= MAX_DURATION_S), so an invocation ends by itself within
(warm-up + number of load points) x --duration. Optional dependencies a flag needs are checked
before any request is sent. Prompt lengths count the served model's tokens (loadtest/tokens.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib
import ipaddress
import sys
from urllib.parse import urlsplit

import httpx

from loadtest import datasets
from loadtest.calibrate import load_encoder, measure_counter
from loadtest.client import Target, resolve_model, send_request
from loadtest.driver import LoadShape, run_load
from loadtest.metrics import compute_metrics, request_records
from loadtest.prom import scrape, server_delta
from loadtest.report import format_summary, plot_sweep, write_json
from loadtest.tokens import Encode, TokenCounter

MAX_REQUESTS = 10_000
MAX_DURATION_S = 3600.0
MAX_CONCURRENCY = 1024
MAX_SWEEP_POINTS = 16
INSTALL_EXTRA = 'pip install -e ".[loadtest]"'
# Flag (argparse dest) -> the module it imports that ddserve's own dependencies do not bring.
OPTIONAL_DEPS: dict[str, str] = {"plot": "matplotlib"}


def check_url(url: str, allow_remote: bool) -> str:
    """The base URL without a trailing slash; refuses non-loopback hosts unless allowed."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not allow_remote:
        raise ValueError(f"refusing non-loopback host {host!r}; pass --allow-remote to load it")
    return url.rstrip("/")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,5,10,16: {text!r}") from e
    if (
        not values
        or len(values) > MAX_SWEEP_POINTS
        or not all(1 <= v <= MAX_CONCURRENCY for v in values)
    ):
        raise argparse.ArgumentTypeError(
            f"1..{MAX_SWEEP_POINTS} concurrencies, each in 1..{MAX_CONCURRENCY}: {text!r}"
        )
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load-test an OpenAI-compatible streaming endpoint and report TTFT, TPOT, "
        "ITL, E2E latency and throughput as vLLM/SGLang serving benchmarks define them, plus the "
        "server's mean accepted tokens per step (from /metrics).",
        epilog="Example: python -m loadtest --url http://127.0.0.1:8000 --sweep 1,2,5,10,16 "
        "--num-prompts 64 --ignore-eos --out results/sweep.json --plot results/sweep.png",
    )
    g = p.add_argument_group("target")
    g.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)"
    )
    g.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    g.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default %(default)s)",
    )
    g.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url host")
    g = p.add_argument_group("load")
    g.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="closed loop: requests in flight; "
        "with --request-rate: the cap on requests in flight (default %(default)s)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals per second (default: closed loop)",
    )
    g.add_argument(
        "--sweep",
        type=_int_list,
        default=None,
        help="comma-separated concurrencies, one run each (overrides --concurrency)",
    )
    g.add_argument(
        "--num-prompts", type=int, default=64, help="requests per run (default %(default)s)"
    )
    g.add_argument(
        "--duration",
        type=float,
        default=300.0,
        help="hard bound per run in seconds; requests still running are cancelled",
    )
    g.add_argument("--warmup", type=int, default=0, help="warm-up requests before measuring")
    g.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    g = p.add_argument_group("requests")
    g.add_argument(
        "--dataset",
        choices=("random", "jsonl", "sharegpt"),
        default="random",
        help="prompt source (default %(default)s): random words, a JSONL file of "
        '{"prompt", "max_tokens"} rows, or a ShareGPT JSON file',
    )
    g.add_argument("--dataset-path", default=None, help="file for --dataset jsonl/sharegpt")
    g.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="random prompt length in the served model's tokens, as usage.prompt_tokens counts "
        "them (default %(default)s)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the served checkpoint's directory: count prompt tokens with its tokenizer "
        "(default: fit the count to probe requests' usage.prompt_tokens)",
    )
    g.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths uniform in [len*(1-r), len*(1+r)], r in [0, 1)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="write the JSON result here")
    g.add_argument("--plot", default=None, help="write a PNG of the sweep here")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return p


def validate(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    try:
        args.url = check_url(args.url, args.allow_remote)
    except ValueError as e:
        p.error(str(e))
    if not 1 <= args.num_prompts <= MAX_REQUESTS:
        p.error(f"--num-prompts must be in 1..{MAX_REQUESTS}")
    if not 0 <= args.warmup <= MAX_REQUESTS:
        p.error(f"--warmup must be in 0..{MAX_REQUESTS}")
    if not 0 < args.duration <= MAX_DURATION_S:
        p.error(f"--duration must be in (0, {MAX_DURATION_S:.0f}] seconds")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        p.error(f"--concurrency must be in 1..{MAX_CONCURRENCY}")
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    if args.dataset != "random" and not args.dataset_path:
        p.error(f"--dataset {args.dataset} needs --dataset-path")
    if not 0 <= args.range_ratio < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--input-len/--output-len must be >= 1 and --range-ratio in [0, 1)")


def missing_dependency(args: argparse.Namespace) -> str | None:
    """A one-line message for the first optional module a given flag needs but cannot import."""
    for dest, module in OPTIONAL_DEPS.items():
        if getattr(args, dest, None):
            try:
                importlib.import_module(module)
            except ImportError:
                flag = "--" + dest.replace("_", "-")
                return f"{flag} needs {module}, which is not installed: {INSTALL_EXTRA}"
    return None


def load_prompts(
    args: argparse.Namespace, num: int, seed: int, counter: TokenCounter
) -> list[datasets.Prompt]:
    if args.dataset == "jsonl":
        pool = datasets.jsonl_prompts(args.dataset_path, args.output_len, counter)
        return datasets.take(pool, num, seed)
    if args.dataset == "sharegpt":
        pool = datasets.sharegpt_prompts(args.dataset_path, args.output_len, counter)
        return datasets.take(pool, num, seed)
    return datasets.random_prompts(
        num, args.input_len, args.output_len, args.range_ratio, seed, counter
    )


async def run_point(
    client: httpx.AsyncClient, target: Target, prompts: list, shape: LoadShape, progress: bool
) -> dict:
    """One measured run: scrape /metrics, send the prompts under `shape`, scrape again."""
    from tqdm import tqdm

    before = await scrape(client, target.base_url)
    with tqdm(
        total=len(prompts),
        desc=f"c={shape.concurrency}",
        disable=not progress,
        unit="req",
        file=sys.stderr,
    ) as bar:
        outcome = await run_load(
            lambda pr: send_request(client, target, pr),
            prompts,
            shape,
            on_done=lambda r: bar.update(1),
        )
    after = await scrape(client, target.base_url)
    duration = max(outcome.duration_s, 1e-9)
    return {
        "concurrency": shape.concurrency,
        "request_rate": shape.request_rate,
        "num_prompts": len(prompts),
        "cancelled": outcome.cancelled,
        "timed_out": outcome.timed_out,
        **compute_metrics(outcome.results, duration),
        "server": server_delta(before, after),
        "requests": request_records(outcome.results, outcome.t0),
    }


async def run_all(args: argparse.Namespace, encode: Encode | None = None) -> dict:
    concurrencies = args.sweep or [args.concurrency]
    timeout = httpx.Timeout(args.duration, connect=min(10.0, args.duration))
    limits = httpx.Limits(max_connections=max(concurrencies) + 2)
    progress = not args.no_progress
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, trust_env=False, follow_redirects=False
    ) as client:
        model = args.model or await resolve_model(client, args.url)
        target = Target(args.url, model, args.endpoint, args.ignore_eos, args.temperature)
        counter = await measure_counter(client, target, encode, args.tokenizer)
        print(f"prompt tokens: {counter.source}", flush=True)
        prompts = load_prompts(args, args.num_prompts, args.seed, counter)
        if args.warmup:
            warm = load_prompts(args, args.warmup, args.seed + 1, counter)
            shape = LoadShape(concurrencies[0], args.duration)
            outcome = await run_load(lambda pr: send_request(client, target, pr), warm, shape)
            failed = sum(not r.success for r in outcome.results)
            print(f"warm-up: {len(outcome.results) - failed} ok, {failed} failed", flush=True)
        runs = []
        for c in concurrencies:
            shape = LoadShape(c, args.duration, args.request_rate, args.seed)
            run = await run_point(client, target, prompts, shape, progress)
            print(format_summary(run), flush=True)
            runs.append(run)
    config = {k: v for k, v in vars(args).items() if k not in ("no_progress",)}
    config.update(model=model, concurrencies=concurrencies, prompt_tokens=counter.describe())
    return {
        "tool": "ddserve loadtest",
        "time": dt.datetime.now(dt.timezone.utc).isoformat(),
        "config": config,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the load test; exit status 1 if any request failed, 2 if it could not start, else 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args, parser)
    problem = missing_dependency(args)
    if problem:
        print(f"loadtest: {problem}", file=sys.stderr)
        return 2
    encode = None
    if args.tokenizer:
        try:
            encode = load_encoder(args.tokenizer)
        except Exception as e:  # any unreadable tokenizer: one line, before any request
            print(f"loadtest: --tokenizer {args.tokenizer}: {e}", file=sys.stderr)
            return 2
    try:
        result = asyncio.run(run_all(args, encode))
    except (httpx.HTTPError, RuntimeError) as e:  # server unreachable or lists no model
        print(
            f"loadtest: cannot start against {args.url}: {type(e).__name__}: {e}", file=sys.stderr
        )
        return 2
    if args.out:
        print(f"JSON result: {write_json(result, args.out)}")
    if args.plot:
        title = f"{result['config']['model']} /v1/{args.endpoint}"
        print(f"plot: {plot_sweep(result['runs'], args.plot, title)}")
    return 1 if any(r["failed"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
