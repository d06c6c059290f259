"""A watchdog that takes the local Ray down with `ddserve serve`, however that process ends.

Ray kills the GCS and the raylet when the driver that started them dies (PR_SET_PDEATHSIG), but
the agents the raylet started (dashboard agent, runtime-env agent) outlive a SIGKILLed driver.
`start()` spawns this module as a small process holding the read end of a pipe whose write end
only the driver holds, then marks the driver's environment with a token that every process it
starts from then on inherits. Every half second the reaper records the driver's descendants (pid
and start time, from /proc); when the pipe reports end-of-file (the driver has exited, whatever
the cause) it also takes every process whose environment carries the token, which finds those
started after its last scan whose parent has died since (reparented, they are no longer
descendants: Ray's agents when SIGTERM lands while Ray starts), and sends SIGTERM, then SIGKILL
after a grace period, to every one still alive with the same start time (the token is looked
for again before the SIGKILL). It ignores SIGINT and SIGTERM, so a Ctrl-C or a SIGTERM to the
whole process group does not stop it before it has cleaned up. Linux only (a no-op elsewhere).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

POLL_S = 0.5
GRACE_S = 3.0
TOKEN_ENV = "DDSERVE_REAPER_TOKEN"  # marks the environment of every process the driver starts
_handles: list = []  # this process's reaper and the pipe's write end, kept open until exit


def start() -> None:
    """Spawn the reaper of this process's descendants (call before starting Ray)."""
    if not Path("/proc/self/stat").exists():
        return
    r, w = os.pipe()  # not inheritable: no child of ours holds the write end
    token = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "ddserve.serve.reaper", str(os.getpid()), str(r), token]
    proc = subprocess.Popen(cmd, pass_fds=(r,), stdin=subprocess.DEVNULL)
    os.close(r)
    os.environ[TOKEN_ENV] = token  # after the reaper started: it must not carry the mark itself
    _handles.extend([proc, w])


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, start time) of a process, or None if it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def _table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(entry)) is not None:
            out[int(entry)] = st
    return out


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every descendant of `root`."""
    table, found, frontier = _table(), {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def marked(token: str) -> dict[int, int]:
    """pid -> start time of every other process whose environment (as it was exec'd) carries
    the token."""
    needle = f"{TOKEN_ENV}={token}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and (st := _stat(entry)) is not None:
            out[int(entry)] = st[1]
    return out


def _alive(procs: dict[int, int]) -> list[int]:
    return [pid for pid, t in procs.items() if (st := _stat(str(pid))) and st[1] == t]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def reap(procs: dict[int, int], token: str | None = None) -> None:
    """SIGTERM, then SIGKILL after GRACE_S, to those of `procs` still alive, and (with `token`)
    to every process marked with it, looked for again before the SIGKILL."""
    if token:
        procs = {**procs, **marked(token)}
    _signal(_alive(procs), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    if token:
        procs = {**procs, **marked(token)}  # started by a process that was still dying
    _signal(_alive(procs), signal.SIGKILL)


def watch(parent: int, fd: int, token: str | None = None) -> None:
    """Record `parent`'s descendants until `fd` reports end-of-file, then reap them and the
    processes marked with `token`."""
    seen: dict[int, int] = {}
    while True:
        seen.update(descendants(parent))
        seen.pop(os.getpid(), None)
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and not os.read(fd, 1):
            break
    reap(seen, token)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
