"""Checks that a deployment can start, run before any actor does.

`ddserve serve` and the application builder (`build_app`, which `serve run` / `serve deploy`
call) run these so an impossible deployment fails in seconds with its cause in one line,
instead of replicas failing (or waiting for resources) again and again:

- the checkpoint and drafter directories exist and hold a `config.json`;
- the model shards at the requested tp: the model is built on the meta device with a
  communicator of that size, so every divisibility rule the real load applies (heads, expert
  widths in whole INT4 groups, vocabulary, ...) is checked, and nothing is allocated;
- some node can host one replica's shards: tp GPUs on one node (STRICT_PACK), counting the
  node types an autoscaler may still launch;
- (`ddserve serve` with a local Ray) the HTTP port can be listened on (`check_port`).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from ddserve.distributed import LocalComm


class DeploymentError(ValueError):
    """The deployment cannot start; the message is one line naming the cause."""


def check_paths(model: Path, drafter: str | None) -> None:
    _check_dir(model, "model")
    if drafter is not None:
        _check_dir(Path(drafter), "drafter")


def _check_dir(path: Path, what: str) -> None:
    if not path.is_dir():
        raise DeploymentError(f"{what} directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise DeploymentError(f"{what} directory {path} has no config.json")


class _ShapeComm(LocalComm):
    """A communicator of `world_size` ranks that only answers size questions (rank 0)."""

    def __init__(self, world_size: int) -> None:
        self.rank, self.world_size = 0, world_size


def check_sharding(model: Path, tp: int) -> None:
    """Raises DeploymentError unless the checkpoint at `model` splits across `tp` ranks."""
    import torch

    from ddserve.config import ModelConfig
    from ddserve.model.deepseek import DeepseekV3ForCausalLM

    try:
        cfg = ModelConfig.from_hf(model)
    except (OSError, ValueError, KeyError) as e:
        raise DeploymentError(f"cannot read the model config in {model}: {e}") from None
    try:
        DeepseekV3ForCausalLM(cfg, _ShapeComm(tp), torch.bfloat16, "meta")
    except ValueError as e:
        raise DeploymentError(f"tp={tp} cannot shard the model in {model}: {e}") from None


def check_resources(
    device: str, tp: int, shard_cpus: float, shapes: list[dict[str, float]]
) -> None:
    """Raises DeploymentError unless one of these nodes (their total resources) can host one
    replica's `tp` shards."""
    need = {"CPU": tp * shard_cpus}
    if device == "cuda":
        need["GPU"] = tp
        if not any(_fits(s, need) for s in shapes):
            most = max((s.get("GPU", 0) for s in shapes), default=0)
            raise DeploymentError(
                f"tp={tp} on cuda needs {tp} GPUs on one node, but the most any node (or node "
                f"type) offers is {most:g}"
            )
        return
    total = sum(s.get("CPU", 0) for s in shapes)
    if total < need["CPU"]:
        msg = f"tp={tp} shards need {need['CPU']:g} CPUs; the cluster has {total:g}"
        raise DeploymentError(msg)


def _fits(shape: dict[str, float], need: dict[str, float]) -> bool:
    return all(shape.get(k, 0) >= v for k, v in need.items())


# what a failed bind most likely means, by errno
_BIND_HINTS = {
    errno.EADDRINUSE: "another process is using it? choose another --port",
    errno.EADDRNOTAVAIL: "is --host an address of this machine?",
    errno.EACCES: "ports below 1024 need privileges; choose another --port",
}


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port(host: str, port: int) -> None:
    """Raises DeploymentError unless an HTTP server could listen on (host, port) now. The test
    bind sets SO_REUSEADDR as HTTP servers do (a port whose old connections linger in
    TIME_WAIT passes) but not SO_REUSEPORT, so a port anything listens on fails, even where
    Serve's proxy (which sets both) would share it with a listener that also set SO_REUSEPORT."""
    if not 1 <= port <= 65535:
        raise DeploymentError(f"--port {port} is not a TCP port (1-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as Serve's proxy chooses
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            hint = f" ({_BIND_HINTS[e.errno]})" if e.errno in _BIND_HINTS else ""
            msg = f"cannot listen on {host_port(host, port)}: {e.strerror or e}{hint}"
            raise DeploymentError(msg) from None


def local_node() -> dict[str, float]:
    """This machine's resources as a local Ray would count them (the GPUs torch can use)."""
    import torch

    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}


def node_shapes() -> list[dict[str, float]]:
    """Total resources of every alive node, plus those of every node type the autoscaler may
    launch (none without an autoscaler)."""
    import ray

    alive = [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
    return alive + list(_autoscaler_node_types())


def _autoscaler_node_types() -> Iterable[dict[str, float]]:
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: without it, only alive nodes count
        return []
    if config is None:
        return []
    groups = config.node_group_configs
    return [dict(g.resources) for g in groups if g.max_count != 0]
