"""One-time repack of compressed-tensors INT4 expert weights for the Gluon MoE kernel (`moe_gluon`).

The kernel streams each expert's matrix W [N, K] as tiles of BN = 16 W NREP rows x BK = 128
columns, ordered n-tile major, k-step minor; a tile is W * 32 threads x R = 8 NREP int32 words,
each thread's R words contiguous (four 16-byte loads), followed in a second tensor by the tile's
BN * 4 bf16 scales (2 NREP contiguous per thread). Which weight each nibble holds is defined by
the kernel's own tensor program (`_a_tile`, `_x_tile`, the scale split and repeat), which this
module replays on index tensors (`kernel_maps`): so the repack follows the kernel by construction,
and `tests/kernels/test_moe_w4_repack.py` checks it against a plain dequantization.

Padding: N is padded to a multiple of BN with zero-scale rows and K to a multiple of BK with
zero-scale columns (their products are exact zeros; the kernel masks x past K and rows past N).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ddserve.kernels.moe_ref import GROUP, PACK

BK = 128


@dataclass(frozen=True)
class Maps:
    """Where each word nibble and each scale slot of a tile goes (all int64, CPU)."""

    word_row: torch.Tensor  # [NW, 8] tile row of nibble n of word i
    word_col: torch.Tensor  # [NW, 8] column within the 128-column step (physical K order)
    scale_row: torch.Tensor  # [NS] tile row of scale slot j
    scale_group: torch.Tensor  # [NS] 32-column group (0..3) within the step of slot j


def _kernel_a(codes: torch.Tensor, w: int, nrep: int) -> torch.Tensor:
    """`moe_gluon._a_tile`'s joins, reshapes and permute applied to per-(word, nibble) codes."""
    kc = BK // 16
    nw = codes.shape[0]

    def nib(i: int, h: int) -> torch.Tensor:  # call i = row3 + 2 k3, half h = k0 -> nibble
        return codes[:, i + 4 * h]

    r = [
        torch.stack(
            [torch.stack([nib(0, h), nib(2, h)], -1), torch.stack([nib(1, h), nib(3, h)], -1)], -1
        )
        for h in (0, 1)
    ]  # each [NW, k3, row3]
    t = torch.stack(r, -1)  # [NW, k3, row3, k0]
    assert t.shape[0] == nw
    t = t.reshape(w, 8, 4, nrep, kc, 2, 2, 2).permute(3, 0, 6, 1, 4, 5, 2, 7)
    return t.reshape(16 * w * nrep, BK)  # [BN, BK] logical (row, k)


def _kernel_b_phys() -> torch.Tensor:
    """`moe_gluon._x_tile`: physical column (within the step) of each logical k."""
    cols = torch.arange(BK).reshape(1, 4, 8, 2, 2).permute(2, 3, 1, 4, 0).reshape(BK, 1)
    return cols[:, 0]  # [BK]


def _kernel_scales(w: int, nrep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's scale split (rows +0 / +8) and 8-fold repeat: slot index per word, per half."""
    ns = 32 * w * nrep * 2
    s = torch.arange(ns).reshape(ns // 2, 2)
    s0, s1 = s[:, 0], s[:, 1]
    return s0.repeat_interleave(8), s1.repeat_interleave(8)  # [NW] each


@lru_cache(maxsize=8)
def kernel_maps(w: int, nrep: int) -> Maps:
    nw = 32 * w * nrep * (BK // 16)
    codes = torch.arange(nw * 8).reshape(nw, 8)  # word i, nibble n -> 8 i + n
    a = _kernel_a(codes, w, nrep)  # [BN, BK] codes
    phys = _kernel_b_phys()
    word_row = torch.empty(nw * 8, dtype=torch.int64)
    word_col = torch.empty(nw * 8, dtype=torch.int64)
    rows = torch.arange(a.shape[0]).unsqueeze(1).expand_as(a)
    word_row[a.reshape(-1)] = rows.reshape(-1)
    word_col[a.reshape(-1)] = phys.unsqueeze(0).expand_as(a).reshape(-1)
    word_row, word_col = word_row.reshape(nw, 8), word_col.reshape(nw, 8)
    # scales: word i's nibbles with row3 = 0 (n in 0, 2, 4, 6) use slot s0[i], row3 = 1 slot s1[i]
    s0, s1 = _kernel_scales(w, nrep)
    ns = 32 * w * nrep * 2
    scale_row = torch.full((ns,), -1, dtype=torch.int64)
    scale_group = torch.full((ns,), -1, dtype=torch.int64)
    for slots, nibs in ((s0, [0, 2, 4, 6]), (s1, [1, 3, 5, 7])):
        r = word_row[:, nibs]  # [NW, 4]
        g = word_col[:, nibs] // GROUP
        if not (bool((r == r[:, :1]).all()) and bool((g == g[:, :1]).all())):
            raise AssertionError("a scale slot would serve two rows or groups")
        for slot, rr, gg in zip(slots.tolist(), r[:, 0].tolist(), g[:, 0].tolist(), strict=True):
            if scale_row[slot] not in (-1, rr) or scale_group[slot] not in (-1, gg):
                raise AssertionError("scale slot used with different rows or groups")
            scale_row[slot], scale_group[slot] = rr, gg
    if bool((scale_row < 0).any()):
        raise AssertionError("unused scale slot")
    return Maps(word_row, word_col, scale_row, scale_group)


@lru_cache(maxsize=16)
def _maps_on(w: int, nrep: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """`kernel_maps` on a device, copied once (the in-place repack calls `repack` per expert)."""
    m = kernel_maps(w, nrep)
    return tuple(t.to(device) for t in (m.word_row, m.word_col, m.scale_row, m.scale_group))


@dataclass
class Repacked:
    """One projection of every expert, in the kernel's tile stream."""

    words: torch.Tensor  # [E, NT * KS * NW] int32
    scales: torch.Tensor  # [E, NT * KS * NS] bf16
    n: int  # true rows (output features)
    k: int  # true columns (input features)
    w: int  # warps of the kernel this was packed for
    nrep: int

    @property
    def bn(self) -> int:
        return 16 * self.w * self.nrep

    @property
    def n_tiles(self) -> int:
        return -(-self.n // self.bn)

    @property
    def k_steps(self) -> int:
        return -(-self.k // BK)


def repack(
    packed: torch.Tensor, scale: torch.Tensor, w: int = 4, nrep: int = 2, chunk: int = 8
) -> Repacked:
    """[E, N, K/8] int32 + [E, N, K/32] scales -> the kernel's stream (on packed.device).
    Works `chunk` experts at a time (transient int64 work tensors of ~20 bytes per weight of a
    chunk, besides the result)."""
    e, n, kw = packed.shape
    k = kw * PACK
    if scale.shape != (e, n, k // GROUP):
        raise ValueError(f"scale {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
    bn = 16 * w * nrep
    nt, ks = -(-n // bn), -(-k // BK)
    dev = packed.device
    wr, wc, sr, sg = _maps_on(w, nrep, dev)  # [NW, 8] x 2, [NS] x 2
    shifts = torch.arange(PACK, device=dev, dtype=torch.int64) * 4
    words_out, scales_out = [], []
    for e0 in range(0, e, chunk):
        p = packed[e0 : e0 + chunk]
        c = p.shape[0]
        nib = ((p.unsqueeze(-1).to(torch.int64) >> shifts) & 0xF).to(torch.uint8)  # [c, N, K/8, 8]
        nib = nib.reshape(c, n, k)
        nib = torch.nn.functional.pad(nib, (0, ks * BK - k, 0, nt * bn - n), value=8)  # zeros
        sc = scale[e0 : e0 + chunk]
        sc = torch.nn.functional.pad(sc, (0, ks * 4 - k // GROUP, 0, nt * bn - n))  # zero scales
        tiles = nib.reshape(c, nt, bn, ks, BK).permute(0, 1, 3, 2, 4)  # [c, NT, KS, BN, BK]
        t = tiles[:, :, :, wr, wc].to(torch.int64)  # [c, NT, KS, NW, 8]
        word = (t << shifts).sum(-1)  # [c, NT, KS, NW]
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        words_out.append(word.reshape(c, -1))
        st = sc.reshape(c, nt, bn, ks, 4).permute(0, 1, 3, 2, 4)  # [c, NT, KS, BN, 4]
        scales_out.append(st[:, :, :, sr, sg].reshape(c, -1))  # [c, NT * KS * NS]
    return Repacked(torch.cat(words_out), torch.cat(scales_out), n, k, w, nrep)


def decode(r: Repacked, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The repacked stream back to dense [E, N, K] weights, on the stream's device."""
    maps = kernel_maps(r.w, r.nrep)
    dev = r.words.device
    e = r.words.shape[0]
    bn, nt, ks = r.bn, r.n_tiles, r.k_steps
    nw, ns = maps.word_row.shape[0], maps.scale_row.shape[0]
    wr, wc, sr, sg = _maps_on(r.w, r.nrep, dev)
    shifts = torch.arange(PACK, dtype=torch.int64, device=dev) * 4
    words = r.words.to(torch.int64).reshape(e, nt, ks, nw)
    nib = (words.unsqueeze(-1) >> shifts) & 0xF  # [E, NT, KS, NW, 8]
    q = torch.zeros(e, nt, ks, bn, BK, dtype=torch.int64, device=dev)
    q[:, :, :, wr, wc] = nib - 8
    s = torch.zeros(e, nt, ks, bn, 4, dtype=torch.float32, device=dev)
    s[:, :, :, sr, sg] = r.scales.float().reshape(e, nt, ks, ns)
    dense = q.to(torch.float32) * s.repeat_interleave(GROUP, dim=-1)  # [E, NT, KS, BN, BK]
    dense = dense.permute(0, 1, 3, 2, 4).reshape(e, nt * bn, ks * BK)
    return dense[:, : r.n, : r.k].to(dtype)


def decode_expert(r: Repacked, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert e of the stream as dense [N, K] weights."""
    one = Repacked(r.words[e : e + 1], r.scales[e : e + 1], r.n, r.k, r.w, r.nrep)
    return decode(one, dtype)[0]


# Attribute on tensors rewritten in place: (w, nrep, tensor version after the last write, experts
# done). A load into the tensor bumps its version past the mark: the tensor is plain again.
MARK = "_ddserve_v3_stream"


def _mark(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(w, nrep, experts done) of a current mark, else None."""
    mark = getattr(t, MARK, None)
    if mark is None or mark[2] != t._version:
        return None
    return mark[0], mark[1], mark[3]


def in_place_config(t: torch.Tensor) -> tuple[int, int] | None:
    """(w, nrep) if `t` holds a complete stream written in place and not overwritten since."""
    m = _mark(t)
    return None if m is None or m[2] < t.shape[0] else (m[0], m[1])


def in_place_started(t: torch.Tensor) -> bool:
    """Whether `t` was (at least partly) rewritten in place: only v3 may read it."""
    return _mark(t) is not None


def fits_in_place(packed: torch.Tensor, w: int = 4, nrep: int = 2) -> bool:
    """Whether the stream has exactly the original's size (no padding) and can overwrite it."""
    _, n, kw = packed.shape
    return n % (16 * w * nrep) == 0 and (kw * PACK) % BK == 0 and packed.is_contiguous()


def repack_in_place(
    packed: torch.Tensor, scale: torch.Tensor, w: int = 4, nrep: int = 2
) -> Repacked:
    """`repack` written over the compressed-tensors tensors themselves (the stream has the same
    number of words and scales when N and K are multiples of the tile): no lasting second copy
    of the experts (one expert at a time: transient int64 work tensors of ~20 bytes per weight
    of one expert, 73 MB for K2.6's w13 at tp = 8). Afterwards the tensors hold the stream
    (`in_place_config` says so; `decode` reads them); a later load into them that bumps their
    version makes them plain tensors again. Marked after every expert, so an interrupted call
    (e.g. out of memory) resumes where it stopped instead of permuting an expert twice."""
    e, n, kw = packed.shape
    bn = 16 * w * nrep
    if not (fits_in_place(packed, w, nrep) and scale.is_contiguous()):
        raise ValueError(f"in-place repack needs contiguous [E, N, K] with N % {bn} == 0 and "
                         f"K % {BK} == 0, got {tuple(packed.shape)} words")  # fmt: skip
    done = _mark(packed)
    if done is not None and (done[:2] != (w, nrep) or _mark(scale) != done):
        raise ValueError(f"experts partly rewritten for (W, NREP) = {done[:2]}: reload them")
    flat_w, flat_s = packed.view(e, -1), scale.view(e, -1)
    for ex in range(done[2] if done else 0, e):
        r = repack(packed[ex : ex + 1], scale[ex : ex + 1], w, nrep, 1)
        flat_w[ex].copy_(r.words[0])
        flat_s[ex].copy_(r.scales[0])
        for t in (packed, scale):
            setattr(t, MARK, (w, nrep, t._version, ex + 1))
    return Repacked(flat_w, flat_s, n, kw * PACK, w, nrep)


def as_stream(packed: torch.Tensor, scale: torch.Tensor) -> Repacked:
    """The stream view of tensors `repack_in_place` wrote."""
    cfg = in_place_config(packed)
    if cfg is None or in_place_config(scale) != cfg:
        raise ValueError(
            "these tensors do not hold a complete repacked stream (an in-place rewrite that was "
            "interrupted resumes on the next v3 call; or reload the weights)"
        )
    e, n, kw = packed.shape
    return Repacked(packed.view(e, -1), scale.view(e, -1), n, kw * PACK, *cfg)
