"""Tensor-parallel communicators: one small interface, three backends.

`LocalComm` (tp = 1, no-ops), `GlooComm` (torch.distributed gloo, CPU: tests and CI) and
`NcclComm` (CuPy NCCL on GPUs). Parallel layers call these inside their `forward`; model code
never sees ranks.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from datetime import timedelta
from urllib.parse import urlsplit

import torch


class Communicator(ABC):
    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over ranks in place; returns `t`."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's `t` (same shape on all ranks) along `dim`, rank order."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `t` in place with rank `src`'s `t`; returns `t`."""

    @abstractmethod
    def barrier(self) -> None: ...

    def all_reduce_ordered(self, t: torch.Tensor) -> torch.Tensor:
        """`all_reduce` with the sum taken in rank order, so each element's bits do not depend on
        the message size (NCCL's ring / tree chunking does; with two ranks a + b == b + a, so
        the plain all-reduce is already exact). In place; returns `t`."""
        if self.world_size <= 2:
            return self.all_reduce(t)
        parts = self.all_gather(t.unsqueeze(0), dim=0)  # [W, ...] rank order
        acc = parts[0]
        for r in range(1, self.world_size):
            acc = acc + parts[r]
        return t.copy_(acc)

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class LocalComm(Communicator):
    """A single rank: every collective is the identity."""

    rank, world_size = 0, 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass


def gloo_listener(host: str) -> tuple[socket.socket, str]:
    """A socket listening on `host` at a port the kernel picks, and the `init_method` naming it:
    rank 0 passes both to GlooComm, the other ranks the `init_method` only."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family)
    netloc = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"tcp://{netloc}:{sock.getsockname()[1]}"


def _local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (`host` itself when it is local): where
    this rank's gloo connections listen. Ranks on other nodes than rank 0 (a CPU placement group
    may spread them) must not use rank 0's address, which no interface of theirs has."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


class GlooComm(Communicator):
    """gloo over TCP on CPU tensors; one process per rank, rank 0 on the host named by
    `init_method` ("tcp://HOST:PORT"). Nothing it opens listens on every interface: rank 0's
    rendezvous store on `listener` (from `gloo_listener`; else it binds HOST:PORT itself), and
    each rank's gloo connections (on its own address towards HOST, HOST itself on rank 0's
    node). torch's own `tcp://` rendezvous would listen on every interface, and gloo's on the
    address the machine's hostname resolves to."""

    def __init__(
        self, rank: int, world_size: int, init_method: str, listener: socket.socket | None = None
    ) -> None:
        from torch.distributed import ProcessGroupGloo, TCPStore

        url = urlsplit(init_method)
        host, port = url.hostname, url.port
        fd = None
        if rank == 0:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = listener or socket.create_server((host, port), family=family)
            fd = listener.detach()  # the store's server owns (and closes) it from here
        timeout = timedelta(minutes=30)  # torch.distributed's default for gloo
        self._store = TCPStore(host, port, world_size, rank == 0, timeout, master_listen_fd=fd)
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=_local_address_towards(host))]
        opts._timeout = timeout
        self._pg = ProcessGroupGloo(self._store, rank, world_size, opts)
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype in (torch.bfloat16, torch.float16):  # sum 16-bit floats in fp32
            buf = t.float()
        else:
            buf = t if t.is_contiguous() else t.contiguous()
        self._pg.allreduce([buf]).wait()
        return t if buf is t else t.copy_(buf)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        buf = t if t.is_contiguous() else t.contiguous()
        self._pg.broadcast(buf, src).wait()
        return t if buf is t else t.copy_(buf)

    def barrier(self) -> None:
        self._pg.barrier().wait()

    def close(self) -> None:
        if self._pg is not None:
            self._pg.shutdown()
            self._pg = self._store = None


_NCCL_UNIQUE_ID_BYTES = 128


def _nccl_dtype(nccl, dtype: torch.dtype) -> int:
    table = {
        torch.float32: nccl.NCCL_FLOAT32,
        torch.float16: nccl.NCCL_FLOAT16,
        # ncclBfloat16 = 9 in nccl.h (NCCL >= 2.10); older CuPy builds lack the constant.
        torch.bfloat16: getattr(nccl, "NCCL_BFLOAT16", 9),
        torch.int32: nccl.NCCL_INT32,
        torch.int64: nccl.NCCL_INT64,
        torch.uint8: nccl.NCCL_UINT8,
    }
    if dtype not in table:
        raise TypeError(f"NcclComm: unsupported dtype {dtype}")
    return table[dtype]


class NcclComm(Communicator):
    """CuPy NCCL on the current CUDA device, ordered on torch's current stream.

    Rank 0 calls `NcclComm.make_unique_id()` and ships the bytes to every rank (e.g. through a
    Ray actor call) before all ranks construct the communicator together.
    """

    def __init__(self, rank: int, world_size: int, unique_id: bytes) -> None:
        import cupy  # lazy: CPU machines have no CuPy
        from cupy.cuda import nccl

        if len(unique_id) != _NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL unique id must be 128 bytes, got {len(unique_id)}")
        self._nccl = nccl
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device())
        with cupy.cuda.Device(self.device.index):
            try:  # CuPy >= 14 takes the id as bytes
                self._comm = nccl.NcclCommunicator(world_size, bytes(unique_id), rank)
            except TypeError:  # older CuPy: a tuple of signed chars
                uid = tuple(b - 256 if b >= 128 else b for b in unique_id)
                self._comm = nccl.NcclCommunicator(world_size, uid, rank)

    @staticmethod
    def make_unique_id() -> bytes:
        from cupy.cuda import nccl

        return bytes(b & 0xFF for b in nccl.get_unique_id())

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _check(self, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"NcclComm works on {self.device}, got a tensor on {t.device}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._check(t)
        buf = t if t.is_contiguous() else t.contiguous()
        n, ptr = self._nccl, buf.data_ptr()
        dt = _nccl_dtype(n, t.dtype)
        self._comm.allReduce(ptr, ptr, buf.numel(), dt, n.NCCL_SUM, self._stream())
        return t if buf is t else t.copy_(buf)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = t.contiguous()
        self._check(t)
        out = torch.empty((self.world_size, *t.shape), dtype=t.dtype, device=t.device)
        dt = _nccl_dtype(self._nccl, t.dtype)
        self._comm.allGather(t.data_ptr(), out.data_ptr(), t.numel(), dt, self._stream())
        return torch.cat(out.unbind(0), dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check(t)
        buf = t if t.is_contiguous() else t.contiguous()
        dt = _nccl_dtype(self._nccl, t.dtype)
        self._comm.bcast(buf.data_ptr(), buf.numel(), dt, src, self._stream())
        return t if buf is t else t.copy_(buf)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        if getattr(self, "_comm", None) is not None:
            self._comm.destroy()
            self._comm = None
