"""Weight tiles for the W4A16 MoE kernels (`moe_triton_v2`): INT4 words -> bf16 tiles, two ways.

Pure Triton (`moe_triton_v1._unpack`, runs in the interpreter): per nibble, mask, float
magic-number subtract, fp32 scale multiply, round to bf16.
ASM (CUDA only): `(w >> s) & 0x000F000F | 0x43004300` via lop3 gives two bf16 values 128 + n in
one register, one bf16x2 fma subtracts 136 exactly and one multiplies by the bf16 scale (adding
-0, so a single rounding of the exact product): the same bits as the pure path. About 1.5
instructions per weight instead of ~5.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddserve.kernels.moe_triton_v1 import _unpack

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
def _unpack_asm(words, scale):
    """`_unpack` with the bf16x2 trick: same output bits, about 1.5 instructions per weight."""
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
def _load_raw(w_base, s_base, n, n_ok, kb, k_end, stride_wn, stride_sn, INT4: tl.constexpr,
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
    """`_load_raw`'s operands -> [BN, 8 KW] bf16 weights."""
    if INT4:
        if ASM:
            return _unpack_asm(a, b)
        else:
            return _unpack(a, b)
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
def _fake_bf16(words, scale):
    """FAKE_DEQUANT ablation: the words reinterpreted as bf16 (halves, each used 4 times) with
    the scale bits xor-ed in so the scale load stays live; no real dequant arithmetic."""
    w = words ^ scale.to(tl.float32).to(tl.int32, bitcast=True)
    lo = _bf16(w.to(tl.int16))
    hi = _bf16((w >> 16).to(tl.int16))
    t = tl.join(lo, hi)
    t = tl.join(tl.join(t, t), tl.join(t, t))  # [BN, KW, 2, 2, 2]
    return tl.reshape(t, (t.shape[0], t.shape[1] * 8))


@triton.jit
def _acc_step(acc, a, b, xk, INT4: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr,
              MODE: tl.constexpr):  # fmt: skip
    """acc [BN, BM] += tile(a, b) @ xk, with `_load_raw`'s operands. MODE (ablations, INT4
    only; every other stage kept): 0 the real step; 1 LOAD_ONLY (int sum of words and
    scale bits, no dequant, no MMA); 2 NO_MMA (real dequant, summed into acc elementwise instead
    of tl.dot); 3 FAKE_DEQUANT (bitcast words fed to the MMA)."""
    if MODE == 0 or not INT4:
        out = acc + _mma(_convert(a, b, INT4, ASM), xk, F32)
    elif MODE == 1:
        cs = tl.sum(a + b.to(tl.float32).to(tl.int32, bitcast=True), axis=1)  # [BN] (wraps)
        out = acc + cs.to(tl.float32)[:, None]
    elif MODE == 2:
        w = _convert(a, b, INT4, ASM).to(tl.float32)  # [BN, 8 KW]
        w3 = tl.reshape(w, (w.shape[0], w.shape[1] // acc.shape[1], acc.shape[1]), can_reorder=True)
        out = acc + tl.sum(w3, axis=1)
    else:
        out = acc + _mma(_fake_bf16(a, b), xk, F32)
    return out
