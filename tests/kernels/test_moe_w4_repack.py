"""The Gluon MoE kernel's weight repack (`moe_w4_repack`) against a plain dequantization.

The repack's nibble and scale placement is derived by replaying the kernel's tensor program on
index tensors; decoding the stream back must give the original weights exactly, for every tile
config the kernel is built with and for shapes that need padding.
"""

from __future__ import annotations

import pytest
import torch

from ddserve.kernels.moe_ref import dequantize_int4, quantize_int4
from ddserve.kernels.moe_w4_repack import (
    BK,
    _kernel_a,
    _kernel_b_phys,
    _kernel_scales,
    decode,
    kernel_maps,
    repack,
)


@pytest.mark.parametrize("w,nrep", [(4, 1), (4, 2), (4, 4), (8, 1), (2, 2)])
def test_maps_are_a_bijection(w: int, nrep: int) -> None:
    m = kernel_maps(w, nrep)
    bn = 16 * w * nrep
    flat = m.word_row * BK + m.word_col  # every (row, column) of the tile exactly once
    assert sorted(flat.reshape(-1).tolist()) == list(range(bn * BK))
    slots = m.scale_row * 4 + m.scale_group
    assert sorted(slots.tolist()) == list(range(bn * 4))


SHAPES = [(3, 128, 256, 4, 2), (2, 96, 160, 4, 1), (2, 200, 96, 4, 2), (1, 512, 384, 8, 1)]


@pytest.mark.parametrize("e,n,k,w,nrep", SHAPES)
def test_decode_equals_dequantize(e: int, n: int, k: int, w: int, nrep: int) -> None:
    torch.manual_seed(0)
    packed, scale = quantize_int4(torch.randn(e, n, k))
    r = repack(packed, scale, w=w, nrep=nrep, chunk=2)
    assert r.words.dtype == torch.int32 and r.scales.dtype == scale.dtype
    assert r.words.shape == (e, r.n_tiles * r.k_steps * 16 * r.bn)
    assert torch.equal(decode(r), dequantize_int4(packed, scale))


def test_kernel_program_computes_the_product() -> None:
    """The kernel's tensor program replayed on real data: the A operand built from the stream's
    words and scales (the same joins/reshapes/permute as `moe_gluon._a_tile`, the same scale
    split and repeat) times the B operand built from x (`_x_tile`'s permutation) equals the
    dense product W x^T."""
    torch.manual_seed(1)
    w, nrep = 4, 2
    packed, scale = quantize_int4(torch.randn(1, 16 * w * nrep, BK).to(torch.bfloat16))
    dense = dequantize_int4(packed, scale)[0].double()  # [BN, BK]
    x = torch.randn(16, BK, dtype=torch.float64)  # [BM, BK]
    r = repack(packed, scale, w=w, nrep=nrep)
    words = r.words[0].to(torch.int64)  # [NW]
    s0, s1 = _kernel_scales(w, nrep)  # scale slot of each word, rows +0 / +8
    sc = r.scales[0].double()
    nib = ((words.unsqueeze(-1) >> (torch.arange(8) * 4)) & 0xF) - 8  # [NW, 8]
    row8 = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # nibble n = i + 4 h, i = row3 + 2 k3
    vals = nib.double() * torch.where(row8.bool(), sc[s1].unsqueeze(1), sc[s0].unsqueeze(1))
    a = _kernel_a(vals, w, nrep)  # [BN, BK] logical
    b = x[:, _kernel_b_phys()].t()  # [BK, BM] logical
    assert torch.allclose(a @ b, dense @ x.t(), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a, dense)  # the logical order really is a permutation


def test_repack_in_place_overwrites_and_decodes() -> None:
    """In place: the original tensors hold the stream afterwards (no copy), `ExpertWeights.expert`
    and the torch reference decode it, and a later load into the tensors clears the mark."""
    from ddserve.kernels.moe_ref import ExpertWeights, moe_ref
    from ddserve.kernels.moe_w4_repack import in_place_config, repack_in_place

    torch.manual_seed(2)
    e, h, i = 3, 256, 128
    p13, s13 = quantize_int4(torch.randn(e, 2 * i, h).to(torch.bfloat16))
    p2, s2 = quantize_int4(torch.randn(e, h, i).to(torch.bfloat16))
    plain = ExpertWeights(w13_packed=p13.clone(), w13_scale=s13.clone(), w2_packed=p2.clone(),
                          w2_scale=s2.clone())  # fmt: skip
    w = ExpertWeights(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2,
                      repack_in_place=True)  # fmt: skip
    ptr = p13.data_ptr()
    r = repack_in_place(p13, s13, 4, 2)
    repack_in_place(p2, s2, 4, 2)
    assert r.words.data_ptr() == ptr and in_place_config(p13) == (4, 2)
    assert not torch.equal(p13, plain.w13_packed)  # really overwritten
    assert torch.equal(decode(r), dequantize_int4(plain.w13_packed, plain.w13_scale))
    for ex in range(e):
        for a, b in zip(w.expert(ex, torch.float32), plain.expert(ex, torch.float32), strict=True):
            assert torch.equal(a, b)
    x = torch.randn(5, h).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    tw = torch.rand(5, 2)
    assert torch.equal(moe_ref(x, ids, tw, w), moe_ref(x, ids, tw, plain))
    p13.copy_(plain.w13_packed)  # a weight load: the tensor is plain again
    assert in_place_config(p13) is None


def test_repack_in_place_refuses_padding_shapes() -> None:
    from ddserve.kernels.moe_w4_repack import repack_in_place

    packed, scale = quantize_int4(torch.randn(1, 96, 128).to(torch.bfloat16))
    with pytest.raises(ValueError, match="in-place repack needs"):
        repack_in_place(packed, scale, 4, 2)


def test_interrupted_in_place_repack_resumes(monkeypatch) -> None:
    """An in-place rewrite that fails part way (here: the third expert) leaves a mark of the
    experts done; the next call resumes there, so no expert is permuted twice."""
    from ddserve.kernels import moe_w4_repack as m

    torch.manual_seed(3)
    packed, scale = quantize_int4(torch.randn(4, 128, 256).to(torch.bfloat16))
    want = dequantize_int4(packed, scale)
    real, calls = m.repack, []

    def failing(p, s, w, nrep, chunk):
        calls.append(1)
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(p, s, w, nrep, chunk)

    monkeypatch.setattr(m, "repack", failing)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        m.repack_in_place(packed, scale, 4, 2)
    assert m.in_place_started(packed) and m.in_place_config(packed) is None
    with pytest.raises(ValueError, match="interrupted"):
        m.as_stream(packed, scale)
    monkeypatch.setattr(m, "repack", real)
    r = m.repack_in_place(packed, scale, 4, 2)
    assert m.in_place_config(packed) == (4, 2)
    assert torch.equal(decode(r), want)


def test_in_place_experts_refuse_other_variants_on_cpu() -> None:
    """After an in-place rewrite the Triton v2 path (the CPU / interpreter default) refuses the
    tensors with a clear error instead of reading the stream as compressed-tensors words."""
    from ddserve.kernels.moe_ref import ExpertWeights
    from ddserve.kernels.moe_triton import fused_moe
    from ddserve.kernels.moe_w4_repack import repack_in_place

    p13, s13 = quantize_int4(torch.randn(2, 256, 128).to(torch.bfloat16))
    p2, s2 = quantize_int4(torch.randn(2, 128, 128).to(torch.bfloat16))
    repack_in_place(p13, s13, 4, 2)
    repack_in_place(p2, s2, 4, 2)
    w = ExpertWeights(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2)
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids = torch.tensor([[0], [1], [0]])
    with pytest.raises(RuntimeError, match="repacked in place"):
        fused_moe(x, ids, torch.ones(3, 1), w)
