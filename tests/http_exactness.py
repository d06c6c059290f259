"""Served DDTree output == served plain decoding, under different traffic (HTTP, end to end).

Starts `ddserve serve` twice on this machine: first speculative (DDTree), with every prompt sent
at once so streams share verify batches; then `--no-speculative`, with the prompts sent one at a
time (different batches, different prefill company). Greedy completions (temperature 0,
ignore_eos) must be identical, character for character. With batch-invariant kernels this holds
in bf16 on GPUs too (tp <= 2 exactly; tp > 2 through the rank-order all-reduce). Writes JSON;
exits 1 if any completion differs. tests/serve/test_serve_e2e.py runs the same check from its
parts, with its own server as the DDTree one (CPU: tp = 2 over gloo, float32); on GPUs,
bench/serve_exactness.py runs it (`bash bench/run.sh exactness`):

    python bench/serve_exactness.py --out results/serve_exactness.json [-- <ddserve serve flags>]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from ports import free_port


def prompts(n: int) -> list[str]:
    """Deterministic prompts of varied lengths (a few to a few hundred characters)."""
    words = ["tree", "draft", "verify", "accept", "token", "latent", "expert", "router"]
    return [
        f"Prompt {i}: " + " ".join(words[(i * j) % len(words)] for j in range(3 + 11 * i % 60))
        for i in range(n)
    ]


class Server:
    """`ddserve serve` in a subprocess; ready when it prints 'serving on'."""

    def __init__(self, port: int, flags: list[str], startup_s: float) -> None:
        cmd = [sys.executable, "-m", "ddserve", "serve", "--port", str(port), *flags]
        env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        ready = threading.Event()  # set once it serves, or once its output ends (it exited)

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if "serving on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(startup_s) or not any("serving on" in ln for ln in self.lines):
            self.stop()
            tail = "".join(self.lines[-30:])
            raise RuntimeError(f"server did not start (limit {startup_s:.0f} s):\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


async def complete(client, url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                ignore_eos=True)  # fmt: skip
    r = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def run(url: str, texts: list[str], max_tokens: int, concurrent: bool) -> list[str]:
    async with httpx.AsyncClient() as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        if concurrent:
            jobs = (complete(client, url, model, p, max_tokens) for p in texts)
            return list(await asyncio.gather(*jobs))
        return [await complete(client, url, model, p, max_tokens) for p in texts]


def serve_and_run(flags: list[str], texts: list[str], max_tokens: int, concurrent: bool,
                  startup_s: float) -> list[str]:  # fmt: skip
    """`run` against a `ddserve serve <flags>` started for it on a free port, and stopped."""
    port = free_port()
    server = Server(port, flags, startup_s)
    try:
        return asyncio.run(run(f"http://127.0.0.1:{port}", texts, max_tokens, concurrent))
    finally:
        server.stop()


def first_diff(a: str, b: str) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_flags = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--prompts", type=int, default=12, help="number of prompts (12)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per completion (48)")
    ap.add_argument("--startup-s", type=float, default=300, help="server start-up limit (300)")
    args = ap.parse_args(argv)
    texts = prompts(args.prompts)
    outputs, seconds = {}, {}
    for name, flags, concurrent in (("ddtree", [], True), ("plain", ["--no-speculative"], False)):
        t0 = time.perf_counter()
        outputs[name] = serve_and_run([*serve_flags, *flags], texts, args.max_tokens, concurrent,
                                      args.startup_s)  # fmt: skip
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {len(texts)} completions in {seconds[name]:.0f} s", flush=True)
    diffs = [first_diff(a, b) for a, b in zip(outputs["ddtree"], outputs["plain"], strict=True)]
    same = sum(d is None for d in diffs)
    report = dict(
        serve_flags=serve_flags, prompts=len(texts), max_tokens=args.max_tokens,
        identical=same, first_diff_chars=[d for d in diffs if d is not None], seconds=seconds,
        outputs=outputs,
    )  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"identical: {same}/{len(texts)}", flush=True)
    return 0 if same == len(texts) else 1
