"""Programmatic dependent launch (PDL): a kernel of a forward is scheduled while the one before it
is still running, and waits on the device, not in the launch queue.

A CUDA-graph replay of a K2.6 rank's decode forward is ~1,400 kernels, most of them a few
microseconds long; between two of them the GPU idles for the next kernel's launch and the ramp
of its first wave. On sm_90 and later a kernel launched with the programmatic-stream-
serialization attribute (`launch_pdl`) may start once every program of the kernel before it has
executed `griddepcontrol.launch_dependents`; its programs then block in `griddepcontrol.wait`
until that kernel has completed and its writes are visible.

The contract of every kernel launched with `launch_options` (its `PDL` constexpr calls `begin`
first): every program executes the wait before it reads or writes memory that another kernel of
the forward writes or reads, and before any early return. A kernel therefore completes only
after its predecessor has, so completion orders the whole chain and a kernel may read what any
earlier kernel wrote (and overwrite what any earlier kernel read). A program running before its
wait may overlap only its predecessor: that kernel let it be scheduled after its own wait, when
every kernel before it had completed. So before the wait a program reads only memory that no
layer of the forward writes (the attention metadata: copied in before the forward, or built by
the kernels that start it) and asks L2 for lines (`prefetch_l2`) at addresses computed from such
memory or the weights; a prefetch returns no data, so even a stale address would cost
bandwidth, never a value. It writes nothing and does not return before the wait. Kernels
launched without the attribute (torch's, NCCL's) keep plain stream order on both sides. The
arithmetic of a kernel does not change with PDL, only when it starts.

On (`KernelConfig.pdl`, default True) on CUDA devices of compute capability >= 9 outside the
Triton interpreter. DDSERVE_PDL=0 turns it off for engines (`KernelConfig.resolve`); kernels
called outside an engine follow `backend.current()`, whose default has it on (tests and
benchmarks switch it with `backend.kernel_mode`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ddserve.kernels import backend

# Under PDL, kernels that read weights or prefix keys ask L2 for their first lines before the
# wait (`prefetch_l2`), so those loads overlap the previous kernel: the kernels named here
# (benchmarks remove names to measure each).
PREFETCH = frozenset({"matmul", "router", "attention"})


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` now use PDL (the active `KernelConfig` and the
    device)."""
    if device.type != "cuda" or not backend.current().pdl or _interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel with a `PDL` constexpr: the constexpr and the
    launch attribute always agree (a PDL launch of a kernel without the wait would race)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """The first statement of a PDL kernel: wait for the previous kernel to complete, then let
    the next one be scheduled (its programs wait in turn)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (no data returned, nothing waits): for weights, before
    `begin`, so their first loads hit L2 when the wait ends."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip
