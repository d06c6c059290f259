"""The TCP sockets that processes listen on, read from /proc (Linux; no psutil or ss needed):
/proc/net/tcp{,6} lists every listening socket with its inode, /proc/PID/fd names the inodes
a process holds."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

LISTEN = "0A"  # the TCP state column's code for LISTEN


def available() -> bool:
    return Path("/proc/net/tcp").exists() and Path("/proc/self/fd").is_dir()


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listening() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == LISTEN:
                ip, port = f[1].split(":")
                out[int(f[9])] = (str(_address(ip)), int(port, 16))
    return out


def _inodes(pid: int) -> set[int]:
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def listening(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) pairs it listens on, for those of `pids` that listen."""
    table = _listening()
    out = {}
    for pid in pids:
        addrs = sorted(table[i] for i in _inodes(pid) if i in table)
        if addrs:
            out[pid] = addrs
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def not_loopback(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """pid -> the sockets it listens on that are reachable from outside the machine (any
    address but loopback, the wildcard 0.0.0.0 / :: included)."""
    out = {}
    for pid, addrs in listening(pids).items():
        if bad := [a for a in addrs if not is_loopback(a[0])]:
            out[pid] = bad
    return out


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
