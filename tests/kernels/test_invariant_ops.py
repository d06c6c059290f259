"""Batch-invariant dense ops (ddserve/kernels/invariant.py) in the Triton interpreter, on the CPU.

The kernels must match float64 / torch references, and a row's result must be bitwise the same
whether it is computed alone or inside a batch of M rows. The kernel checks run in one subprocess
with TRITON_INTERPRET=1 (it must be set before triton is imported): that process runs this file
as a script, calls every `check_*` function and prints one JSON line of results. The interpreter's
`tl.dot` is patched there to a product whose every element gets the same arithmetic wherever its
row sits in the tile (tests/triton_interp.py says why: numpy's BLAS does not on AVX2 CPUs), so the
bitwise claims test the kernels' own promise -- tiles, K order and splits fixed independently of
M -- on any CPU; tests/gpu/test_invariant_gpu.py repeats them for tensor-core math.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ddserve.kernels import backend
from ddserve.kernels.invariant_ref import bmm_heads_ref, fixed_order_sum, rms_norm_ref
from tests.triton_interp import interpreter_results, patch_interpreter, require_triton, run_cases

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)


def rand(*shape, dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def wide(*shape, dtype, seed: int) -> torch.Tensor:
    """Values spread over 2^-12..2^12, so fp32 sums of products round and their order shows."""
    g = torch.Generator().manual_seed(seed + 1000)
    return (
        rand(*shape, dtype=torch.float32, seed=seed)
        * 2.0 ** torch.randint(-12, 13, shape, generator=g)
    ).to(dtype)


def check_linear_matches_float64(inv, dtype: torch.dtype) -> None:
    x, w = rand(37, 70, dtype=dtype, seed=0), rand(50, 70, dtype=dtype, seed=1)
    expected = x.double() @ w.double().T  # [37, 50]
    got = inv.linear(x, w)
    assert got.dtype == dtype and got.shape == (37, 50)
    torch.testing.assert_close(got.double(), expected, **tol(dtype))


def check_linear_row_alone_equals_row_in_batch(inv, dtype: torch.dtype) -> None:
    x, w = wide(140, 150, dtype=dtype, seed=2), rand(40, 150, dtype=dtype, seed=3)
    full = inv.linear(x, w)  # [140, 40]: rows span three m tiles, K two k tiles
    rows = [*range(0, 140, 3), 139]  # every third row: 47 distinct places in a 64-row tile
    assert [i for i in rows if not torch.equal(inv.linear(x[i : i + 1], w)[0], full[i])] == []
    assert torch.equal(inv.linear(x[5:70], w), full[5:70])


def check_linear_split_k(inv, dtype: torch.dtype) -> None:
    """A narrow weight with a long K is split along K; still accurate and row-invariant."""
    n, k = 20, 1030
    assert inv.mm_config(n, k, dtype)[3] > 1  # the case this check exists for
    x, w = wide(20, k, dtype=dtype, seed=16), rand(n, k, dtype=dtype, seed=17)
    full = inv.linear(x, w)  # [20, 40]
    xr = rand(20, k, dtype=dtype, seed=18)
    expected = xr.double() @ w.double().T
    torch.testing.assert_close(inv.linear(xr, w).double(), expected, **tol(dtype))
    alone = torch.cat([inv.linear(x[i : i + 1], w) for i in range(20)])  # [20, 40]
    assert [i for i in range(20) if not torch.equal(alone[i], full[i])] == []


def check_prefill_configuration(inv) -> None:
    """Prompt chunks (`backend.prefill_phase()`) take their own 16-bit configuration (large tiles,
    no K split): accurate and row-invariant too."""
    bf16 = torch.bfloat16
    with backend.prefill_phase():
        assert inv.mm_config(20, 600, bf16).block_m == 128  # the case this check exists for
        x, w = wide(140, 600, dtype=bf16, seed=19), rand(20, 600, dtype=bf16, seed=20)
        xr = rand(140, 600, dtype=bf16, seed=21)
        got = inv.linear(xr, w)  # [140, 20]
        torch.testing.assert_close(got.double(), xr.double() @ w.double().T, **tol(bf16))
        full = inv.linear(x, w)  # [140, 20]: rows span two 128-row tiles
        rows = [i for i in (0, 17, 139) if not torch.equal(inv.linear(x[i : i + 1], w)[0], full[i])]
        assert rows == []


def check_row_sum8_equals_fixed_order_sum(inv) -> None:
    """The Router's top-k weight sum in one launch: fixed_order_sum's bits, row by row."""
    for k in range(1, 9):
        x = wide(37, k, dtype=torch.float32, seed=30 + k)
        got = inv.row_sum8(x)  # [37, 1]
        assert torch.equal(got, fixed_order_sum(x)), k
        assert torch.equal(inv.row_sum8(x[5:6]), got[5:6])


def check_linear_accepts_leading_dims_and_empty(inv) -> None:
    x, w = rand(2, 3, 24, dtype=torch.float32, seed=4), rand(17, 24, dtype=torch.float32, seed=5)
    torch.testing.assert_close(inv.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert inv.linear(x[:0, 0], w).shape == (0, 17)


def check_bmm_heads_matches_einsum_and_is_row_invariant(inv, dtype, transposed: bool) -> None:
    t, h, k, n = 21, 3, 40, 24
    x = rand(t, h, k, dtype=dtype, seed=6)
    if transposed:  # MLA's W_UV: [H, v, R] used as [H, R, v]
        w = rand(h, n, k, dtype=dtype, seed=7).transpose(1, 2)
    else:  # MLA's W_UK: a slice of kv_b_proj viewed [H, nope + v, R]
        w = rand(h, k + 5, n, dtype=dtype, seed=7)[:, :k]
    got = inv.bmm_heads(x, w)  # [T, H, N]
    expected = torch.einsum("thk,hkn->thn", x.double(), w.double())
    torch.testing.assert_close(got.double(), expected, **tol(dtype))
    x = wide(t, h, k, dtype=dtype, seed=6)  # bitwise part: rounding-sensitive inputs
    got = inv.bmm_heads(x, w)  # [T, H, N]
    assert [i for i in range(t) if not torch.equal(inv.bmm_heads(x[i : i + 1], w)[0], got[i])] == []


def check_rms_norm_matches_reference(inv, dtype: torch.dtype) -> None:
    x, w = rand(9, 100, dtype=dtype, seed=8) * 3, rand(100, dtype=dtype, seed=9)
    got = inv.rms_norm(x, w, 1e-6)
    # reference in float64 with the same casts (normalised value rounded to dtype, then scaled)
    xd = x.double()
    normed = (xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).to(dtype)
    expected = w.double() * normed.double()
    torch.testing.assert_close(got.double(), expected, **tol(dtype))
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), **tol(dtype))


def check_rms_norm_strided_rows_and_batch_invariance(inv) -> None:
    base = rand(12, 80, dtype=torch.bfloat16, seed=10)
    x, w = base[:, :64], rand(64, dtype=torch.bfloat16, seed=11)  # MLA's c_kv slice: strided
    got = inv.rms_norm(x, w, 1e-6)
    assert torch.equal(got, inv.rms_norm(x.contiguous(), w, 1e-6))
    for i in (0, 11):
        assert torch.equal(inv.rms_norm(x[i : i + 1], w, 1e-6)[0], got[i])


CASES = (
    [(f"linear_matches_float64[{d}]", check_linear_matches_float64, (d,)) for d in DTYPES]
    + [(f"linear_row_invariant[{d}]", check_linear_row_alone_equals_row_in_batch, (d,))
       for d in DTYPES]
    + [(f"linear_split_k[{d}]", check_linear_split_k, (d,))
       for d in (torch.bfloat16, torch.float32)]
    + [("prefill_configuration", check_prefill_configuration, ())]
    + [("row_sum8", check_row_sum8_equals_fixed_order_sum, ())]
    + [("linear_leading_dims_and_empty", check_linear_accepts_leading_dims_and_empty, ())]
    + [(f"bmm_heads[{d},transposed={t}]", check_bmm_heads_matches_einsum_and_is_row_invariant,
        (d, t)) for d in (torch.bfloat16, torch.float32) for t in (False, True)]
    + [(f"rms_norm_matches_reference[{d}]", check_rms_norm_matches_reference, (d,))
       for d in DTYPES]
    + [("rms_norm_strided_and_row_invariant", check_rms_norm_strided_rows_and_batch_invariance, ())]
)  # fmt: skip


def _run_checks() -> dict[str, str]:
    """In the interpreter subprocess: every case -> "ok" or its failure text."""
    from ddserve.kernels import invariant

    return run_cases(CASES, invariant)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


@pytest.mark.parametrize("n", [1, 2, 3, 8, 13])
def test_fixed_order_sum(n: int) -> None:
    x = rand(6, n, dtype=torch.float32, seed=n)
    got = fixed_order_sum(x)  # [6, 1]
    torch.testing.assert_close(got.double(), x.double().sum(-1, keepdim=True), atol=1e-5, rtol=0)
    for i in range(6):
        assert torch.equal(fixed_order_sum(x[i : i + 1]), got[i : i + 1])


def test_rope_tiles_fit_k26_query_in_decode_and_verify_forwards_only() -> None:
    """`linear_rope` serves q_b_proj (1536 -> 8 heads of 128 + 64 at K2.6 tp = 8) where its
    configuration's column tile is one rope part: 64-column tiles of decode and verify
    forwards; not prompt chunks' 128-column tiles, fp32 weights, or rope parts that do not
    start on a tile."""
    require_triton()
    from ddserve.kernels import invariant as inv

    bf16 = torch.bfloat16
    assert inv.mm_config(1536, 1536, bf16).block_n == 64
    assert inv.rope_tiles_fit(1536, 1536, bf16, 128, 64)
    assert inv.rope_tiles_fit(1536, 1536, torch.float16, 128, 64)
    with backend.prefill_phase():
        assert not inv.rope_tiles_fit(1536, 1536, bf16, 128, 64)
    assert not inv.rope_tiles_fit(1536, 1536, torch.float32, 128, 64)
    assert not inv.rope_tiles_fit(1280, 1536, bf16, 96, 64)  # 8 heads of 96 + 64
    assert not inv.rope_tiles_fit(2048, 1536, bf16, 224, 32)  # 8 heads of 224 + 32


def test_backend_uses_torch_on_cpu_even_when_invariant() -> None:
    was = backend.batch_invariant()
    backend.set_batch_invariant(True)
    try:
        x, w = (
            rand(5, 32, dtype=torch.bfloat16, seed=12),
            rand(8, 32, dtype=torch.bfloat16, seed=13),
        )
        assert torch.equal(backend.linear(x, w), F.linear(x, w))
        xh, wh = x.view(5, 2, 16), w.view(2, 16, 8)
        assert torch.equal(backend.bmm_heads(xh, wh), bmm_heads_ref(xh, wh))
        nw = rand(32, dtype=torch.bfloat16, seed=14)
        assert torch.equal(backend.rms_norm(x, nw, 1e-6), rms_norm_ref(x, nw, 1e-6))
        # the Router's k-sum takes the fixed order in this mode on every device
        s = rand(4, 5, dtype=torch.float32, seed=15)
        assert torch.equal(backend.row_sum(s), fixed_order_sum(s))
    finally:
        backend.set_batch_invariant(was)


if __name__ == "__main__":
    patch_interpreter()
    print(json.dumps(_run_checks()))
