"""Routed-expert weights (bf16 or compressed-tensors INT4) and the plain-torch MoE reference.

INT4 layout (compressed-tensors `pack-quantized`, symmetric, group 32), as Kimi K2 ships it:
each q in [-8, 7] is stored as q + 8, eight per int32, least significant nibble first, and
    w[r, c] = (((packed[r, c // 8] >> 4 * (c % 8)) & 0xF) - 8) * scale[r, c // 32]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddserve.kernels.invariant_ref import combine_ref

PACK = 8  # int4 values per int32
GROUP = 32  # columns per scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., C] ints in [-8, 7] -> [..., C / 8] int32, LSB-first nibbles of q + 8."""
    if q.shape[-1] % PACK:
        raise ValueError(f"last dim {q.shape[-1]} is not a multiple of {PACK}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    nib = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], -1, PACK)  # [..., C/8, 8]
    shifts = torch.arange(PACK, dtype=torch.int64, device=q.device) * 4
    words = (nib << shifts).sum(dim=-1)  # [..., C/8] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., C / 8] int32 -> [..., C] int8 in [-8, 7]."""
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.device) * 4
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., C/8, 8]
    return (nib - 8).to(torch.int8).flatten(-2)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[..., R, C/8] packed, [..., R, C/32] scales -> [..., R, C] weights."""
    q = unpack_int4(packed).to(dtype)  # [..., R, C]
    return q * scale.to(dtype).repeat_interleave(GROUP, dim=-1)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-32 quantization of [..., R, C].

    Returns (packed [..., R, C/8] int32, scale [..., R, C/32]).
    """
    g = w.float().reshape(*w.shape[:-1], -1, GROUP)  # [..., R, C/32, 32]
    scale = g.abs().amax(dim=-1).clamp_min(1e-8) / 7.0  # [..., R, C/32]
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-8, 7).flatten(-2)
    return pack_int4(q), scale.to(w.dtype)


@dataclass
class ExpertWeights:
    """All routed experts of one layer on one rank (I = this rank's share of the expert width).

    Dense: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].
    INT4:  w13_packed [E, 2I, H/8] int32, w13_scale [E, 2I, H/32], w2_packed [E, H, I/8],
           w2_scale [E, H, I/32].
    repack_in_place: the owner lets the v3 MoE kernel overwrite the INT4 tensors with its own
    stream layout (`moe_w4_repack.repack_in_place`, same sizes) instead of keeping a copy; after
    that `expert` decodes the stream and only v3 and the torch reference can read them.
    """

    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    w13_packed: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_packed: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    repack_in_place: bool = False
    # Optional float32 copies of the INT4 experts' dequantized weights (w13 [E, 2I, H], w2
    # [E, H, I], any strides) that the owner keeps on the CPU (`RoutedExperts`); the INT4 tensors
    # stay the source of truth, and `expert` reads these instead of unpacking on every call.
    w13_dequant: torch.Tensor | None = None
    w2_dequant: torch.Tensor | None = None

    @property
    def is_int4(self) -> bool:
        return self.w13_packed is not None

    @property
    def num_experts(self) -> int:
        return (self.w13_packed if self.is_int4 else self.w13).shape[0]

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) in `dtype`."""
        if self.w13_dequant is not None and self.w13_dequant.dtype == dtype:
            return self.w13_dequant[e], self.w2_dequant[e]
        if self.is_int4:
            # (imported here: moe_w4_repack imports this module's PACK and GROUP)
            from ddserve.kernels.moe_w4_repack import as_stream, decode_expert, in_place_started

            if in_place_started(self.w13_packed):  # the v3 stream, written in place
                return (
                    decode_expert(as_stream(self.w13_packed, self.w13_scale), e, dtype),
                    decode_expert(as_stream(self.w2_packed, self.w2_scale), e, dtype),
                )
            return (
                dequantize_int4(self.w13_packed[e], self.w13_scale[e], dtype),
                dequantize_int4(self.w2_packed[e], self.w2_scale[e], dtype),
            )
        return self.w13[e].to(dtype), self.w2[e].to(dtype)


def moe_ref(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float32, routed_scaling_factor already applied
    weights: ExpertWeights,
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_j topk_weights[t, j] * down(silu(gate(x_t)) * up(x_t)) over expert topk_ids[t, j].

    The T * k (token, expert) pairs are sorted by expert (stable: token order within an expert),
    so each expert is two matmuls over a contiguous run of rows (one op each: the runs and the
    experts' matrices are views made once per call) and the elementwise work is one op over all
    rows. A token's k results are summed into a zeroed row in ascending expert order, whatever
    else is in the batch."""
    compute = torch.float32
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    flat = topk_ids.reshape(-1)  # [T*k]
    order = flat.argsort(stable=True)  # [T*k] pairs grouped by expert
    counts = torch.bincount(flat, minlength=weights.num_experts).tolist()
    token = order // k  # [T*k] token of each sorted pair
    xs = x.to(compute).index_select(0, token)  # [T*k, H]
    mats = _transposed(weights, [e for e, n in enumerate(counts) if n], compute)
    gate_up = xs.new_empty(t * k, next(iter(mats.values()))[0].shape[1])  # [T*k, 2I]
    for e, (xe, ge) in enumerate(zip(xs.split(counts), gate_up.split(counts), strict=True)):
        if counts[e]:
            torch.mm(xe, mats[e][0], out=ge)  # [n, H] @ [H, 2I]
    gate, up = gate_up.chunk(2, dim=-1)  # [T*k, I] each
    act = torch.nn.functional.silu(gate) * up  # [T*k, I]
    y = torch.empty_like(xs)  # [T*k, H]
    for e, (ae, ye) in enumerate(zip(act.split(counts), y.split(counts), strict=True)):
        if counts[e]:
            torch.mm(ae, mats[e][1], out=ye)  # [n, I] @ [I, H]
    y *= topk_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(compute)
    # Back to one row per (token, slot), each token's slots in ascending expert order (the order
    # of the sorted pairs), then summed one slot at a time: a fixed order on every device, where
    # index_add_ would use atomics on CUDA.
    by_pair = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)  # [T, k, H]
    ranked = topk_ids.argsort(dim=1, stable=True)  # [T, k] slots by expert
    ys = by_pair.gather(1, ranked.unsqueeze(-1).expand_as(by_pair))  # [T, k, H]
    return combine_ref(ys.reshape(t * k, -1), k, x.dtype)


def _transposed(
    weights: ExpertWeights, used: list[int], dtype: torch.dtype
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """expert -> (w13^T [H, 2I], w2^T [I, H]) in `dtype` for the `used` experts: views of the
    dequantized copies when there are (two ops), else each expert's weights as `expert` gives."""
    if weights.w13_dequant is not None and weights.w13_dequant.dtype == dtype:
        w13 = weights.w13_dequant.transpose(1, 2).unbind(0)  # E x [H, 2I]
        w2 = weights.w2_dequant.transpose(1, 2).unbind(0)  # E x [I, H]
        return {e: (w13[e], w2[e]) for e in used}
    mats = {}
    for e in used:
        w13, w2 = weights.expert(e, dtype)
        mats[e] = (w13.t(), w2.t())
    return mats
