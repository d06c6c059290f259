"""A free TCP port for a server a test starts, from a range nothing else on the machine hands out.

A port the kernel picks (bind to port 0) comes from the ephemeral range (Linux: 32768-60999,
/proc/sys/net/ipv4/ip_local_port_range), the range Ray's GCS, raylet, object manager and agents
(and torch's own sockets) draw from too: between the test choosing it and the server binding it,
one of those can take it. RANGE sits above Ray's default worker ports (10002-19999) and below the
ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE = (20000, 32000)
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_random = random.SystemRandom()  # whatever seed a test gives the random module


def free_port(host: str = "127.0.0.1", tries: int = 100) -> int:
    """A random port of RANGE (less any part of it this machine's ephemeral range covers)
    that a server could bind on `host` now."""
    low, high = RANGE
    if EPHEMERAL.exists():
        high = min(high, int(EPHEMERAL.read_text().split()[0]) - 1)
    if high < low:  # the ephemeral range covers RANGE: no better choice
        low, high = RANGE
    for _ in range(tries):
        port = _random.randint(low, high)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}-{high} on {host} after {tries} tries")
