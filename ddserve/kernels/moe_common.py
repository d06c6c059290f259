"""Host-side helpers shared by the MoE kernels (`moe_triton_v2`, `moe_v3`, `moe_triton`)."""

from __future__ import annotations

import torch

_SMS: dict[int, int] = {}


def num_sms(dev: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132, an H200's, elsewhere: the interpreter)."""
    if dev.type != "cuda":
        return 132
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def may_fall_back(exc: Exception) -> bool:
    """Whether a failed fast-path launch may switch the process to the fallback kernel: not for
    CUDA out-of-memory (not a compile problem; the fallback would be disabled for nothing) and not
    during CUDA-graph capture (the capture is already broken and no launch can rescue it)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
