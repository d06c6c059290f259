"""Variants of the DFlash drafter's step work for A/B runs (`profile_drafter_step.py --variants`):
each is a context manager that changes one piece of the drafter's code for the duration and
restores it; `a+b` runs both. Each turns a piece of the code in use back to the alternative it
replaced, so a run shows what each is worth (git history keeps the attention variants a GPU
run rejected: SDPA, keys padded to 8, float32 values).

- default: the code in use (on CUDA: graphed block commits, attention reading the ring in place);
- eager-commit: `commit_block` as eager `commit_many` (`DFlashDrafter.graph_commits` off);
- gathered: each layer's context rows gathered out of the ring, then `grouped_attention`
  (`DFlashDrafter.ring_attention` off), the path CPUs take;
- separate-mlp: each layer's gate and up projections as two matmuls and torch's SiLU and
  product, where the code in use stacks them (`DFlashModel.stack`: one matmul, one
  `backend.silu_mul`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ddserve.drafter import layers
from ddserve.stacked import stacked_rows


@contextlib.contextmanager
def _separate_mlp(dflash) -> Iterator[None]:
    layers.stacked_rows = lambda *ws: None  # what MLP.forward asks; the model's k/v keep theirs
    try:
        yield
    finally:
        layers.stacked_rows = stacked_rows


def _off(attr: str) -> Callable:
    @contextlib.contextmanager
    def off(dflash) -> Iterator[None]:
        before = getattr(dflash, attr)
        setattr(dflash, attr, False)
        try:
            yield
        finally:
            setattr(dflash, attr, before)

    return off


VARIANTS: dict[str, Callable] = {
    "default": lambda dflash: contextlib.nullcontext(),
    "eager-commit": _off("graph_commits"),
    "gathered": _off("ring_attention"),
    "separate-mlp": _separate_mlp,
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
