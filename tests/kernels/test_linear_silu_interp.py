"""`invariant.linear_silu` (the stacked gate/up matmul with silu(gate) * up in its epilogue) in the
Triton interpreter, on the CPU: bitwise `fused.silu_mul(invariant.linear(x, w))`, the two launches
it replaces, with and without a K split, every row the same alone or in a batch.

The checks run in one subprocess with TRITON_INTERPRET=1, as in tests/kernels/test_invariant_ops.py
(the interpreter's `tl.dot` patched to position-independent rows, tests/triton_interp.py; fp32 ->
bf16 casts rounded to nearest, as the GPU's). The `*_sm90` test compiles the epilogue for an H200
on the CPU and reads the PTX for what numpy cannot show.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from ddserve.kernels import backend
from ddserve.kernels.fused_ref import silu_mul_ref
from tests.triton_interp import (
    interpreter_results,
    patch_interpreter,
    require_sm90_compiler,
    require_triton,
    run_cases,
)

K26_K, K26_I = 7168, 256  # the shared expert at tp = 8: [2 * 256, 7168] stacked gate/up
K26_M = (1, 3, 17, 64, 65, 170)


def rand(*shape, dtype=torch.bfloat16, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def spread(*shape, dtype=torch.bfloat16, seed: int) -> torch.Tensor:
    """Values spread over 2^-8..2^2, so the fp32 sums round and their order shows, while the
    outputs stay where silu bends."""
    e = torch.randint(-8, 3, shape, generator=torch.Generator().manual_seed(seed + 1000))
    return (rand(*shape, dtype=torch.float32, seed=seed) * 2.0**e).to(dtype)


def _unfused(fused, inv, x, w):
    return fused.silu_mul(inv.linear(x, w))


def _tickets_clear(inv, device) -> bool:
    tickets = inv.scratch(device).tickets
    return tickets is None or int(tickets.abs().sum()) == 0


def check_k26_shared_gate_up(fused, inv) -> None:
    """The K2.6 rank's shared expert (7168 -> 2 x 256, K split 8, 32-column tiles): bitwise the
    two launches at every row count, each row count's rows those of the 170-row launch; the
    ticket scratch all zero after."""
    cfg = inv.mm_config(2 * K26_I, K26_K, torch.bfloat16)
    assert cfg.split == 8 and cfg.block_n == 32, cfg  # the case this check exists for
    x = spread(max(K26_M), K26_K, seed=1)  # [170, K]
    w = rand(2 * K26_I, K26_K, seed=2, scale=K26_K**-0.5)  # [2I, K]
    full = inv.linear_silu(x, w)  # [170, I]
    assert full.shape == (170, K26_I) and full.dtype == torch.bfloat16
    for m in K26_M:
        got = full if m == 170 else inv.linear_silu(x[:m], w)
        assert torch.equal(got, _unfused(fused, inv, x[:m], w)), f"M = {m}"
        assert torch.equal(got, full[:m]), f"M = {m} rows differ from the 170-row launch"
    for i in (100, 169):  # rows of the third m tile, alone
        assert torch.equal(inv.linear_silu(x[i : i + 1], w)[0], full[i]), i
    assert _tickets_clear(inv, x.device)


def check_small_shapes(fused, inv, dtype, m: int, k: int, inner: int, split: bool) -> None:
    """Odd M, K and I (a last tile of pairs partly past I), with and without a K split."""
    cfg = inv.mm_config(2 * inner, k, dtype)
    assert (cfg.split > 1) == split, cfg
    x = spread(m, k, dtype=dtype, seed=10 + m)
    w = rand(2 * inner, k, dtype=dtype, seed=11 + k, scale=k**-0.5)
    got = inv.linear_silu(x, w)  # [M, I]
    assert torch.equal(got, _unfused(fused, inv, x, w))
    want = silu_mul_ref(inv.linear(x, w))  # numpy's exp, not libdevice's: close, not bitwise
    torch.testing.assert_close(got, want, atol=0, rtol=2e-2)
    i = m // 2
    assert torch.equal(inv.linear_silu(x[i : i + 1], w)[0], got[i])
    assert _tickets_clear(inv, x.device)


def check_split_order(fused, inv) -> None:
    """One term per K range (split 4): 2^20, 1, -2^20, small; only their sum in split order
    keeps the small one (backwards, -2^20 + small rounds it away), and silu shows it."""
    import triton

    m, k, inner = 6, 2100, 24
    cfg = inv.mm_config(2 * inner, k, torch.bfloat16)
    assert cfg.split == 4, cfg
    k_per = triton.cdiv(triton.cdiv(k, 4), cfg.block_k) * cfg.block_k  # each split's K range
    scale = 2.0 ** (torch.arange(m) % 4 - 2.0)  # [M] exact row scales
    x = (scale[:, None] * torch.ones(m, k)).to(torch.bfloat16)  # [M, K]
    small = (torch.arange(2 * inner) % 7 + 1) * 2.0**-5  # [2I]
    w = torch.zeros(2 * inner, k)  # [2I, K]
    w[:, 0], w[:, k_per], w[:, 2 * k_per], w[:, 3 * k_per] = 2.0**20, 1.0, -(2.0**20), small
    w = w.to(torch.bfloat16)
    gu = inv.linear(x, w)  # [M, 2I]
    assert torch.equal(gu.float(), scale[:, None] * (1 + small)), "the split-order sum"
    assert torch.equal(inv.linear_silu(x, w), fused.silu_mul(gu))


def check_prefill_configuration(fused, inv) -> None:
    """Prompt chunks' configuration (128 x 128 tiles, no split): 64 pairs per tile."""
    with backend.prefill_phase():
        assert inv.mm_config(200, 136, torch.bfloat16).block_n == 128
        x, w = spread(130, 136, seed=20), rand(200, 136, seed=21, scale=136**-0.5)
        got = inv.linear_silu(x, w)  # [130, 100]
        assert torch.equal(got, _unfused(fused, inv, x, w))
        assert torch.equal(inv.linear_silu(x[129:], w), got[129:])


def check_leading_dims_and_empty(fused, inv) -> None:
    x, w = spread(2, 3, 40, seed=30), rand(24, 40, seed=31)
    got = inv.linear_silu(x, w)  # [2, 3, 12]
    assert got.shape == (2, 3, 12)
    assert torch.equal(got, _unfused(fused, inv, x, w))
    assert inv.linear_silu(x[:0, 0], w).shape == (0, 12)


def check_refuses_what_it_cannot_take(fused, inv) -> None:
    x = rand(3, 16, seed=40)
    for w in (rand(7, 16, seed=41), rand(8, 16, dtype=torch.float32, seed=42)):  # odd; fp32
        try:
            inv.linear_silu(x if w.dtype == x.dtype else x.float(), w)
        except (TypeError, ValueError):
            continue
        raise AssertionError(f"linear_silu took a {tuple(w.shape)} {w.dtype} weight")


CASES = (
    [("k26_shared_gate_up", check_k26_shared_gate_up, ())]
    + [(f"small[{d},M={m},K={k},I={i}]", check_small_shapes, (d, m, k, i, s))
       for d in (torch.bfloat16, torch.float16)
       for m, k, i, s in ((37, 70, 20, False), (17, 1030, 37, True), (9, 2100, 24, True))]
    + [("split_order", check_split_order, ())]
    + [("prefill_configuration", check_prefill_configuration, ())]
    + [("leading_dims_and_empty", check_leading_dims_and_empty, ())]
    + [("refuses_what_it_cannot_take", check_refuses_what_it_cannot_take, ())]
)  # fmt: skip


def _run_checks() -> dict[str, str]:
    """In the interpreter subprocess: every case -> "ok" or its failure text."""
    from ddserve.kernels import fused, invariant

    return run_cases(CASES, fused, invariant)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


def test_backend_is_the_two_torch_ops_on_cpu_even_when_invariant() -> None:
    x, w = rand(5, 32, seed=50), rand(24, 32, seed=51)
    with backend.invariant_mode(True):
        got = backend.linear_silu(x, w)  # [5, 12]
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(got, silu_mul_ref(F.linear(x, w)))
    assert torch.equal(got, F.silu(gate) * up)


# ---- the sm_90 PTX (compiled on the CPU, no GPU needed) ----------------------------------------
SILU_OPS = re.compile(
    r"^\s*(neg\.f32|sub\.f32|fma\.r[nm](?:\.ftz)?\.f32|ex2\.approx\.ftz\.f32|div\.\w+\.f32"
    r"|cvt\.ftz\.sat\.f32\.f32|cvt\.f32\.bf16|mul(?:\.rn)?\.(?:f32|bf16x2|f16x2))\b",
    re.M,
)


def _ptx(fn, args: dict, consts: dict, warps: int) -> str:
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    require_sm90_compiler()
    names = list(inspect.signature(fn.fn).parameters)
    aligned = [i for i, n in enumerate(names) if n in args and n != "M"]  # as the launchers
    src = ASTSource(
        fn=fn,
        signature=dict(args, **dict.fromkeys(consts, "constexpr")),
        constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    target = GPUTarget("cuda", 90, 64)
    return triton.compile(src, target=target, options={"num_warps": warps}).asm["ptx"]


def test_silu_epilogue_on_sm90_is_the_silu_mul_kernels_arithmetic() -> None:
    """At the K2.6 shared gate/up configuration (split 8, 64 x 32 tiles: 8 outputs per thread,
    as `_silu_mul_kernel`'s 1024-column block in 4 warps), the epilogue compiles to the same
    silu instructions as `fused._silu_mul_kernel`: libdevice's expf, `div.rn.f32`, the same
    products and casts (the split sum's adds aside)."""
    require_triton()
    from ddserve.kernels import fused, invariant

    consts = dict(K=K26_K, sxh=0, sxk=1, swh=0, swk=1, syh=0, syn=1, BLOCK_M=64, BLOCK_N=32,
                  BLOCK_K=64, SPLIT=8, K_PER=K26_K // 8, FP32=False, PRECISION="",
                  INTERPRET=False, REDUCE=True, PF_LINES=0, PF_STEP=64, PDL=False, ADD=False,
                  TOPK=0, srm=0, SILU=True)  # fmt: skip
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", r_ptr="*bf16", part_ptr="*fp32",
                ticket_ptr="*i32")  # fmt: skip
    names = ("M", "N", "sxm", "swn", "sps", "sym")
    mm = _ptx(invariant._mm_kernel, dict(ptrs, **dict.fromkeys(names, "i32")), consts, 4)
    args = dict(gu_ptr="*bf16", y_ptr="*bf16", M="i32", N="i32", sg="i32")
    silu = _ptx(fused._silu_mul_kernel, args, dict(BLOCK=1024, INTERPRET=False, PDL=False), 4)
    assert "div.rn.f32" in mm and "div.full.f32" not in mm
    assert Counter(SILU_OPS.findall(mm)) == Counter(SILU_OPS.findall(silu))


if __name__ == "__main__":
    from tests.kernels.test_fused_ops import round_bf16_to_nearest

    patch_interpreter()
    round_bf16_to_nearest()
    print(json.dumps(_run_checks()))
