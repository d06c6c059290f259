"""Weight tiles for the W4A16 MoE kernel v2 (`moe_triton_v2`): INT4 words -> bf16 tiles, two ways.

The words are packed along K (the reduction dimension), so a [BN, KW] tile of words is a
[BN, 8 KW] tile of weights; word j's scale is scale[j // 4] (groups of 32 columns).
Pure Triton (`unpack`, runs in the interpreter): per nibble, mask, float magic-number subtract
(no int -> float conversion), fp32 scale multiply, round to bf16; the eight nibble planes are
interleaved in registers (join + reshape) into natural column order, so one MMA per K step
consumes them.
ASM (`unpack_asm`, CUDA only): `(w >> s) & 0x000F000F | 0x43004300` via lop3 gives two bf16 values
128 + n in one register, one bf16x2 fma subtracts 136 exactly and one multiplies by the bf16
scale (adding -0, so a single rounding of the exact product): the same bits as the pure path.
About 1.5 instructions per weight instead of ~5.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant(words, scale, i: tl.constexpr):
    """Nibble i of each int32 word, times its scale: [BN, KW] int32 -> [BN, KW] bf16."""
    v = ((words >> (4 * i)) & 0xF) | 0x4B000000  # fp32 bits of 2^23 + n
    f = v.to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + 8: stored q + 8 -> q
    return (f * scale.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def unpack(words, scale):
    """[BN, KW] words and their scales -> [BN, 8 * KW] bf16 weights in natural column order.

    join() adds a minor dimension of size 2; joining (n0, n4), (n2, n6), (n1, n5), (n3, n7), then
    pairs of those, then the two halves puts nibble i at minor position i, so the reshape yields
    column 8 * j + i for nibble i of word j, without moving data between threads."""
    n0 = _dequant(words, scale, 0)
    n1 = _dequant(words, scale, 1)
    n2 = _dequant(words, scale, 2)
    n3 = _dequant(words, scale, 3)
    n4 = _dequant(words, scale, 4)
    n5 = _dequant(words, scale, 5)
    n6 = _dequant(words, scale, 6)
    n7 = _dequant(words, scale, 7)
    lo = tl.join(tl.join(n0, n4), tl.join(n2, n6))
    hi = tl.join(tl.join(n1, n5), tl.join(n3, n7))
    w = tl.join(lo, hi)  # [BN, KW, 2, 2, 2]
    return tl.reshape(w, (w.shape[0], w.shape[1] * 8))


# (n0 + 128, n16 + 128) as bf16x2 via lop3, minus 136 (exact), times the scale (+ -0: one
# rounding of the exact product). Shared with the Gluon kernel (`moe_gluon._pair`).
PAIR_ASM = tl.constexpr("""{
        .reg .b32 t, s2, one, c;
        mov.b32 s2, {$3, $3};
        mov.b32 one, 0x3F803F80;
        mov.b32 c, 0xC308C308;
        lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA;
        fma.rn.bf16x2 t, t, one, c;
        mov.b32 c, 0x80008000;
        fma.rn.bf16x2 t, t, s2, c;
        mov.b32 {$0, $1}, t;
        }""")


@triton.jit
def _pair_asm(w, s):
    """Nibbles at bits 0 and 16 of int32 words w times bf16 scales s (passed as int16 bits):
    two int16 tensors holding the bf16 bits (16-bit asm operands are integers for LLVM)."""
    return tl.inline_asm_elementwise(
        asm=PAIR_ASM,
        constraints="=h,=h,r,h",
        args=[w, s],
        dtype=(tl.int16, tl.int16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _bf16(bits):
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def unpack_asm(words, scale):
    """`unpack` with the bf16x2 trick: same output bits, about 1.5 instructions per weight."""
    s = scale.to(tl.bfloat16).to(tl.int16, bitcast=True)
    n0, n4 = _pair_asm(words, s)
    n1, n5 = _pair_asm(words >> 4, s)
    n2, n6 = _pair_asm(words >> 8, s)
    n3, n7 = _pair_asm(words >> 12, s)
    n0, n1, n2, n3 = _bf16(n0), _bf16(n1), _bf16(n2), _bf16(n3)
    n4, n5, n6, n7 = _bf16(n4), _bf16(n5), _bf16(n6), _bf16(n7)
    lo = tl.join(tl.join(n0, n4), tl.join(n2, n6))
    hi = tl.join(tl.join(n1, n5), tl.join(n3, n7))
    w = tl.join(lo, hi)  # [BN, KW, 2, 2, 2]
    return tl.reshape(w, (w.shape[0], w.shape[1] * 8))


@triton.jit
def load_raw(w_base, s_base, n, n_ok, kb, k_end, stride_wn, stride_sn, INT4: tl.constexpr,
              KW: tl.constexpr, SV: tl.constexpr):  # fmt: skip
    """Raw operands of rows n, columns kb .. kb + 8 KW (masked at k_end): INT4 -> (words
    [BN, KW] int32, scales [BN, KW]); dense -> (tile [BN, 8 KW], the same tile).
    SV: load each 32-column group's scale once ([BN, KW / 4], contiguous) and repeat it in
    registers, instead of one 2-byte load per word (same values; needs k_end % 32 == 0)."""
    if INT4:
        wi = kb // 8 + tl.arange(0, KW)  # [KW] word index
        wm = n_ok[:, None] & (wi < k_end // 8)[None, :]
        words = tl.load(w_base + n[:, None] * stride_wn + wi[None, :], mask=wm, other=0)
        if SV:
            gi = kb // 32 + tl.arange(0, KW // 4)  # [KW / 4] group index
            gm = n_ok[:, None] & (gi < k_end // 32)[None, :]
            sg = tl.load(s_base + n[:, None] * stride_sn + gi[None, :], mask=gm, other=0)
            sg = tl.broadcast_to(sg[:, :, None], (sg.shape[0], KW // 4, 4))  # [BN, KW / 4, 4]
            scale = tl.reshape(sg, (sg.shape[0], KW))
        else:
            scale = tl.load(s_base + n[:, None] * stride_sn + (wi // 4)[None, :], mask=wm, other=0)
        return words, scale
    else:
        k = kb + tl.arange(0, 8 * KW)
        wm = n_ok[:, None] & (k < k_end)[None, :]
        tile = tl.load(w_base + n[:, None] * stride_wn + k[None, :], mask=wm, other=0.0)
        return tile, tile


@triton.jit
def _convert(a, b, INT4: tl.constexpr, ASM: tl.constexpr):
    """`load_raw`'s operands -> [BN, 8 KW] bf16 weights."""
    if INT4:
        if ASM:
            return unpack_asm(a, b)
        else:
            return unpack(a, b)
    else:
        return a.to(tl.bfloat16)


@triton.jit
def _mma(a, b, F32: tl.constexpr):
    """a @ b with fp32 accumulation; F32 (interpreter only: its bf16 dot is broken in triton 3.6
    with numpy 2) widens the bf16 operands first, which gives the same products."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def acc_step(acc, a, b, xk, INT4: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """acc [BN, BM] += tile(a, b) @ xk, with `load_raw`'s operands."""
    return acc + _mma(_convert(a, b, INT4, ASM), xk, F32)
