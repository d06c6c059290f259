"""Variants of the DFlash drafter's step work for A/B runs (`profile_drafter_step.py --variants`,
`bench_drafter.py --variant`): each is a context manager that swaps one piece of the drafter's
code for the duration and restores it. The package keeps what production runs; candidates
live here until a GPU run says which to adopt.

- default: the code in use;
- graph-commit: `commit_block` through its CUDA graphs (`DFlashDrafter.graph_commits`);
- sdpa: attention through torch's scaled_dot_product_attention with the boolean mask (cuDNN on
  an H200), the drafter's attention before `grouped_attention`;
- pad8: `grouped_attention` with the keys padded to a multiple of 8 (zero keys and values,
  masked), so cuBLAS can pick aligned kernels whatever the ring's capacity;
- fp32-pv: `grouped_attention` with the probabilities-times-values matmul in float32;
- stacked-mlp: each layer's gate and up projections as one matmul over stacked weights
  (`stacked.share_rows`, as the target's shared expert) and SiLU-times-up as one launch
  (`backend.silu_mul`);
- triton-ring: attention by `drafter_attn_triton.ring_attention`, which reads the context from
  the ring in place (no per-layer `index_select` of every stream's context, no concatenation):
  two launches per layer where the code in use has ~12.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.nn.functional as F

from ddserve.drafter import layers
from ddserve.drafter.cache import ContextCache
from ddserve.drafter.rope import apply_rope
from ddserve.kernels import backend
from ddserve.stacked import share_rows, stacked_rows


def sdpa_attention(q, k, v, visible):
    """torch's SDPA with GQA and the mask: q [B, Q, NH, Dh], k, v [B, KVH, K, Dh] ->
    [B, Q, NH * Dh]."""
    b, q_len = q.shape[:2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=visible[:, None], enable_gqa=True
    )
    return out.transpose(1, 2).reshape(b, q_len, -1)


def padded_attention(q, k, v, visible, multiple: int = 8):
    """`grouped_attention` over keys padded with zeros (and masked) to a multiple of `multiple`."""
    pad = -k.shape[2] % multiple
    if pad:
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
        visible = F.pad(visible, (0, pad), value=False)
    return _GROUPED(q, k, v, visible)


def fp32_pv_attention(q, k, v, visible):
    """`grouped_attention` with probabilities times values in float32."""
    return _GROUPED(q, k, v.float(), visible).to(v.dtype)


_GROUPED = layers.grouped_attention
_FORWARD = layers.DFlashAttention.forward
_LAYER = ContextCache.layer


class _Ring:
    """One layer's ring (k or v, [S, C, KVH, Dh]) and the streams' rows, ungathered."""

    def __init__(self, ring, rows) -> None:
        self.ring, self.rows = ring, rows


def _ring_layer(cache, layer: int, rows):
    return _Ring(cache.k[layer], rows), _Ring(cache.v[layer], rows)


def _ring_forward(self, x, cos, sin, ctx_k, ctx_v, visible):
    """`DFlashAttention.forward` with the context attended in the ring."""
    from drafter_attn_triton import ring_attention

    if not isinstance(ctx_k, _Ring):
        return _FORWARD(self, x, cos, sin, ctx_k, ctx_v, visible)
    b, q_len, _ = x.shape
    q = self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)
    q = apply_rope(self.q_norm(q), cos, sin)  # [B, Q, NH, Dh]
    k_blk, v_blk = self.kv(x, cos, sin)  # [B, Q, KVH, Dh]
    out = ring_attention(q, ctx_k.ring, ctx_v.ring, ctx_k.rows, k_blk, v_blk, visible)
    return self.comm.all_reduce(self.o_proj(out))


@contextlib.contextmanager
def _ring_attention() -> Iterator[None]:
    layers.DFlashAttention.forward, ContextCache.layer = _ring_forward, _ring_layer
    try:
        yield
    finally:
        layers.DFlashAttention.forward, ContextCache.layer = _FORWARD, _LAYER


@contextlib.contextmanager
def _attention(fn: Callable) -> Iterator[None]:
    layers.grouped_attention = fn
    try:
        yield
    finally:
        layers.grouped_attention = _GROUPED


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


@contextlib.contextmanager
def _graph_commits(dflash) -> Iterator[None]:
    before, dflash.graph_commits = dflash.graph_commits, True
    try:
        yield
    finally:
        dflash.graph_commits = before


VARIANTS: dict[str, Callable] = {
    "default": lambda dflash: contextlib.nullcontext(),
    "graph-commit": _graph_commits,
    "sdpa": lambda dflash: _attention(sdpa_attention),
    "pad8": lambda dflash: _attention(padded_attention),
    "fp32-pv": lambda dflash: _attention(fp32_pv_attention),
    "triton-ring": lambda dflash: _ring_attention(),
    "stacked-mlp": _stacked_mlp,
}


def variant(name: str, dflash) -> contextlib.AbstractContextManager:
    """The context manager that runs `name` on drafter `dflash` (a DFlashDrafter)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown drafter variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name](dflash)
