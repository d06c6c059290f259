"""Tensor parallelism for the offline API on one host: rank 0 in this process, ranks 1..tp-1 in
spawned worker processes. Each worker holds its own ModelRunner and applies the same scheduler
Commands as rank 0, in order (`command.apply_command`); the model's collectives keep the ranks
in lockstep: gloo on CPU, CuPy NCCL on GPUs (rank r
on cuda:r, the NCCL id made here and handed to the workers)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import traceback
from typing import Any

from ddserve.distributed import Communicator, GlooComm, gloo_listener
from ddserve.engine.command import Command, CommandResult, apply_command
from ddserve.engine.runner import default_device

log = logging.getLogger(__name__)


def _is_cuda(runner_kwargs: dict) -> bool:
    return str(runner_kwargs.get("device") or default_device()).startswith("cuda")


def _connect(
    rank: int,
    world: int,
    init: str | bytes,
    runner_kwargs: dict,
    listener: socket.socket | None = None,
) -> Communicator:
    """This rank's communicator; on GPUs it also pins the rank to cuda:rank. `listener`: rank
    0's gloo rendezvous socket."""
    if isinstance(init, bytes):
        import torch

        from ddserve.distributed import NcclComm

        torch.cuda.set_device(rank)
        runner_kwargs["device"] = f"cuda:{rank}"
        return NcclComm(rank, world, init)
    return GlooComm(rank, world, init, listener)


def _worker(rank: int, world: int, init: str | bytes, runner_kwargs: dict, inbox: Any) -> None:
    from ddserve.engine.runner import ModelRunner

    comm = _connect(rank, world, init, runner_kwargs)
    try:
        runner = ModelRunner(comm=comm, **runner_kwargs)
        while (cmd := inbox.get()) is not None:  # None: close
            apply_command(runner, cmd)
        runner.close()  # graphs go before the communicator (NCCL waits for them)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        comm.close()


class TPGroup:
    """Starts the workers; `run` fans every Command out to them before applying it locally."""

    def __init__(self, tp: int, runner_kwargs: dict) -> None:
        from ddserve.engine.runner import ModelRunner

        if _is_cuda(runner_kwargs):
            import torch

            from ddserve.distributed import NcclComm

            if tp > torch.cuda.device_count():  # a worker without a GPU leaves rank 0 in NCCL init
                raise ValueError(f"tp={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
            init: str | bytes = NcclComm.make_unique_id()
            listener = None
        else:  # gloo between processes of this host: loopback only
            listener, init = gloo_listener("127.0.0.1")
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(1, tp)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, tp, init, runner_kwargs, q), daemon=True)
            for r, q in zip(range(1, tp), self._inboxes, strict=True)
        ]
        for p in self._procs:
            p.start()
        runner_kwargs = dict(runner_kwargs)
        self.comm: Communicator = _connect(0, tp, init, runner_kwargs, listener)
        self.runner = ModelRunner(comm=self.comm, **runner_kwargs)

    def run(self, cmd: Command) -> CommandResult:
        for q in self._inboxes:
            q.put(cmd)
        return apply_command(self.runner, cmd)

    def close(self) -> None:
        self.runner.close()
        for q in self._inboxes:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.comm.close()
