"""Variants of the DFlash drafter's step work for A/B runs (`profile_drafter_step.py --variants`):
each is a context manager that changes one piece of the drafter's code for the duration and
restores it; `a+b` runs both. Each turns a piece of the code in use back to the alternative it
replaced, so a run shows what each is worth (git history keeps the variants GPU runs rejected:
SDPA, keys padded to 8, float32 values, every projection through the target's matmul).

- default: the code in use (on CUDA: greedy steps commit inside the verify graph, other commits
  through graphs of their own, attention reading the ring in place);
- commit-after-step: the verify graph does not commit; the host commits after the step's copy
  (`DFlashDrafter.step_commits` off), through the commit graph unless eager-commit is on too;
- eager-commit: `commit_block` as eager `commit_many` (`DFlashDrafter.graph_commits` off; a
  greedy DDTree step's commit is inside the verify graph unless commit-after-step is on too);
- gathered: each layer's context rows gathered out of the ring, then `grouped_attention`
  (`DFlashDrafter.ring_attention` off), the path CPUs take;
- separate-mlp: each layer's gate and up projections as two matmuls and torch's SiLU and
  product, where the code in use stacks them (`DFlashModel.stack`: one matmul, one
  `backend.silu_mul`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

from ddserve.drafter import layers

VARIANTS: dict[str, Callable] = {
    "default": lambda dflash: contextlib.nullcontext(),
    "commit-after-step": lambda dflash: mock.patch.object(dflash, "step_commits", False),
    "eager-commit": lambda dflash: mock.patch.object(dflash, "graph_commits", False),
    "gathered": lambda dflash: mock.patch.object(dflash, "ring_attention", False),
    # what MLP.forward asks says "not stacked"; the model's context k/v keep their stacking
    "separate-mlp": lambda dflash: mock.patch.object(layers, "stacked_rows", lambda *ws: None),
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
