"""Helpers for tests that run `ddserve serve` as a process: its command, environment, a free
port and the processes left in its session."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ddserve_cmd() -> list[str]:
    exe = shutil.which("ddserve")
    return [exe] if exe else [sys.executable, "-m", "ddserve"]


def ddserve_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
