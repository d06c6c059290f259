"""ShardWorker: one tensor-parallel rank (a ModelRunner) in a Ray actor, driven by commands.

Every rank receives the same `Command` (planned by the Router's `Scheduler`) each iteration and
applies it with `engine.command.apply_command`, as the offline LLM's ranks do; rank 0 returns the
`CommandResult`, the others return None. The communicator is set
up through Ray: rank 0 creates the gloo address (CPU) or the NCCL unique id (GPU) and the
Router hands it to every rank (`setup`), which then build their comm and load the model together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ddserve.engine.command import Command, CommandResult, apply_command
from ddserve.engine.config import EngineConfig

__all__ = ["Command", "CommandResult", "ShardSpec", "ShardWorker"]


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """What every rank needs to build its runner (identical on all ranks): where the model is,
    how the ranks are placed, and the engine settings."""

    model_path: str
    world_size: int = 1
    drafter_path: str | None = None
    device: str = "cpu"
    engine: EngineConfig = field(default_factory=EngineConfig)


class ShardWorker:
    """Ray actor body (decorated by the Router with resources and a placement group)."""

    def __init__(self, rank: int, spec: ShardSpec) -> None:
        self.rank, self.spec = rank, spec
        self.runner = None
        self._listener = None  # rank 0 on CPU: the gloo rendezvous socket, for `setup`

    def pid(self) -> int:
        return os.getpid()

    def make_comm_id(self) -> str | bytes:
        """Rank 0 only: the rendezvous every rank passes to `setup`. On CPU a gloo address on
        this node's cluster address (loopback for the local Ray of `ddserve serve`), already
        listening, never on every interface."""
        if self.spec.world_size == 1:
            return ""
        if self.spec.device.startswith("cuda"):
            from ddserve.distributed import NcclComm

            return NcclComm.make_unique_id()
        import ray

        from ddserve.distributed import gloo_listener

        self._listener, init = gloo_listener(ray.util.get_node_ip_address())
        return init

    def setup(self, comm_id: str | bytes) -> dict:
        """Build the communicator (all ranks call this concurrently) and load the model."""
        from ddserve.distributed import GlooComm, LocalComm, NcclComm
        from ddserve.engine.runner import ModelRunner

        s = self.spec
        if s.world_size == 1:
            comm = LocalComm()
        elif isinstance(comm_id, bytes):
            comm = NcclComm(self.rank, s.world_size, comm_id)
        else:
            comm = GlooComm(self.rank, s.world_size, comm_id, self._listener)
        drafter = Path(s.drafter_path) if s.drafter_path else None
        self.runner = ModelRunner(
            s.model_path, comm=comm, engine_cfg=s.engine, drafter=drafter, device=s.device
        )
        mc = self.runner.model_cfg
        return {
            "max_position_embeddings": mc.max_position_embeddings,
            "num_slots": s.engine.num_slots,
            "vocab_size": mc.vocab_size,
            "speculative": drafter is not None,
        }

    def execute(self, cmd: Command) -> CommandResult | None:
        res = apply_command(self.runner, cmd)
        return res if self.rank == 0 else None
