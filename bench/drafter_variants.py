"""Variants of the DFlash drafter's step work for A/B runs (`profile_drafter_step.py --variants`):
each is a context manager that changes one piece of the drafter's code for the duration and
restores it; `a+b` runs both. The package keeps what production runs; candidates and the
alternatives a GPU run rejected live here (git history keeps the rejected attention variants:
SDPA, keys padded to 8, float32 values).

- default: the code in use (on CUDA: graphed block commits, attention reading the ring in place);
- eager-commit: `commit_block` as eager `commit_many` (`DFlashDrafter.graph_commits` off);
- gathered: each layer's context rows gathered out of the ring, then `grouped_attention`
  (`DFlashDrafter.ring_attention` off), the path CPUs take;
- stacked-mlp: each layer's gate and up projections as one matmul over stacked weights
  (`stacked.share_rows`, as the target's shared expert) and SiLU-times-up as one launch
  (`backend.silu_mul`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.nn.functional as F

from ddserve.drafter import layers
from ddserve.kernels import backend
from ddserve.stacked import share_rows, stacked_rows

_MLP_FORWARD = layers.MLP.forward


def _stacked_mlp_forward(self, x):
    w = stacked_rows(self.gate_proj.weight, self.up_proj.weight)
    if w is None:
        return _MLP_FORWARD(self, x)
    return self.comm.all_reduce(self.down_proj(backend.silu_mul(F.linear(x, w))))


@contextlib.contextmanager
def _stacked_mlp(dflash) -> Iterator[None]:
    for layer in dflash.model.layers:  # the weights stay stacked after: the same values
        share_rows(layer.mlp.gate_proj, layer.mlp.up_proj)
    layers.MLP.forward = _stacked_mlp_forward
    try:
        yield
    finally:
        layers.MLP.forward = _MLP_FORWARD


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
    "stacked-mlp": _stacked_mlp,
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
