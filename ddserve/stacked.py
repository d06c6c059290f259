"""Weights that lie back to back in one buffer, so one matmul computes several projections of the
same input: the model's q_a + kv_a and gate + up projections, the drafter's context k/v."""

from __future__ import annotations

import torch
from torch import nn


def share_rows(*layers: nn.Module) -> None:
    """Make the layers' [N_i, K] weights views of one [sum N_i, K] buffer, back to back, so that
    one matmul can compute all of them (`stacked_rows`). Their values are kept (the old tensors
    are released), so it serves before a load, which then copies into the views in place, and
    after one. The views are not trainable."""
    ws = [m.weight for m in layers]
    kinds = {(w.shape[1:], w.dtype, w.device) for w in ws}
    if len(kinds) != 1:
        raise ValueError(f"share_rows: weights differ in width, dtype or device: {kinds}")
    buf = torch.cat([w.detach() for w in ws])  # [sum N_i, K]
    row = 0
    for m, w in zip(layers, ws, strict=True):
        m.weight = nn.Parameter(buf[row : row + w.shape[0]], requires_grad=False)
        row += w.shape[0]


def stacked_rows(*ws: torch.Tensor) -> torch.Tensor | None:
    """[sum N_i, K]: the rows of weights ws, one tensor, while they still lie back to back in one
    buffer (as `share_rows` built them); None if any was replaced since."""
    first = ws[0]
    offset, base = first.storage_offset(), first.untyped_storage().data_ptr()
    for w in ws:
        in_place = w.untyped_storage().data_ptr() == base and w.storage_offset() == offset
        if not (w.is_contiguous() and w.shape[1:] == first.shape[1:] and w.device == first.device
                and w.dtype == first.dtype and in_place):  # fmt: skip
            return None
        offset += w.numel()
    return first.as_strided((sum(w.shape[0] for w in ws), first.shape[1]), first.stride())
