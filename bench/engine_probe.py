"""Measuring instruments for the engine benchmark: device-agnostic clocks, the distinct-expert
recorder, the DDTree stage splitter, CUDA-graph replay of one forward, and copy bandwidth.

Every instrument works on CPU (wall clock) so the CPU test exercises the code the GPU run uses;
only `graph_replay_seconds` is CUDA-only (it returns a reason instead of a time elsewhere).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from _util import capture_graph

import ddserve.ddtree.verify as verify_mod
import ddserve.engine.runner as runner_mod
from ddserve.engine.runner import ModelRunner
from ddserve.model.moe import MoE


class Clock:
    """mark() returns a timestamp: a recorded CUDA event on CUDA, perf_counter on CPU (where work
    is synchronous). seconds(a, b) synchronizes once and returns the time between two marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class RouteRecorder:
    """Keeps every MoE layer's topk_ids of the forwards run while it is active (a list append
    per layer, no kernel), and counts distinct experts per layer per forward afterwards."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.num_experts = self.layers[0].experts.weights().num_experts if self.layers else 0
        self._ids: list[list[torch.Tensor]] = [[] for _ in self.layers]

    @contextlib.contextmanager
    def active(self) -> Iterator[RouteRecorder]:
        for i, m in enumerate(self.layers):
            m.route_hook = self._ids[i].append
        try:
            yield self
        finally:
            for m in self.layers:
                m.route_hook = None

    def clear(self) -> None:
        self._ids = [[] for _ in self.layers]

    def distinct(self) -> list[list[int]]:
        """[forward][layer] number of distinct experts among that forward's topk_ids."""
        per_layer = [[int(ids.unique().numel()) for ids in lst] for lst in self._ids]
        return [list(f) for f in zip(*per_layer, strict=True)]

    def tokens(self) -> list[int]:
        """Tokens routed in each recorded forward."""
        return [int(ids.shape[0]) for ids in self._ids[0]] if self.layers else []


def uniform_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts per layer when each token picks top_k of E uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


STAGES = ("draft", "build", "prep", "verify", "accept_commit")


@contextlib.contextmanager
def patched(obj: object, name: str, value: object) -> Iterator[None]:
    """Set obj.name = value for the block; afterwards restore exactly what was there."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _after(name: str, fn: Callable, clock: Clock, marks: list) -> Callable:
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        marks.append((name, clock.mark()))
        return out

    return wrapped


@contextlib.contextmanager
def stage_marks(runner: ModelRunner, clock: Clock, marks: list) -> Iterator[None]:
    """While active, `ddtree_step` appends (stage, timestamp) to `marks` at the end of each stage.
    Eager: the draft, the tree build, the verify-input prep (attention metadata) and the verify
    forward; with CUDA graphs: the draft and the captured verify step (tree build, forward, token
    choice, acceptance: one replay). The caller marks the step's start and end; stage times
    telescope, the last one being `accept_commit`."""
    if runner._graphs is None:
        stages = (
            (runner.drafter, "draft", "draft"),
            (verify_mod, "build_tree", "build"),
            (runner_mod, "block_meta", "prep"),
            (runner, "_forward", "verify"),
        )
    else:
        stages = ((runner.drafter, "draft", "draft"), (runner, "_verify", "verify"))
    with contextlib.ExitStack() as stack:
        for obj, name, stage in stages:
            stack.enter_context(patched(obj, name, _after(stage, getattr(obj, name), clock, marks)))
        yield


def split_seconds(clock: Clock, start, marks: list, end) -> dict[str, float]:
    """Stage durations of one instrumented step from its start, stage marks and end."""
    out, prev = {}, start
    for name, ts in [*marks, ("accept_commit", end)]:
        out[name] = out.get(name, 0.0) + clock.seconds(prev, ts)
        prev = ts
    return out


@contextlib.contextmanager
def capture_forward_inputs(runner: ModelRunner, sink: list) -> Iterator[None]:
    """While active, each engine forward's (ids, positions, meta, absorbed) is appended to sink."""
    orig = runner._forward

    def wrapped(ids, positions, meta, absorbed: bool = True):
        sink.append((ids, positions, meta, absorbed))
        return orig(ids, positions, meta, absorbed)

    with patched(runner, "_forward", wrapped):
        yield


def graph_replay_seconds(runner: ModelRunner, inputs: tuple, reps: int = 5) -> float | str:
    """Device time of one target forward with launch overhead removed: the forward captured
    into a CUDA graph (same inputs; it rewrites the same KV slots) and replayed `reps` times.
    A lower bound on what a captured engine step spends in the forward. Returns a reason
    string when it cannot be measured (not CUDA, or capture failed)."""
    if runner.device.type != "cuda":
        return "not measured: CUDA graphs need a CUDA device"
    ids, positions, meta, absorbed = inputs

    def forward():
        return runner.model(ids, positions, runner.kv.pool, meta, runner.capture, absorbed)

    try:
        graph = capture_graph(forward)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        del graph
        return start.elapsed_time(end) / 1e3 / reps
    except Exception as e:  # noqa: BLE001 - a failed capture is a result, not a crash
        torch.cuda.synchronize()
        return f"capture failed: {type(e).__name__}: {str(e)[:200]}"


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> dict[str, float]:
    """Device-to-device copy bandwidth, bytes read + written per second (~4.3 TB/s on an H200
    by this convention); the median of `reps` timed copies."""
    clock = Clock(device)
    src = torch.empty(nbytes // 4, dtype=torch.int32, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(reps):
        a = clock.mark()
        dst.copy_(src)
        times.append(clock.seconds(a, clock.mark()))
    times.sort()
    med = times[len(times) // 2]
    return {"bytes": float(nbytes), "median_s": med, "bytes_per_s": 2 * nbytes / med}
