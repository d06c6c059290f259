"""The prefill configuration of the batch-invariant matmul on a GPU: a prompt row's bits do not
depend on how many rows share the chunk (M = 1..2048), and the result matches float64."""

from __future__ import annotations

import pytest
import torch

from ddserve.kernels import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
M_LIST = [1, 2, 7, 64, 127, 128, 129, 300, 511, 1000, 2047]


@pytest.mark.parametrize("n,k", [(1536, 7168), (576, 7168), (7168, 1024), (2304, 7168)])
def test_prefill_linear_rows_do_not_depend_on_m(n: int, k: int) -> None:
    from ddserve.kernels.invariant import linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    with backend.prefill_phase():
        full = linear(x, w)
        bad = [m for m in M_LIST if not torch.equal(linear(x[:m], w), full[:m])]
    assert bad == []
    ref = x[:256].double() @ w.double().T
    err = ((full[:256].double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2
