"""Fused elementwise ops (ddserve/kernels/fused.py) in the Triton interpreter, on the CPU.

Each kernel must reproduce the torch sequence it replaces (`fused_ref.py`): bitwise where the
arithmetic is elementwise in 16-bit (the residual add, RoPE, the casts, the cache scatter), and its
RMSNorms bitwise equal to `invariant.rms_norm` run in the same interpreter (the GPU order of the
row reduction is checked by tests/gpu/test_fused_gpu.py; against torch's CPU RMSNorm, whose sum
order differs, the norms are only close). silu_mul's exp is numpy's here, not libdevice's, so
against torch's CPU silu it may differ by one 16-bit ulp in rare elements.
The checks run in one subprocess with TRITON_INTERPRET=1 (set before triton is imported), as in
tests/kernels/test_invariant_ops.py. The `*_sm90` tests compile the kernels for an H200 on the CPU
and read the PTX for what numpy cannot show (contracted fmas, the reduction's instructions).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ddserve.kernels import backend
from ddserve.kernels.fused_ref import (
    add_rms_norm_ref,
    apply_rope,
    mla_rope_cache_ref,
    silu_mul_ref,
)
from ddserve.kernels.invariant_ref import rms_norm_ref
from tests.triton_interp import interpreter_results, patch_interpreter, require_triton, run_cases

HALF = [torch.bfloat16, torch.float16]


def rand(*shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def check_add_rms_norm(fused, inv, dtype: torch.dtype, d: int) -> None:
    x, r = rand(7, d, dtype=dtype, seed=1), rand(7, d, dtype=dtype, seed=2, scale=8.0)
    w = rand(d, dtype=dtype, seed=3)
    s, n = fused.add_rms_norm(x, r, w, 1e-6)  # [7, D] each
    assert torch.equal(s, x + r)
    assert torch.equal(n, inv.rms_norm(s, w, 1e-6))
    torch.testing.assert_close(n, rms_norm_ref(s, w, 1e-6), atol=2e-2, rtol=2e-2)
    s1, n1 = fused.add_rms_norm(x[4:5], r[4:5], w, 1e-6)  # a row alone
    assert torch.equal(s1[0], s[4]) and torch.equal(n1[0], n[4])


def check_add_rms_norm_strided(fused, inv) -> None:
    base = rand(5, 80, dtype=torch.bfloat16, seed=4)
    x, r = base[:, :64], rand(5, 64, dtype=torch.bfloat16, seed=5)  # x strided
    w = rand(64, dtype=torch.bfloat16, seed=6)
    s, n = fused.add_rms_norm(x, r, w, 1e-5)
    assert s.is_contiguous() and torch.equal(s, x + r)
    assert torch.equal(n, inv.rms_norm(x + r, w, 1e-5))


def _mla_inputs(dtype, interleave_seed: int, t=7, heads=3, nope=5, rank=40, p=8, slots=20):
    q = rand(t, heads, nope + p, dtype=dtype, seed=10 + interleave_seed)  # [T, H, nope + P]
    kv = rand(t, rank + p, dtype=dtype, seed=11 + interleave_seed)  # [T, R + P]
    w = rand(rank, dtype=dtype, seed=12)
    ang = torch.rand(t, p, generator=torch.Generator().manual_seed(13)) * 6.28
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)  # [T, P]
    cache = rand(slots, rank + p, dtype=dtype, seed=14)  # [S, R + P] old contents
    where = torch.randperm(slots, generator=torch.Generator().manual_seed(15))[:t]  # [T]
    return q, kv, w, cos, sin, cache, where


def check_mla_rope_cache(fused, inv, dtype: torch.dtype, interleave: bool, p: int) -> None:
    q, kv, w, cos, sin, cache, slots = _mla_inputs(dtype, int(interleave), p=p)
    want_cache = cache.clone()
    want_q = mla_rope_cache_ref(q, kv, w, 1e-6, cos, sin, want_cache, slots, interleave,
                                rms_norm=inv.rms_norm)  # fmt: skip
    got_cache = cache.clone()
    got_q = fused.mla_rope_cache(q, kv, w, 1e-6, cos, sin, got_cache, slots, interleave)
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    assert torch.equal(got_cache, want_cache)  # written rows and untouched rows
    torch_cache = cache.clone()  # torch's CPU RMSNorm: the same but for its sum order
    mla_rope_cache_ref(q, kv, w, 1e-6, cos, sin, torch_cache, slots, interleave)
    torch.testing.assert_close(got_cache, torch_cache, atol=2e-2, rtol=2e-2)


def check_mla_rope_cache_strided_query(fused, inv) -> None:
    """q as MLA passes it: a view of q_b_proj's [T, H * (nope + P)] output, with 2 heads and P 64
    (K2.6's rope dim); kv from a wider buffer."""
    dtype = torch.bfloat16
    q = rand(3, 2 * (16 + 64), dtype=dtype, seed=20).view(3, 2, 80)
    kv = rand(3, 32 + 64, dtype=dtype, seed=21)
    w = rand(32, dtype=dtype, seed=22)
    ang = torch.rand(3, 64, generator=torch.Generator().manual_seed(23)) * 6.28
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    for interleave in (False, True):
        want, got = torch.zeros(9, 96, dtype=dtype), torch.zeros(9, 96, dtype=dtype)
        slots = torch.tensor([8, 0, 5])
        want_q = mla_rope_cache_ref(q, kv, w, 1e-6, cos, sin, want, slots, interleave,
                                    rms_norm=inv.rms_norm)  # fmt: skip
        got_q = fused.mla_rope_cache(q, kv, w, 1e-6, cos, sin, got, slots, interleave)
        assert torch.equal(got_q, want_q) and torch.equal(got, want)


def check_silu_mul(fused, dtype: torch.dtype, inner: int) -> None:
    gu = rand(5, 2 * inner, dtype=dtype, seed=30, scale=4.0)  # [T, 2I]
    got, want = fused.silu_mul(gu), silu_mul_ref(gu)  # [T, I]
    assert got.shape == want.shape == (5, inner)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= want.float().abs() * ulp + 1e-30).all()), "more than one ulp apart"
    assert (diff > 0).float().mean().item() < 0.01, "numpy's exp should rarely flip a rounding"


CASES = (
    [(f"add_rms_norm[{d},{n}]", check_add_rms_norm, ("inv", d, n))
     for d in HALF for n in (200, 7168)]
    + [("add_rms_norm_strided", check_add_rms_norm_strided, ("inv",))]
    + [(f"mla_rope_cache[{d},interleave={i},P={p}]", check_mla_rope_cache, ("inv", d, i, p))
       for d in HALF for i in (False, True) for p in (8, 12)]
    + [("mla_rope_cache_strided_query", check_mla_rope_cache_strided_query, ("inv",))]
    + [(f"silu_mul[{d},{n}]", check_silu_mul, (d, n)) for d in HALF for n in (37, 1100)]
)  # fmt: skip


def _run_checks() -> dict[str, str]:
    """In the interpreter subprocess: every case -> "ok" or its failure text."""
    from ddserve.kernels import fused, invariant

    cases = [(n, fn, tuple(invariant if a == "inv" else a for a in args)) for n, fn, args in CASES]
    return run_cases(cases, fused)


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


def test_backend_runs_the_torch_sequences_on_cpu_even_when_invariant() -> None:
    was = backend.batch_invariant()
    backend.set_batch_invariant(True)
    try:
        x = rand(5, 48, dtype=torch.bfloat16, seed=40)
        r = rand(5, 48, dtype=torch.bfloat16, seed=41)
        w = rand(48, dtype=torch.bfloat16, seed=42)
        s, n = backend.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(s, x + r) and torch.equal(n, rms_norm_ref(x + r, w, 1e-6))
        q, kv, nw, cos, sin, cache, slots = _mla_inputs(torch.bfloat16, 0)
        want = cache.clone()
        q_pe = backend.mla_rope_cache(q, kv, nw, 1e-6, cos, sin, cache, slots, True)
        assert torch.equal(q_pe, mla_rope_cache_ref(q, kv, nw, 1e-6, cos, sin, want, slots, True))
        assert torch.equal(cache, want)
        gu = rand(3, 20, dtype=torch.bfloat16, seed=43)
        assert torch.equal(backend.silu_mul(gu), silu_mul_ref(gu))
    finally:
        backend.set_batch_invariant(was)


@pytest.mark.parametrize("interleave", [False, True])
def test_add_rms_norm_and_latent_refs_are_the_unfused_ops(interleave: bool) -> None:
    """The references spell out the model's former sequence of torch ops."""
    x, r = rand(4, 32, dtype=torch.bfloat16, seed=50), rand(4, 32, dtype=torch.bfloat16, seed=51)
    w = rand(32, dtype=torch.bfloat16, seed=52)
    s, n = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(s, r + x) and torch.equal(n, rms_norm_ref(r + x, w, 1e-6))
    q, kv, nw, cos, sin, cache, slots = _mla_inputs(torch.bfloat16, 0)
    q_pe = mla_rope_cache_ref(q, kv, nw, 1e-6, cos, sin, cache, slots, interleave)
    assert torch.equal(q_pe, apply_rope(q[..., 5:], cos, sin, interleave))
    k_pe = apply_rope(kv[:, 40:], cos, sin, interleave)  # [T, P]
    latent = torch.cat([rms_norm_ref(kv[:, :40], nw, 1e-6), k_pe], dim=-1)  # [T, R + P]
    assert torch.equal(cache[slots], latent)


# ---- the sm_90 PTX (compiled on the CPU, no GPU needed): what the interpreter cannot show -------
# The interpreter runs numpy, so it cannot see the compiler contract a 16-bit multiply and add into
# one fma, nor the order of a row reduction. Compiled here for an H200 (sm_90), the fused kernels'
# RMSNorm must reduce with `invariant._rms_kernel`'s instruction sequence and their RoPE must
# round both products before adding them.
FLOAT_OPS = re.compile(
    r"^\s*(shfl\.sync\.bfly\.b32|add\.f32|mul\.f32|fma\.rn\.f32|div\.full\.f32|sqrt\.rn\.f32"
    r"|bar\.sync|ld\.shared\.b32|st\.shared\.b32)\b",
    re.M,
)
HALF_FMA = re.compile(r"\bfma\.rn(\.ftz)?\.(bf16|f16)(x2)?\b")


def _ptx(fn, args: dict, constexprs: dict, aligned: tuple[int, ...], warps: int) -> str:
    """PTX of a kernel for sm_90: `args` name -> type ("*bf16", "i32", ...), constexprs as given;
    the arguments at `aligned` are divisible by 16 (as the launchers make them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(args, **{k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except Exception as e:  # noqa: BLE001 - no CUDA backend / ptxas in this triton
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {str(e)[:200]}")
    return kernel.asm["ptx"]


def _norm_ops(ptx: str) -> list[str]:
    """The float / reduction instructions up to the 1 / sqrt of the first RMSNorm, in order."""
    ops = FLOAT_OPS.findall(ptx)
    return ops[: ops.index("sqrt.rn.f32") + 2]


def _rms_ptx(dtype: str, block: int) -> str:
    from ddserve.kernels import invariant

    args = dict(x_ptr=dtype, w_ptr=dtype, y_ptr=dtype, D="i32", sx="i32", sy="i32", eps="fp32")
    return _ptx(
        invariant._rms_kernel, args, dict(BLOCK=block), (0, 1, 2, 3, 4, 5), 8 - 4 * (block <= 4096)
    )


@pytest.mark.parametrize("block", [8192, 256])  # K2.6's hidden size; the small test model's
@pytest.mark.parametrize("dtype", ["*bf16", "*fp16"])
def test_add_rms_norm_reduces_as_the_invariant_rms_kernel_on_sm90(dtype: str, block: int) -> None:
    require_triton()
    from ddserve.kernels import fused

    names = ("x_ptr", "r_ptr", "w_ptr", "s_ptr", "y_ptr")
    args = dict(dict.fromkeys(names, dtype), D="i32", sx="i32", sr="i32", eps="fp32")
    warps = 8 - 4 * (block <= 4096)
    ptx = _ptx(fused._add_rms_kernel, args, dict(BLOCK=block), tuple(range(8)), warps)
    assert _norm_ops(ptx) == _norm_ops(_rms_ptx(dtype, block))


@pytest.mark.parametrize("rank,rope", [(512, 64), (64, 16)])  # K2.6; the small test model
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", ["*bf16", "*fp16"])
def test_mla_rope_cache_on_sm90_keeps_torchs_roundings(
    dtype: str, interleave: bool, rank: int, rope: int
) -> None:
    require_triton()
    from ddserve.kernels import fused

    names = ("kv_ptr", "w_ptr", "cos_ptr", "sin_ptr", "slots_ptr", "cache_ptr", "q_ptr", "qpe_ptr")
    args = dict.fromkeys(names, dtype) | dict(slots_ptr="*i64")
    args |= dict.fromkeys(("R", "H", "skv", "scache", "sq", "sqh"), "i32") | dict(eps="fp32")
    consts = dict(Q_OFF=128, P=rope, BLOCK_P=rope, BLOCK_R=rank, BLOCK_H=8,
                  INTERLEAVE=interleave, INTERPRET=False)  # fmt: skip
    ptx = _ptx(fused._mla_rope_cache_kernel, args, consts, (*range(9), 10, 11, 12, 13), 4)
    assert HALF_FMA.findall(ptx) == [], "a 16-bit product and add contracted into one fma"
    assert _norm_ops(ptx) == _norm_ops(_rms_ptx(dtype, rank))


def test_silu_mul_on_sm90_divides_as_torch() -> None:
    require_triton()
    from ddserve.kernels import fused

    args = dict(gu_ptr="*bf16", y_ptr="*bf16", M="i32", N="i32", sg="i32")
    ptx = _ptx(fused._silu_mul_kernel, args, dict(BLOCK=1024, INTERPRET=False), (0, 1, 3, 4), 4)
    assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and not HALF_FMA.findall(ptx)


def round_bf16_to_nearest() -> None:
    """The interpreter casts fp32 to bf16 by truncation; the GPU (cvt.rn) and torch round to
    nearest even. Patched to round, so 16-bit results can be compared bitwise with torch's."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti

    convert = ti._convert_float

    def converted(data, src, dst, rounding_mode):
        nearest = rounding_mode is None or rounding_mode == ti._ir.ROUNDING_MODE.RTNE
        if not (src == tl.float32 and dst == tl.bfloat16 and nearest):
            return convert(data, src, dst, rounding_mode)
        bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        nan = np.isnan(data.astype(np.float32))
        return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)

    ti._convert_float = converted


if __name__ == "__main__":
    patch_interpreter()
    round_bf16_to_nearest()
    print(json.dumps(_run_checks()))
