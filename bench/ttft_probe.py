"""Where a served request's time to first token goes, level by level, on one machine.

    python bench/ttft_probe.py --out ttft.json                 # the embedded pair, tp = 1
    python bench/ttft_probe.py --device cpu --prompts 8        # a smaller CPU run

The same held-out prompts (`heldout_prompts.json`, greedy, one new token each, one request at
a time) go through three levels, each timed from the caller's side:
- engine: `LLM.generate` (the offline engine, no Ray): the prefill's compute (the target's and
  the drafter's context) and the scheduler's bookkeeping;
- router: the Router actor and its shard (the serving engine, `start_router` as `ddserve serve`
  builds it), called through `RayEngineClient.generate` from this process: adds Ray's
  streaming call, the router's queue and step loop, the compiled-graph call into the shard;
  reported as the time to the admission ack and to the first token;
- http: `ddserve serve` on the same device (a subprocess on a free port), a streaming
  /v1/completions request per prompt (httpx): adds Ray Serve's proxy and replica, tokenization
  and detokenization, SSE.
On CUDA the engine level also profiles one request (after its timing): the number of GPU kernels
it launched and their summed time against its wall time; far less kernel time than wall time
means the eager prefill is bound by launching its kernels.
Each level runs --warmup requests first. Medians in ms, and each level's excess over the one
below it, are printed and written to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from serve_proc import ddserve_env, start_server  # noqa: E402

from ddserve import LLM, SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def prompts(n: int) -> list[str]:
    rows = json.loads((ROOT / "bench" / "heldout_prompts.json").read_text())["prompts"]
    return [r["prompt"] for r in rows[:n]]


def median_ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 2)


def engine_level(texts: list[str], device: str, warmup: int, model: str | None) -> dict:
    drafter = str(Path(model) / "drafter") if model else None  # the embedded pair's: its own
    with LLM(model, drafter=drafter, device=device) as llm:
        ids = [llm.encode(t) for t in texts]
        for p in ids[:warmup]:
            llm.generate(p, ONE)
        times = []
        for p in ids:
            t0 = time.perf_counter()
            llm.generate(p, ONE)
            times.append(time.perf_counter() - t0)
        res = {"first_token_ms": median_ms(times), "n": len(times), "ids": ids}
        if device == "cuda":  # after the timing: a profiler session slows later launches
            res["kernels"] = kernel_time(llm, ids[len(ids) // 2])
    return res


def kernel_time(llm: LLM, prompt: list[int]) -> dict:
    """One request under the torch profiler: its GPU kernels' count and summed duration against
    its wall time, to tell a launch-bound (eager) prefill from a compute-bound one."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompt, ONE)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3  # us -> ms
    return {"prompt_tokens": len(prompt), "kernels": len(kernels),
            "kernel_ms": round(busy, 2), "wall_ms_profiled": round(1e3 * wall, 2)}  # fmt: skip


async def router_level(ids: list[list[int]], device: str, warmup: int, model: str | None) -> dict:
    import ray

    from ddserve.actors.remote import start_router
    from ddserve.serve.deployment import ServeConfig

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        cfg, _ = ServeConfig(tp=1, device=device, model=model).resolve()
        group = await start_router(cfg)
        try:
            acks, firsts = [], []
            for i, p in enumerate([*ids[:warmup], *ids]):
                t0 = time.perf_counter()
                gen = group.client.generate(f"probe-{i}", p, ONE)
                await anext(gen)  # the empty ack: queued
                t_ack = time.perf_counter()
                async for delta in gen:
                    if delta.token_ids:
                        break
                else:
                    raise RuntimeError(f"request {i} ended without a token")
                t_first = time.perf_counter()
                await gen.aclose()
                if i >= warmup:
                    acks.append(t_ack - t0)
                    firsts.append(t_first - t0)
        finally:
            await group.release()
    finally:
        ray.shutdown()
    return {"ack_ms": median_ms(acks), "first_token_ms": median_ms(firsts), "n": len(firsts)}


def http_level(
    texts: list[str], device: str, warmup: int, start_s: float, model: str | None
) -> dict:
    import httpx

    extra = ["--tp", "1", "--device", device, *(["--model", model] if model else [])]
    server = start_server(extra, env=ddserve_env(RAY_AUTH_MODE="disabled"), startup_s=start_s)
    try:
        with httpx.Client(timeout=60.0) as client:
            times = []
            for i, text in enumerate([*texts[:warmup], *texts]):
                body = {"prompt": text, "max_tokens": 1, "temperature": 0, "stream": True}
                t0 = time.perf_counter()
                first = None
                with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if line.startswith("data: {") and '"error"' in line:
                            raise RuntimeError(f"request {i}: {line}")
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter()
                if first is None:
                    raise RuntimeError(f"request {i}: no token came back")
                if i >= warmup:
                    times.append(first - t0)
    finally:
        server.stop()
    return {"first_token_ms": median_ms(times), "n": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", help="checkpoint dir with a drafter/ (default: the embedded pair)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts timed per level")
    ap.add_argument("--warmup", type=int, default=3, help="untimed requests first, per level")
    ap.add_argument("--levels", default="engine,router,http", help="comma list of the levels")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for serve to start")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args()
    levels = args.levels.split(",")
    if not levels or set(levels) - {"engine", "router", "http"}:
        ap.error(f"--levels: a comma list of engine, router, http, not {args.levels!r}")
    texts = prompts(args.prompts)
    res: dict = {"device": args.device, "model": args.model or "embedded",
                 "prompts": len(texts), "warmup": args.warmup}  # fmt: skip
    eng = engine_level(texts, args.device, args.warmup, args.model)  # also the prompts' token ids
    ids = eng.pop("ids")
    res["prompt_tokens_median"] = statistics.median(len(p) for p in ids)
    if "engine" in levels:
        res["engine"] = eng
        print(f"engine: first token {eng['first_token_ms']} ms", flush=True)
        if "kernels" in eng:
            print(f"engine, one request profiled: {eng['kernels']}", flush=True)
    if "router" in levels:
        res["router"] = asyncio.run(router_level(ids, args.device, args.warmup, args.model))
        r = res["router"]
        print(f"router: ack {r['ack_ms']} ms, first token {r['first_token_ms']} ms", flush=True)
    if "http" in levels:
        res["http"] = http_level(texts, args.device, args.warmup, args.start_timeout, args.model)
        print(f"http: first token {res['http']['first_token_ms']} ms", flush=True)
    order = [lv for lv in ("engine", "router", "http") if lv in res]
    for below, above in itertools.pairwise(order):
        res[f"{above}_over_{below}_ms"] = round(
            res[above]["first_token_ms"] - res[below]["first_token_ms"], 2
        )
    print(json.dumps({k: v for k, v in res.items() if k.endswith("_ms")}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
