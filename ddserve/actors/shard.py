"""ShardWorker: one tensor-parallel rank (a ModelRunner) in a Ray actor, driven by commands.

Every rank receives the same `Command` each iteration and applies it in the same order (cancel,
admit, prefill, decode step), so the ranks' collectives pair up and their bookkeeping stays
identical; rank 0 returns the `CommandResult`, the others return None. The communicator is set
up through Ray: rank 0 creates the gloo address (CPU) or the NCCL unique id (GPU) and the
Router hands it to every rank (`setup`), which then build their comm and load the model together.
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

from ddserve.engine.config import EngineConfig
from ddserve.engine.stream import StepOutput
from ddserve.kvcache import OutOfSlots
from ddserve.sampling import SamplingParams


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """What every rank needs to build its runner (identical on all ranks): where the model is,
    how the ranks are placed, and the engine settings."""

    model_path: str
    world_size: int = 1
    drafter_path: str | None = None
    device: str = "cpu"
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass(frozen=True)
class Command:
    """One iteration of the step loop. `step` lists prefilled streams; `speculative` picks
    ddtree_step over ar_step; `bucket`/`budget` are the padded batch size and its tree budget
    (0: the empty tree, a plain step, which the budget tuner picks where drafting does not pay)."""

    cancel: tuple[Hashable, ...] = ()
    add: tuple[tuple[Hashable, list[int], SamplingParams], ...] = ()
    prefill: bool = False
    step: tuple[Hashable, ...] = ()
    speculative: bool = False
    bucket: int = 0
    budget: int = 0


@dataclass
class CommandResult:
    admitted: list[Hashable] = field(default_factory=list)
    rejected: dict[Hashable, str] = field(default_factory=dict)  # can never run: reason
    deferred: list[Hashable] = field(default_factory=list)  # out of KV slots for now: re-queue
    outputs: dict[Hashable, StepOutput] = field(default_factory=dict)
    step_s: float = 0.0  # time in the decode step
    busy_s: float = 0.0  # time in the whole command
    kv_slots_used: int = 0


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
        t0 = time.perf_counter()
        runner, res = self.runner, CommandResult()
        for sid in cmd.cancel:
            runner.cancel(sid)
        for i, (sid, prompt, params) in enumerate(cmd.add):
            try:
                runner.add_stream(sid, prompt, params)
                res.admitted.append(sid)
            except OutOfSlots as e:
                if not runner.streams:  # an empty engine cannot hold it: it never will
                    res.rejected[sid] = f"request does not fit in the KV cache: {e}"
                    continue
                res.deferred.extend(s for s, _, _ in cmd.add[i:])  # keep arrival order
                break
            except ValueError as e:
                res.rejected[sid] = str(e)
        if cmd.prefill:
            res.outputs.update(runner.prefill(max_chunks=1))
        if cmd.step:
            t1 = time.perf_counter()
            if cmd.speculative:
                res.outputs.update(runner.ddtree_step(list(cmd.step), cmd.budget))  # 0: plain step
            else:
                res.outputs.update(runner.ar_step(list(cmd.step)))
            res.step_s = time.perf_counter() - t1
        res.kv_slots_used = self.spec.engine.num_slots - runner.free_slots
        res.busy_s = time.perf_counter() - t0
        return res if self.rank == 0 else None
