"""Helpers for tests that run `ddserve serve` as a process: its command, environment, a free
port, starting and stopping it, and the processes left in its session."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def ddserve_cmd() -> list[str]:
    exe = shutil.which("ddserve")
    return [exe] if exe else [sys.executable, "-m", "ddserve"]


def ddserve_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def session_pids(sid: int) -> list[int]:
    """Processes whose session id is `sid` (a process started with start_new_session=True has
    its own pid as session id; Ray's processes inherit it)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def session_leftovers(sid: int, timeout_s: float) -> list[int]:
    """Processes of session `sid` still there after waiting up to `timeout_s` for none."""
    deadline = time.monotonic() + timeout_s
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_session(sid: int) -> None:
    """SIGKILL to every process of session `sid`."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Server:
    """A `ddserve serve` process in a session of its own: `url`, `gcs` (its Ray's address) and
    `lines` (its output so far, still growing)."""

    def __init__(self, proc: subprocess.Popen, url: str, gcs: str, lines: list[str]) -> None:
        self.proc, self.url, self.gcs, self.lines = proc, url, gcs, lines

    def stop(self) -> None:
        """SIGINT (the server stops what it started), else SIGKILL to its whole session."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session it was started in
            self.proc.wait(10)


def start_server(
    extra: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
    startup_s: float = 300.0,
) -> Server:  # fmt: skip
    """`ddserve serve` on a free port of 127.0.0.1 in a new session (`env`: default
    `ddserve_env()`); returns once it serves, else stops it and raises RuntimeError with the
    end of its output."""
    port = free_port()
    cmd = [*ddserve_cmd(), "serve", "--port", str(port), *extra]
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    env = ddserve_env() if env is None else env
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, **out)
    lines: list[str] = []
    ready = threading.Event()  # set once it serves, or once its output ends (it exited)

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ddserve: serving on"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(startup_s) or not any(ln.startswith("ddserve: serving on") for ln in lines):
        Server(proc, "", "", lines).stop()
        raise RuntimeError("server did not start:\n" + "".join(lines[-40:]))
    gcs = re.search(r"Ray at ([\d.]+:\d+)", next(ln for ln in lines if "Ray at" in ln))[1]
    return Server(proc, f"http://127.0.0.1:{port}", gcs, lines)
