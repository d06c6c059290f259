"""`ddserve serve`: check the deployment, start a private local Ray (or join --address), deploy
the app with Serve, serve until Ctrl-C or SIGTERM, then stop what it started.

- An impossible deployment (missing paths, a tp that does not shard the model, resources no
  node offers, an HTTP port that cannot be listened on) exits with status 2 and one line
  `ddserve: error: <cause>` before any replica starts. A start-up that fails once Ray runs
  (Serve's HTTP proxy cannot bind the port, a replica fails, the proxy does not accept
  connections once the app runs) exits 1 with its root cause in one line.
- The port checks (a test bind before Ray starts, a TCP connect once the app runs) are made
  for a local Ray only, whose proxy listens on this machine. With --address the proxies are the
  cluster's: on its nodes, which need not include this machine, and a Serve already running
  there keeps the port it was started with.
- Without --address, Ray is a new local instance (`address="local"`: never a cluster found
  on the machine) that dies with this process: `ray.shutdown()` on a normal exit, and a
  reaper process (reaper.py) for whatever is left when this process is killed. It is a
  single-node Ray on 127.0.0.1: its GCS, raylet, object manager, agents and workers listen on
  loopback only (checked after start-up), and Ray's own token authentication stays as Ray
  defaults it. Only the HTTP port (--host, default 127.0.0.1) is meant to be reached.
- --api-key (or $DDSERVE_API_KEY) reaches the replica as the environment variable
  DDSERVE_API_KEY, and the Serve config carries only that name (`api_key_env`), so the key
  is in no config, argument list or log Ray keeps. A local Ray's processes inherit this
  process's environment; with --address the key travels in the job's runtime_env env_vars.
- SIGINT and SIGTERM raise KeyboardInterrupt wherever the main thread is: a stop while
  serving exits 0, one during start-up exits 130; a second one during the stop kills the
  local Ray at once.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any

log = logging.getLogger("ddserve.serve")

APP = "ddserve"
API_KEY_ENV = "DDSERVE_API_KEY"
LOOPBACK = "127.0.0.1"
# Ray reads this when it is imported: "0" makes a Linux Ray single-node, on 127.0.0.1 (as on
# macOS); otherwise ray.init turns a loopback _node_ip_address into the machine's address.
RAY_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# run by every worker of the job: a Serve replica's gRPC server listens on the node's address
REPLICA_BIND_HOOK = "ddserve.serve.raybind.bind_replica_grpc"
LOCAL_PLACEMENT_TIMEOUT_S = 60.0  # a private cluster has its resources at once, or never
DELETE_TIMEOUT_S = 30.0  # removing the app from a shared cluster (--address)
PROXY_LISTEN_TIMEOUT_S = 60.0  # for the HTTP proxy to accept connections once the app runs
INTERRUPTED = 130


def config_from_args(args, api_key: str | None = None) -> dict:
    """The `ddserve serve` flags as ServeConfig arguments (unset flags keep the defaults).
    With an `api_key`, only the name of the variable that will hold it goes in."""
    names = ("model", "drafter", "tp", "max_streams", "budget", "buckets", "budgets",
             "num_slots", "max_queue", "dtype", "device", "served_model_name", "seed",
             "batch_invariant", "warmup", "pipeline")  # fmt: skip
    cfg = {n: getattr(args, n, None) for n in names}
    cfg["speculative"] = not args.no_speculative
    if getattr(args, "cuda_graphs", None) is not None:
        cfg["cuda_graphs"] = args.cuda_graphs
    if not getattr(args, "address", None):
        cfg["placement_timeout_s"] = LOCAL_PLACEMENT_TIMEOUT_S
    if api_key:
        cfg["api_key_env"] = API_KEY_ENV
    return {k: v for k, v in cfg.items() if v is not None}


def api_key(args) -> str | None:
    """--api-key, else $DDSERVE_API_KEY (unset or empty: no key); an empty --api-key is an
    error rather than an open server."""
    flag = getattr(args, "api_key", None)
    if flag is not None and not flag.strip():
        raise ValueError("--api-key is empty")
    return flag or os.environ.get(API_KEY_ENV) or None


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.address:
        os.environ[RAY_SINGLE_NODE_ENV] = "0"  # before anything imports Ray
    from ddserve.serve import preflight
    from ddserve.serve.deployment import ServeConfig

    _interrupt_on(signal.SIGINT, signal.SIGTERM)
    try:
        try:  # before starting Ray: a local one would offer this machine's CPUs and GPUs
            key = api_key(args)
            config = config_from_args(args, key)
            nodes = None if args.address else [preflight.local_node()]
            ServeConfig.model_validate(config).preflight(nodes)
            if not args.address:  # a local Ray's HTTP proxy will listen on this machine
                preflight.check_port(args.host, args.port)
        except ValueError as e:
            return error(e)
        return _run(args, config, key)
    except KeyboardInterrupt:
        print("ddserve: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED


def _run(args, config: dict[str, Any], key: str | None) -> int:
    import ray
    from ray import serve

    from ddserve.serve.deployment import build_app
    from ddserve.serve.preflight import host_port

    local = not args.address
    where = host_port(args.host, args.port)
    try:
        try:
            _start_ray(args.address, key)
        except RuntimeError as e:  # a local Ray not on loopback
            return error(e)
        try:
            app = build_app(config)
        except ValueError as e:
            return error(e)
        try:  # waits for the HTTP proxy: raises if it cannot bind (the port taken since)
            serve.start(http_options={"host": args.host, "port": args.port})
        except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:  # e.g. the proxy died
            cause = root_cause(str(e)) or one_line_cause(e)
            return start_failure(f"Serve did not start on {where}: {cause}")
        try:  # returns once the replica is up (warmed up); raises once Serve gives up on it
            serve.run(app, name=APP, route_prefix="/", blocking=False)
        except RuntimeError as e:
            return start_failure(f"the replica failed to start: {deploy_failure(e)}")
        if local and not wait_listening(args.host, args.port, PROXY_LISTEN_TIMEOUT_S):
            return start_failure(f"the HTTP proxy did not start listening on {where} within "
                                 f"{PROXY_LISTEN_TIMEOUT_S:g} s")  # fmt: skip
        gcs = ray.get_runtime_context().gcs_address
        auth = ", API key required" if key else ""
        print(
            f"ddserve: serving on http://{where}/v1 (Ray at {gcs}{auth}); Ctrl-C to stop",
            flush=True,
        )
        try:
            while True:
                time.sleep(3600)  # until a signal raises KeyboardInterrupt
        except KeyboardInterrupt:
            return 0  # a requested stop of a running server
    finally:
        _stop(local)


def error(e: BaseException) -> int:
    """Print `ddserve: error: <cause>` (one line) and return the exit status 2."""
    print(f"ddserve: error: {one_line_cause(e)}", file=sys.stderr, flush=True)
    return 2


def start_failure(cause: str) -> int:
    """Print `ddserve: error: <cause>` for a start-up that failed once Ray ran; return 1."""
    print(f"ddserve: error: {cause}", file=sys.stderr, flush=True)
    return 1


def wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts TCP connections on (host, port) within `timeout_s` (polled;
    a wildcard host, 0.0.0.0 or ::, is reached on loopback)."""
    target = {"0.0.0.0": LOOPBACK, "::": "::1"}.get(host, host)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((target, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def one_line_cause(e: BaseException) -> str:
    """A pydantic validation error's messages joined on one line; else the first line."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        parts = [f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg')}" for d in errors()]
        return "; ".join(parts)
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _start_ray(address: str | None, key: str | None = None) -> None:
    """Join `address`, or start the private local Ray on loopback (RuntimeError if its node
    is on another address: Ray was imported before main() set RAY_SINGLE_NODE_ENV)."""
    import ray

    runtime_env: dict[str, Any] = {"worker_process_setup_hook": REPLICA_BIND_HOOK}
    if address:
        if key:  # the replica's environment (Ray keeps the job's runtime_env: see operations.md)
            runtime_env["env_vars"] = {API_KEY_ENV: key}
        ray.init(address=address, runtime_env=runtime_env)
        return
    from ddserve.serve import reaper

    reaper.start()  # before Ray, so it sees every process Ray starts
    os.environ.pop("RAY_ADDRESS", None)  # not for this Ray's processes either
    if key:
        os.environ[API_KEY_ENV] = key  # before Ray: its processes inherit this environment
    print("ddserve: starting a private local Ray", file=sys.stderr, flush=True)
    try:  # ray.init installs a SIGTERM handler that raises SystemExit
        ray.init(address="local", include_dashboard=False, _node_ip_address=LOOPBACK,
                 runtime_env=runtime_env)  # fmt: skip
    except (KeyboardInterrupt, SystemExit):
        # ray.shutdown() of a half-started Ray can abort: exit now. The GCS and the raylet die
        # with this process; the reaper stops the rest.
        print("ddserve: interrupted while Ray was starting", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)
    _interrupt_on(signal.SIGINT, signal.SIGTERM)
    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        raise RuntimeError(f"the local Ray started on {node_ip}, not on loopback")


def _stop(local: bool) -> None:
    """Local: shut the whole Ray instance down (a second signal kills it at once). --address:
    delete this app (bounded) and disconnect."""
    import ray

    print("ddserve: shutting down", file=sys.stderr, flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _kill_local_ray_and_exit)
    if not local and ray.is_initialized():
        _bounded(_delete_app, DELETE_TIMEOUT_S)
    ray.shutdown()


def _delete_app() -> None:
    from ray import serve

    serve.delete(APP)


def _bounded(fn, timeout_s: float) -> None:
    """Run `fn` on a daemon thread; give up waiting after `timeout_s`."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("%s did not finish within %g s; going on", fn.__name__, timeout_s)


def _interrupt_on(*sigs: signal.Signals) -> None:
    for sig in sigs:
        signal.signal(sig, _raise_interrupt)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _kill_local_ray_and_exit(signum: int, frame: object) -> None:
    from ray._private import worker

    node = worker._global_node
    if node is not None and node.head:
        node.kill_all_processes(check_alive=False, allow_graceful=False)
    os._exit(INTERRUPTED)


_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception))(?:\(\w+\))?: (.*)")


def deploy_failure(e: BaseException) -> str:
    """The root cause of a failed `serve.run`: the innermost exception line of the failed
    deployment's message (a replica's traceback), else the error's own first line."""
    try:
        from ray import serve

        app = serve.status().applications[APP]
        text = "\n".join([app.message, *(d.message for d in app.deployments.values())])
    except Exception:  # noqa: BLE001 - the status is a best effort
        text = ""
    return root_cause(text) or one_line_cause(e)


def root_cause(text: str) -> str | None:
    """`Type: message` of the last exception line in a traceback text (Serve's wrapping
    `RuntimeError: Traceback ...` lines skipped), or None."""
    found = None
    for line in text.splitlines():
        m = _EXC_LINE.match(re.sub(r"\x1b\[[0-9;]*m", "", line).strip())
        if m and not m[2].startswith("Traceback"):
            found = f"{m[1]}: {m[2]}"
    return found
