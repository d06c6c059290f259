"""What a local `ddserve serve` exposes: its Ray (GCS, raylet, agents, workers, the Serve
replica) and the shards' gloo rendezvous listen on loopback only, and with DDSERVE_API_KEY set
the API answers only requests that carry the key (a real server on 127.0.0.1; the sockets are
read from /proc for the server's own session, never anybody else's Ray)."""

from __future__ import annotations

import argparse
import secrets

import httpx
import listen_sockets
import pytest
from serve_proc import ddserve_env, session_pids, start_server

from ddserve.cli import build_parser
from ddserve.serve.main import API_KEY_ENV, api_key, config_from_args

STARTUP_S = 240  # `serving on` on the busy 2-core machine (~35 s idle)
KEY = f"sk-test-{secrets.token_hex(12)}"


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_the_serve_config_carries_the_key_variable_name_not_the_key() -> None:
    cfg = config_from_args(_serve_args("--api-key", KEY), KEY)
    assert cfg["api_key_env"] == API_KEY_ENV
    assert KEY not in repr(cfg)
    assert "api_key_env" not in config_from_args(_serve_args(), None)


def test_the_api_key_defaults_to_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert api_key(_serve_args()) == KEY
    assert api_key(_serve_args("--api-key", "other")) == "other"  # the flag wins
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key(_serve_args()) is None  # empty variable: no key


def test_an_empty_api_key_flag_is_an_error() -> None:
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_key(_serve_args("--api-key", " "))


def test_the_worker_hook_moves_every_interface_binds_to_the_node_address(monkeypatch) -> None:
    import ray
    from ray._common import tls_utils

    from ddserve.serve import raybind

    bound = []
    monkeypatch.setattr(tls_utils, "add_port_to_grpc_server", lambda s, a: bound.append(a) or 7)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    raybind.bind_replica_grpc()
    raybind.bind_replica_grpc()  # a second run does not wrap twice
    add = tls_utils.add_port_to_grpc_server
    assert add(None, "[::]:0") == 7 and add(None, "127.0.0.1:5") == 7
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "fd00::2")
    add(None, "[::]:9")
    assert bound == ["10.1.2.3:0", "127.0.0.1:5", "[fd00::2]:9"]


@pytest.fixture(scope="module")
def server():
    """`ddserve serve` with DDSERVE_API_KEY in its environment, in its own session: (url,
    session id, output lines, key)."""
    try:
        srv = start_server(env=ddserve_env(**{API_KEY_ENV: KEY}), startup_s=STARTUP_S)
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield srv.url, srv.proc.pid, srv.lines, KEY
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.skipif(not listen_sockets.available(), reason="needs Linux /proc")
def test_local_ray_and_gloo_listen_on_loopback_only(server) -> None:
    url, sid, _, _ = server
    pids = session_pids(sid)
    found = listen_sockets.listening(pids)
    names = {pid: listen_sockets.process_name(pid) for pid in found}
    assert {"gcs_server", "raylet"} <= set(names.values()), names  # the reader sees Ray
    assert sum(n.startswith("ray::ShardWorke") for n in names.values()) == 2, names  # tp=2
    port = int(url.rsplit(":", 1)[1])
    assert any(("127.0.0.1", port) in socks for socks in found.values()), found  # HTTP
    exposed = {f"{names[pid]} ({pid})": socks for pid, socks in found.items()
               if any(not listen_sockets.is_loopback(a) for a, _ in socks)}  # fmt: skip
    assert exposed == {}


@pytest.mark.slow
def test_without_the_key_the_api_answers_401_in_openai_shape(server) -> None:
    url, _, _, key = server
    body = {"model": "ddserve-code-21m", "prompt": "def", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert set(r.json()["error"]) >= {"message", "type"}, r.text
    assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401


@pytest.mark.slow
def test_with_the_key_the_api_answers_and_health_is_open(server) -> None:
    url, _, _, key = server
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "ddserve-code-21m", "prompt": "def", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/v1/models", headers=auth, timeout=60).status_code == 200
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200


@pytest.mark.slow
def test_the_key_is_never_printed(server) -> None:
    _, _, lines, key = server
    text = "".join(lines)  # the CLI's output, Serve's and the replica's logs forwarded to it
    assert "API key required" in text
    assert key not in text
