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
