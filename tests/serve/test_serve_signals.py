"""`ddserve serve` stops promptly on SIGTERM at any point, and leaves no process of the Ray it
started behind, even when the CLI itself is SIGKILLed (that test ends test_serve_e2e.py's
server: it needs one that serves). Each test starts the server in its own session and checks
that session (never anybody else's Ray)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
from serve_proc import ROOT, ddserve_cmd, ddserve_env, free_port, kill_session, session_leftovers

pytestmark = pytest.mark.slow

STARTUP_S = 240  # `serving on` on the busy 2-core machine (~35 s idle)
EXIT_S = 30  # the CLI's exit after a signal (measured 0.2-3.5 s)
CLEAN_S = 30  # every process of its session gone (measured 4-7 s: the reaper's grace period)


class Server:
    def __init__(self, **env: str) -> None:
        self.proc = subprocess.Popen([*ddserve_cmd(), "serve", "--port", str(free_port())],
                                     env=ddserve_env(**env), cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> None:
        with self._seen:
            ok = self._seen.wait_for(lambda: any(text in ln for ln in self.lines), timeout_s)
        assert ok, f"no {text!r} within {timeout_s} s:\n" + "".join(self.lines[-30:])

    def signal_and_wait(self, sig: int) -> tuple[int, float]:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(EXIT_S)
        return rc, time.monotonic() - t0

    def leftovers(self) -> list[int]:
        return session_leftovers(self.proc.pid, CLEAN_S)

    def kill_session(self) -> None:
        kill_session(self.proc.pid)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.kill_session()  # only if a test failed half-way


def test_sigterm_while_the_replica_starts_stops_everything() -> None:
    server = Server(RAY_ADDRESS="127.0.0.1:1")  # a stale address: ignored, Ray starts locally
    try:
        _sigterm_while_the_replica_starts(server)
    finally:
        server.kill_session()


def _sigterm_while_the_replica_starts(server: Server) -> None:
    server.wait_for("Deploying new version", STARTUP_S)  # Ray up, the replica being created
    rc, took = server.signal_and_wait(signal.SIGTERM)
    assert rc == 130 and took < EXIT_S, "".join(server.lines[-20:])
    assert server.leftovers() == []


def test_sigterm_while_ray_starts_stops_everything(server) -> None:
    server.wait_for("starting a private local Ray", STARTUP_S)
    time.sleep(1)  # inside ray.init (~7 s on the 2-core machine)
    rc, took = server.signal_and_wait(signal.SIGTERM)
    assert rc == 130 and took < EXIT_S, "".join(server.lines[-20:])
    assert server.leftovers() == []
