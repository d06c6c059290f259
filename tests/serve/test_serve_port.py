"""`ddserve serve` and its HTTP port: a port it cannot listen on is refused before Ray starts,
and the port is confirmed to accept connections before it claims to serve."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
from ports import free_port
from serve_proc import ROOT, ddserve_cmd, ddserve_env

from ddserve.serve.main import wait_listening
from ddserve.serve.preflight import DeploymentError, check_port


def listener(port: int, reuse_addr: bool = False, reuse_port: bool = False) -> socket.socket:
    s = socket.socket()
    if reuse_addr:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_serve_on_a_port_in_use_exits_before_starting_ray():
    port = free_port()
    with listener(port):
        t0 = time.monotonic()
        cmd = [*ddserve_cmd(), "serve", "--port", str(port)]
        run = subprocess.run(cmd, env=ddserve_env(), cwd=ROOT, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        seconds = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert (f"ddserve: error: cannot listen on 127.0.0.1:{port}: Address already in use "
            "(another process is using it? choose another --port)") in run.stderr  # fmt: skip
    assert "starting a private local Ray" not in out and "serving on" not in out
    assert seconds < 30, seconds  # the preflight: no Ray, no model load


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="needs SO_REUSEPORT")
def test_a_port_shared_by_reuse_port_listeners_is_refused():
    """Serve's proxy sets SO_REUSEPORT, so it would share the port with such a listener."""
    port = free_port()
    with listener(port, reuse_port=True), pytest.raises(DeploymentError, match="in use"):
        check_port("127.0.0.1", port)


def test_the_port_of_a_stopped_server_with_connections_in_time_wait_is_accepted():
    """As a server that set SO_REUSEADDR leaves it (Serve's proxy and uvicorn set it)."""
    port = free_port()
    with listener(port, reuse_addr=True) as srv, socket.create_connection(("127.0.0.1", port)):
        conn, _ = srv.accept()
        conn.close()  # the server's side closes first: its end of the connection waits
    check_port("127.0.0.1", port)


def test_wait_listening_finds_a_listener():
    port = free_port()
    with listener(port):
        assert wait_listening("127.0.0.1", port, timeout_s=5.0)
        assert wait_listening("0.0.0.0", port, timeout_s=5.0)  # a wildcard host: on loopback


def test_wait_listening_gives_up_after_its_timeout():
    port = free_port()
    t0 = time.monotonic()
    assert not wait_listening("127.0.0.1", port, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5.0
