"""A Ray worker setup hook: Serve replicas listen on their node's address, not on every interface.

Ray 2.60's core processes listen on the node's address (127.0.0.1 for the local Ray of
`ddserve serve`), but a Serve replica opens its inter-deployment gRPC server on `[::]:0`, every
interface (the server checks Ray's auth token when token auth is on). `ddserve serve` names
`bind_replica_grpc` as the `worker_process_setup_hook` of its job, so every worker runs it
before any actor: it wraps `add_port_to_grpc_server`, which the replica module imports from
`ray._common.tls_utils`, to put the node's address in place of `[::]`. Other addresses pass
through unchanged. If a Ray version moves that function, the hook changes nothing and
tests/serve/test_serve_security.py (every listening socket of a local server on loopback) fails.
"""

from __future__ import annotations

import sys

ANY = "[::]:"
REPLICA_MODULE = "ray.serve._private.replica"


def bind_replica_grpc() -> None:
    from ray._common import tls_utils

    add = getattr(tls_utils, "add_port_to_grpc_server", None)
    if add is None or getattr(add, "_ddserve_node_ip", False):
        return
    wrapped = _on_node_ip(add)
    tls_utils.add_port_to_grpc_server = wrapped  # for the replica module when it is imported
    if (replica := sys.modules.get(REPLICA_MODULE)) is not None:  # imported already
        replica.add_port_to_grpc_server = wrapped


def _on_node_ip(add):
    import ray

    def add_on_node_ip(server, address: str) -> int:
        if address.startswith(ANY):
            ip = ray.util.get_node_ip_address()
            host = f"[{ip}]" if ":" in ip else ip
            address = f"{host}:{address[len(ANY) :]}"
        return add(server, address)

    add_on_node_ip._ddserve_node_ip = True
    return add_on_node_ip
