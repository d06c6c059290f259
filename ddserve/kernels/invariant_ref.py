"""Plain-torch references (and CPU / float fallbacks) of the batch-invariant dense ops.

These are the ops `invariant.py` implements in Triton with a fixed reduction order per row; here
they are ordinary torch calls, so they are only as batch-invariant as torch's kernels are.
`split_sum_ref` is exact: the split-K matmul's combination of its fp32 partials, in its order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in x.dtype."""
    return F.linear(x, w)


def bmm_heads_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul: x [T, H, K], w [H, K, N] (any strides) -> [T, H, N]."""
    return torch.einsum("thk,hkn->thn", x, w)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32, cast back to x.dtype, then times weight (HF's order of operations)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a pairwise tree of elementwise adds, keepdim.

    The order (pad to a power of two with zeros, then add the halves) depends only on the size
    of the last dim, never on the number of rows, so every row gets the same bits alone or in a
    batch; log2(n) elementwise launches."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))  # [..., width]
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x  # [..., 1]


def split_sum_ref(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partials [S, ...] fp32 -> partials[0] + partials[1] + ... added in that order in fp32,
    rounded once to `dtype`: how the split-K matmul combines its K ranges (`invariant._mm_kernel`
    in-kernel, `invariant._sum_splits_kernel` as a second launch)."""
    acc = partials[0].clone()
    for p in partials[1:]:
        acc += p
    return acc.to(dtype)


def combine_ref(pairs: torch.Tensor, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """[M * k, N] -> [M, N] in dtype: each row's k pair rows (fp32 or bf16) summed in slot order
    in fp32, from 0, rounded once: the MoE's top-k combine (`moe_reduce._combine_kernel`, the
    end of `moe_ref`) and the `add_topk` epilogue of `invariant.linear`."""
    rows = pairs.view(-1, topk, pairs.shape[-1]).float()  # [M, k, N]
    acc = torch.zeros_like(rows[:, 0])
    for j in range(topk):
        acc = acc + rows[:, j]
    return acc.to(dtype)
