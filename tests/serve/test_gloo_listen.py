"""GlooComm listens only on the host its init_method names: rank 0's rendezvous store and every
rank's gloo connections (torch's own tcp:// rendezvous would listen on every interface)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import listen_sockets
import pytest
import torch

from ddserve.distributed import GlooComm, gloo_listener

pytestmark = pytest.mark.skipif(not listen_sockets.available(), reason="needs Linux /proc")


def _rank1(init: str) -> None:
    torch.set_num_threads(1)
    comm = GlooComm(1, 2, init)
    try:
        comm.all_reduce(torch.ones(4))
        comm.barrier()  # rank 0 reads the sockets of both processes here
        comm.barrier()
    finally:
        comm.close()


def _listening_while_connected(host: str) -> dict[int, list[tuple[str, int]]]:
    listener, init = gloo_listener(host)
    peer = mp.get_context("spawn").Process(target=_rank1, args=(init,), daemon=True)
    peer.start()
    comm = GlooComm(0, 2, init, listener)
    try:
        t = torch.ones(4)
        assert comm.all_reduce(t).tolist() == [2.0] * 4
        comm.barrier()
        found = listen_sockets.listening([os.getpid(), peer.pid])
        comm.barrier()
    finally:
        comm.close()
        peer.join(30)
    assert peer.exitcode == 0
    return found


def _machine_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if listen_sockets.is_loopback(ip) else ip


def test_gloo_on_loopback_listens_on_loopback_only() -> None:
    found = _listening_while_connected("127.0.0.1")
    assert found.get(os.getpid()), "rank 0's store and gloo sockets were not seen"
    addresses = {addr for socks in found.values() for addr, _ in socks}
    assert addresses == {"127.0.0.1"}, found


def test_gloo_on_a_cluster_address_listens_on_that_address_only() -> None:
    ip = _machine_address()
    if ip is None:
        pytest.skip("this machine has no non-loopback address")
    found = _listening_while_connected(ip)
    addresses = {addr for socks in found.values() for addr, _ in socks}
    assert addresses == {ip}, found  # never 0.0.0.0 / :: (every interface)


def test_a_rank_on_another_node_listens_on_its_own_address() -> None:
    """A rank's gloo device binds this machine's address towards rank 0's host, not rank 0's
    address (which a rank on another node cannot bind)."""
    from ddserve.distributed import _local_address_towards

    assert _local_address_towards("127.0.0.1") == "127.0.0.1"
    ip = _machine_address()
    if ip is None:
        pytest.skip("this machine has no non-loopback address")
    assert _local_address_towards(ip) == ip
    assert _local_address_towards("192.0.2.1") == ip  # an address no interface here has
