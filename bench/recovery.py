"""Time from `kill -9` of a shard or of the router to the first successful request, against
`ddserve serve` on this machine (real Ray, real HTTP on 127.0.0.1).

    python bench/recovery.py --out recovery.json      # starts `ddserve serve` (CPU default, tp=2)
    python bench/recovery.py --url http://127.0.0.1:8000 --server-pid 4242 --kill shard

Each kill (in --kill's order, --rounds times) opens a stream and reads its first text, sends
SIGKILL to a process of the server's local Ray (the Router actor's, or one ShardWorker's: the
processes under `ddserve serve` titled ray::Router / ray::ShardWorker), then records:
- in_flight: how the open stream ended (`error`: an SSE error event; `done`: it finished;
  `cut`: the connection closed without either) and when, in seconds after the kill;
- probes: a small completion every --probe-interval s, each limited to --probe-timeout s, until
  one succeeds: its status (0: no answer in time, a hang), answer time and Retry-After;
- first_success_s: from the kill to the first 200;
- after: the Router and ShardWorker processes once it serves again (a clean rebuild leaves 1
  Router and tp shards; the killed group's survivors are gone).
Before each kill it waits until a probe succeeds, then --pause seconds. A failure less than a
minute after the replica's last rebuild continues a streak, and a replica gives up after 3
rebuild attempts in a streak (RebuildPolicy), so more than 3 kills need --pause 60.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kill_probe import measure_kill, summary, wait_serving  # noqa: E402
from serve_proc import ddserve_env, start_server  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start `ddserve serve` here)")
    ap.add_argument(
        "--server-pid",
        type=int,
        help="with --url: the pid of its `ddserve serve` (its local Ray's actors)",
    )
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `ddserve serve` argument when the script starts it (repeatable)",
    )
    ap.add_argument(
        "--kill",
        action="append",
        choices=["shard", "router"],
        help="what to kill, in order (repeatable; default: shard, then router)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="times the --kill sequence runs")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds served before each kill")
    ap.add_argument("--probe-interval", type=float, default=0.25)
    ap.add_argument("--probe-timeout", type=float, default=5.0)
    ap.add_argument("--max-wait", type=float, default=300.0, help="give up on one kill after")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--server-log", type=Path, help="write the started server's output here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.url is None:
        server = start_server(args.serve_arg, env=ddserve_env(RAY_AUTH_MODE="disabled"))
        url, pid = server.url, server.proc.pid
    elif args.server_pid is None:
        raise SystemExit("--url needs --server-pid (to find the processes to kill)")
    else:
        url, pid = args.url.rstrip("/"), args.server_pid
    results = []
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for _ in range(args.rounds):
            for what in args.kill or ["shard", "router"]:
                wait_serving(url, model, args.max_wait)
                time.sleep(args.pause)
                r = measure_kill(url, model, what, pid, interval=args.probe_interval,
                                 timeout=args.probe_timeout, max_wait=args.max_wait)  # fmt: skip
                results.append(r)
                print(json.dumps(summary(r)), flush=True)
    finally:
        if server is not None:
            server.stop()
            if args.server_log:
                args.server_log.write_text("".join(server.lines))
    out = {"machine": platform.node(), "cpus": os.cpu_count(), "url": url,
           "serve_args": args.serve_arg, "load_avg_1m_end": os.getloadavg()[0],
           "results": results}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["first_success_s"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
