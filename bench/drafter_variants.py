"""Variants of the DFlash drafter's step work for A/B runs (`profile_drafter_step.py --variants`):
each is a context manager that changes one piece of the drafter's code for the duration and
restores it; `a+b` runs both. Most turn a piece of the code in use back to the alternative it
replaced, so a run shows what each is worth; "invariant-linear" is a candidate not yet timed
(git history keeps the attention variants a GPU run rejected: SDPA, keys padded to 8, float32
values).

- default: the code in use (on CUDA: graphed block commits, attention reading the ring in place);
- eager-commit: `commit_block` as eager `commit_many` (`DFlashDrafter.graph_commits` off);
- gathered: each layer's context rows gathered out of the ring, then `grouped_attention`
  (`DFlashDrafter.ring_attention` off), the path CPUs take;
- separate-mlp: each layer's gate and up projections as two matmuls and torch's SiLU and
  product, where the code in use stacks them (`DFlashModel.stack`: one matmul, one
  `backend.silu_mul`).
- invariant-linear (a candidate): every drafter projection through `backend.linear`, the
  target's matmul (in the engine's batch-invariant mode on CUDA the Triton kernel tuned for a
  few rows, with PDL), where the code in use calls cuBLAS (`F.linear`: split-K kernels and
  their separate reduction launches at a block's 16-160 rows).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from unittest import mock

import torch.nn.functional as F
from torch import nn

from ddserve.drafter import layers
from ddserve.drafter import model as dflash_model
from ddserve.kernels import backend


@contextlib.contextmanager
def _invariant_linear(dflash) -> Iterator[None]:
    """The drafter's nn.Linear modules and the functional matmuls of `layers` and `model` (the
    stacked MLP, the stacked context k/v) through `backend.linear`."""
    shim = types.SimpleNamespace(**{n: getattr(F, n) for n in dir(F) if not n.startswith("_")})
    shim.linear = lambda x, w: backend.linear(x, w)
    linears = [m for m in dflash.model.modules() if isinstance(m, nn.Linear)]
    for m in linears:
        m.forward = lambda x, m=m: backend.linear(x, m.weight)
    layers.F = dflash_model.F = shim
    try:
        yield
    finally:
        layers.F = dflash_model.F = F
        for m in linears:
            del m.forward  # the class's forward again


VARIANTS: dict[str, Callable] = {
    "default": lambda dflash: contextlib.nullcontext(),
    "eager-commit": lambda dflash: mock.patch.object(dflash, "graph_commits", False),
    "gathered": lambda dflash: mock.patch.object(dflash, "ring_attention", False),
    # what MLP.forward asks says "not stacked"; the model's context k/v keep their stacking
    "separate-mlp": lambda dflash: mock.patch.object(layers, "stacked_rows", lambda *ws: None),
    "invariant-linear": _invariant_linear,
}


def variant(name: str, dflash) -> contextlib.AbstractContextManager:
    """The context manager that runs `name` (variants joined by '+' run together) on drafter
    `dflash` (a DFlashDrafter)."""
    parts = name.split("+")
    for part in parts:
        if part not in VARIANTS:
            raise ValueError(f"unknown drafter variant {part!r}; known: {', '.join(VARIANTS)}")
    stack = contextlib.ExitStack()

    @contextlib.contextmanager
    def together() -> Iterator[None]:
        with stack:
            for part in parts:
                stack.enter_context(VARIANTS[part](dflash))
            yield

    return together()
