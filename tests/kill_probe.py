"""Fault injection against a running `ddserve serve` on this machine: kill -9 one of its Ray
processes (the Router actor's, or a ShardWorker's) under an open stream, then probe until it
serves again. Used by tests/serve/test_serve_e2e.py and by bench/recovery.py (the CLI that records
the figures in BENCHMARKS.md); `measure_kill`'s result is described there.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def summary(r: dict) -> dict:
    codes: dict[str, int] = {}
    for p in r["probes"]:
        codes[str(p["status"])] = codes.get(str(p["status"]), 0) + 1
    answered = [p["answer_s"] for p in r["probes"] if p["status"]]
    return {
        "kill": r["kill"],
        "in_flight": r["in_flight"],
        "first_success_s": r["first_success_s"],
        "probe_statuses": codes,
        "slowest_answer_s": max(answered, default=None),
        "retry_after": sorted({p["retry_after"] for p in r["probes"] if p["retry_after"]}),
        "after": r["after"],
    }


# ---- one kill --------------------------------------------------------------------------------
def measure_kill(url: str, model: str, what: str, server_pid: int, interval: float = 0.25,
                 timeout: float = 5.0, max_wait: float = 300.0) -> dict:  # fmt: skip
    """Kill the router or a shard of the server whose `ddserve serve` process is `server_pid`,
    under an open stream; probe until the first success."""
    wait_serving(url, model, max_wait)
    stream = OpenStream(url, model)
    stream.first_text.wait(120)
    pid = actor_pids(server_pid, "Router" if what == "router" else "ShardWorker")[-1]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    probes, first_success = [], None
    while time.monotonic() - t_kill < max_wait:
        p = probe(url, model, timeout)
        p["at_s"] = round(time.monotonic() - t_kill - p["answer_s"], 3)
        probes.append(p)
        if p["status"] == 200:
            first_success = round(time.monotonic() - t_kill, 3)
            break
        time.sleep(interval)
    stream.done.wait(30)
    end = None if stream.ended is None else round(stream.ended - t_kill, 3)
    return {"kill": what, "pid": pid, "in_flight": {"end": stream.how, "after_s": end},
            "first_success_s": first_success, "probes": probes,
            "after": live_actors(server_pid)}  # fmt: skip


def live_actors(server_pid: int, settle_s: float = 10.0) -> dict:
    """The Router and ShardWorker processes under `server_pid` (a killed group's survivors may
    take a moment to go: waits up to `settle_s` for the counts to stop changing)."""

    def now() -> dict:
        return {"routers": len(actor_pids(server_pid, "Router")),
                "shards": len(actor_pids(server_pid, "ShardWorker"))}  # fmt: skip

    deadline, seen = time.monotonic() + settle_s, now()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        seen, last = now(), seen
        if seen == last:
            break
    return seen


def actor_pids(server_pid: int, actor_class: str) -> list[int]:
    """Live processes under `server_pid` titled `ray::<actor_class>` (Ray names an actor's
    worker process after its class), ascending."""
    title = f"ray::{actor_class}"  # then `.<method>` while it runs one
    return sorted(p for p, arg0 in descendants(server_pid).items() if arg0.split(".")[0] == title)


def descendants(root: int) -> dict[int, str]:
    """pid -> first command-line word (a Ray worker's title) of every live (not zombie)
    process under `root`."""
    children: dict[int, list[int]] = {}
    argv: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            arg0 = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
            argv[int(entry)] = arg0.decode(errors="replace")
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = argv[child]
            todo.append(child)
    return out


def probe(url: str, model: str, timeout: float) -> dict:
    body = {"model": model, "prompt": "ping", "max_tokens": 2, "temperature": 0}
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
        status, retry = r.status_code, r.headers.get("retry-after")
    except httpx.HTTPError:
        status, retry = 0, None  # no answer within the timeout (or the connection failed)
    return {"status": status, "answer_s": round(time.monotonic() - t0, 3), "retry_after": retry}


def wait_serving(url: str, model: str, max_wait: float) -> None:
    deadline = time.monotonic() + max_wait
    while probe(url, model, 30)["status"] != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} is not serving")
        time.sleep(0.5)


class OpenStream:
    """A long streaming completion read on a thread: `first_text` is set once text arrived,
    `how` says how it ended (error, done, cut) and `ended` when (monotonic)."""

    def __init__(self, url: str, model: str) -> None:
        self.first_text, self.done = threading.Event(), threading.Event()
        self.how, self.ended, self.error = None, None, None
        body = {"model": model, "prompt": "doomed", "max_tokens": 1500, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        threading.Thread(target=self._read, args=(url, body), daemon=True).start()

    def _read(self, url: str, body: dict) -> None:
        how = "cut"
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith('data: {"error"'):
                        how, self.error = "error", json.loads(line[6:])["error"]
                        break
                    if line == "data: [DONE]":
                        how = "done"
                        break
                    if '"text":"' in line:
                        self.first_text.set()
        except httpx.HTTPError:
            pass
        self.how, self.ended = how, time.monotonic()
        self.first_text.set()
        self.done.set()
