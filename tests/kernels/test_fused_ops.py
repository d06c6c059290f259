"""Fused elementwise ops (ddserve/kernels/fused.py) in the Triton interpreter, on the CPU.

Each kernel must reproduce the torch sequence it replaces (`fused_ref.py`): bitwise where the
arithmetic is elementwise in 16-bit (the residual add, RoPE, the casts, the cache scatter), and its
RMSNorms bitwise equal to `invariant.rms_norm` run in the same interpreter (the GPU order of the
row reduction is checked by tests/gpu/test_fused_gpu.py; against torch's CPU RMSNorm, whose sum
order differs, the norms are only close). The latent path split around q_b_proj (`mla_latent`,
`invariant.linear_rope`) must give the bits of the ops it replaces, alone and in MLA's forward.
silu_mul's exp is numpy's here, not libdevice's, so against torch's CPU silu it may differ by one
16-bit ulp in rare elements.
The checks run in one subprocess with TRITON_INTERPRET=1 (set before triton is imported), as in
tests/kernels/test_invariant_ops.py. The `*_sm90` tests compile the kernels for an H200 on the CPU
and read the PTX for what numpy cannot show (contracted fmas, the reduction's instructions).
"""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch
import torch.nn.functional as F

from ddserve.kernels import backend
from ddserve.kernels.fused_ref import (
    add_rms_norm_ref,
    apply_rope,
    linear_rope_ref,
    mla_latent_ref,
    mla_rope_cache_ref,
    silu_mul_ref,
)
from ddserve.kernels.invariant_ref import rms_norm_ref
from tests.triton_interp import (
    interpreter_results,
    patch_interpreter,
    require_sm90_compiler,
    require_triton,
    run_cases,
)

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


def check_mla_latent(fused, inv, dtype: torch.dtype, interleave: bool, p: int) -> None:
    """q_a_layernorm and the cache side of `mla_rope_cache` in one launch: the bits of
    `invariant.rms_norm` and of `mla_rope_cache`'s cache rows, with q_a and kv column slices of
    one wider row (as MLA's merged down projection gives them)."""
    q_lora, rank, t = 100, 40, 7
    _, _, w, cos, sin, cache, slots = _mla_inputs(dtype, int(interleave), t=t, rank=rank, p=p)
    both = rand(t, q_lora + rank + p, dtype=dtype, seed=16)  # [T, q_lora + R + P]
    q_a, kv = both[:, :q_lora], both[:, q_lora:]
    qw = rand(q_lora, dtype=dtype, seed=17)
    q = rand(t, 2, 5 + p, dtype=dtype, seed=18)
    want_cache = cache.clone()
    fused.mla_rope_cache(q, kv, w, 1e-6, cos, sin, want_cache, slots, interleave)
    got_cache = cache.clone()
    got = fused.mla_latent(q_a, qw, 1e-5, kv, w, 1e-6, cos, sin, got_cache, slots, interleave)
    assert got.is_contiguous() and torch.equal(got, inv.rms_norm(q_a, qw, 1e-5))
    assert torch.equal(got_cache, want_cache)  # written rows and untouched rows
    ref_cache = cache.clone()
    ref = mla_latent_ref(q_a, qw, 1e-5, kv, w, 1e-6, cos, sin, ref_cache, slots, interleave,
                         rms_norm=inv.rms_norm)  # fmt: skip
    assert torch.equal(got, ref) and torch.equal(got_cache, ref_cache)
    one_cache = cache.clone()  # a row alone
    one = fused.mla_latent(q_a[3:4], qw, 1e-5, kv[3:4], w, 1e-6, cos[3:4], sin[3:4], one_cache,
                           slots[3:4], interleave)  # fmt: skip
    assert torch.equal(one[0], got[3]) and torch.equal(one_cache[slots[3]], got_cache[slots[3]])


def _rope_linear_inputs(dtype, m: int, k: int, heads: int, nope: int, p: int, seed: int):
    x = rand(m, k, dtype=dtype, seed=seed)  # [M, K]
    w = rand(heads * (nope + p), k, dtype=dtype, seed=seed + 1, scale=k**-0.5)  # [N, K]
    ang = torch.rand(m, p, generator=torch.Generator().manual_seed(seed + 2)) * 6.28
    return x, w, ang.cos().to(dtype), ang.sin().to(dtype)  # cos, sin [M, P]


def check_linear_rope(fused, inv, dtype: torch.dtype, interleave: bool, m: int, k: int) -> None:
    """q_b_proj with the query's RoPE in the epilogue: the bits of `linear` then `apply_rope`
    on each head's rope columns (3 heads of 32 + 32: one 32-column tile per rope part), rows
    past one m tile, with and without a K split; a row alone gives its row of the batch."""
    heads, nope, p = 3, 32, 32
    cfg = inv.mm_config(heads * (nope + p), k, dtype)
    assert cfg.block_n == p and (cfg.split > 1) == (k > 512), cfg  # the cases meant
    x, w, cos, sin = _rope_linear_inputs(dtype, m, k, heads, nope, p, seed=60 + m)
    got = inv.linear_rope(x, w, cos, sin, nope, interleave)  # [M, N]
    plain = inv.linear(x, w).view(m, heads, nope + p)
    want = plain.clone()
    want[..., nope:] = apply_rope(plain[..., nope:], cos, sin, interleave)
    assert torch.equal(got.view(m, heads, nope + p), want)
    assert not torch.equal(want, plain)  # the rope columns did rotate
    assert torch.equal(got, linear_rope_ref(x, w, cos, sin, nope, interleave, linear=inv.linear))
    i = m - 1
    one = inv.linear_rope(x[i : i + 1], w, cos[i : i + 1], sin[i : i + 1], nope, interleave)
    assert torch.equal(one[0], got[i])


def check_linear_rope_refuses_split_rope_parts(fused, inv) -> None:
    """Rope parts that are not whole column tiles (here 16 of a 32-column tile) are refused."""
    x, w, cos, sin = _rope_linear_inputs(torch.bfloat16, 3, 64, 4, 16, 16, seed=70)
    try:
        inv.linear_rope(x, w, cos, sin, 16, False)
    except ValueError:
        return
    raise AssertionError("linear_rope took rope parts of half a tile")


@contextlib.contextmanager
def _kernels_on_cpu(fused, inv):
    """Batch-invariant mode with `backend` serving CPU tensors by the Triton kernels (run by
    the interpreter) where it would serve CUDA ones."""
    real = backend._invariant_for, backend._fused_for
    backend._invariant_for = lambda op, t: inv if t.dtype in backend.INVARIANT_DTYPES else None
    backend._fused_for = lambda op, t: fused if t.dtype in backend.HALF else None
    try:
        with backend.invariant_mode(True):
            yield
    finally:
        backend._invariant_for, backend._fused_for = real


def check_mla_forward_same_bits_fused_latent_or_not(fused, inv, interleave: bool) -> None:
    """MLA's forward with the Triton kernels (the interpreter stands in for CUDA; the tree
    attention is the torch reference): the latent path split around q_b_proj (`mla_latent` +
    `linear_rope`) gives the output and cache of rms_norm + q_b_proj + `mla_rope_cache`. Two
    heads of 32 + 32 (one 32-column q_b tile per rope part); a causal block after a prefix and
    a tree block."""
    from ddserve.config import ModelConfig
    from ddserve.distributed import LocalComm
    from ddserve.model.mla import MLA
    from ddserve.model.tiny import TINY_CONFIG
    from tests.model_utils import make_meta

    cfg = ModelConfig.from_hf(dict(TINY_CONFIG, hidden_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, qk_rope_head_dim=32,
                                   rope_interleave=interleave))  # fmt: skip
    layer = MLA(cfg, LocalComm(), torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(80)
    with torch.no_grad():
        for name, prm in layer.named_parameters():
            noise = torch.randn(prm.shape, generator=g)
            scale = prm.shape[-1] ** -0.5
            prm.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * scale)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    meta = make_meta([([0, 1, 2], [10, 11], None), ([3, 4], [12, 13, 14, 15], tree)])
    x = rand(6, 64, dtype=torch.bfloat16, seed=81)  # [T, D]
    ang = torch.rand(6, 32, generator=torch.Generator().manual_seed(82)) * 6.28
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)  # [T, P]
    cache = rand(20, cfg.kv_latent_dim, dtype=torch.bfloat16, seed=83)  # [S, R + P]
    calls = []
    real_linear_rope = inv.linear_rope
    inv.linear_rope = lambda *a: calls.append(a) or real_linear_rope(*a)
    outs = {}
    try:
        with _kernels_on_cpu(fused, inv):
            for on in (True, False):
                layer.latent_fusion = on
                c = cache.clone()
                outs[on] = layer(x, cos, sin, c, meta), c
    finally:
        inv.linear_rope = real_linear_rope
    assert len(calls) == 1, "the split latent path ran once, with latent_fusion on"
    assert torch.equal(outs[True][1], outs[False][1]), "latent cache"
    assert torch.equal(outs[True][0], outs[False][0]), "attention output"


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
    + [(f"mla_latent[{d},interleave={i},P={p}]", check_mla_latent, ("inv", d, i, p))
       for d in HALF for i in (False, True) for p in (8, 12)]
    + [(f"linear_rope[{d},interleave={i},M={m},K={k}]", check_linear_rope, ("inv", d, i, m, k))
       for d in HALF for i in (False, True) for m, k in ((1, 64), (70, 64), (1, 1024), (70, 1024))]
    + [("linear_rope_refuses_split_rope_parts", check_linear_rope_refuses_split_rope_parts,
        ("inv",))]
    + [(f"mla_forward_fused_latent[interleave={i}]",
        check_mla_forward_same_bits_fused_latent_or_not, ("inv", i)) for i in (False, True)]
    + [(f"silu_mul[{d},{n}]", check_silu_mul, (d, n)) for d in HALF for n in (37, 1100)]
)  # fmt: skip


def _run_checks() -> dict[str, str]:
    """In the interpreter subprocess: every case -> "ok" or its failure text."""
    from ddserve.kernels import fused, invariant

    cases = [(n, fn, tuple(invariant if a == "inv" else a for a in args)) for n, fn, args in CASES]
    return run_cases(cases, fused)


@pytest.mark.interpreter
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


def test_backend_keeps_the_latent_path_whole_on_cpu() -> None:
    """On the CPU MLA's latent path is not split around q_b_proj (`fuses_mla_latent`), and the
    split ops, called there, are the torch sequences of the unsplit path."""
    was = backend.batch_invariant()
    backend.set_batch_invariant(True)
    try:
        q_a = rand(7, 24, dtype=torch.bfloat16, seed=44)  # [T, q_lora]
        qw = rand(24, dtype=torch.bfloat16, seed=45)
        q, kv, nw, cos, sin, cache, slots = _mla_inputs(torch.bfloat16, 0)  # q: 3 heads of 5 + 8
        q_b = rand(3 * 13, 24, dtype=torch.bfloat16, seed=46)  # [H * (nope + P), q_lora]
        assert not backend.fuses_mla_latent(q_a, cache, q_b, 5, 8)
        want = cache.clone()
        mla_rope_cache_ref(q, kv, nw, 1e-6, cos, sin, want, slots, True)
        q_n = backend.mla_latent(q_a, qw, 1e-5, kv, nw, 1e-6, cos, sin, cache, slots, True)
        assert torch.equal(cache, want) and torch.equal(q_n, rms_norm_ref(q_a, qw, 1e-5))
        got = backend.linear_rope(q_n, q_b, cos, sin, 5, True).view(7, 3, 13)
        plain = F.linear(q_n, q_b).view(7, 3, 13)
        assert torch.equal(got[..., :5], plain[..., :5])
        assert torch.equal(got[..., 5:], apply_rope(plain[..., 5:], cos, sin, True))
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

    require_sm90_compiler()
    sig = dict(args, **{k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
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


def _second_norm_ops(ptx: str) -> list[str]:
    """The float / reduction instructions after the first RMSNorm's (`_norm_ops`) up to the
    second's 1 / sqrt, barriers left out (the compiler may schedule the second norm's first
    product before the barrier that ends the first norm)."""
    ops = FLOAT_OPS.findall(ptx)
    start = ops.index("sqrt.rn.f32") + 2
    return [op for op in ops[start : ops.index("sqrt.rn.f32", start) + 2] if op != "bar.sync"]


@pytest.mark.parametrize("q_lora,rank,rope", [(1536, 512, 64), (64, 64, 16)])  # K2.6; tiny
@pytest.mark.parametrize("dtype", ["*bf16", "*fp16"])
def test_mla_latent_on_sm90_norms_as_the_invariant_rms_kernel(
    dtype: str, q_lora: int, rank: int, rope: int
) -> None:
    """Both norms of the latent kernel reduce with `_rms_kernel`'s instructions at their own
    block sizes (the q_a norm first; before the kv norm only the q_a norm's scaling may
    come), and the k_pe RoPE rounds both products before adding them."""
    require_triton()
    import triton

    from ddserve.kernels import fused

    names = ("qa_ptr", "qw_ptr", "qn_ptr", "kv_ptr", "w_ptr", "cos_ptr", "sin_ptr", "slots_ptr",
             "cache_ptr")  # fmt: skip
    args = dict.fromkeys(names, dtype) | dict(slots_ptr="*i64")
    args |= dict.fromkeys(("Q", "R", "sqa", "skv", "scache"), "i32")
    args |= dict(q_eps="fp32", eps="fp32")
    block_q, block_r = triton.next_power_of_2(q_lora), triton.next_power_of_2(rank)
    consts = dict(P=rope, BLOCK_P=rope, BLOCK_Q=block_q, BLOCK_R=block_r, INTERLEAVE=True,
                  INTERPRET=False)  # fmt: skip
    ptx = _ptx(fused._mla_latent_kernel, args, consts, tuple(range(14)), 4)
    assert HALF_FMA.findall(ptx) == [], "a 16-bit product and add contracted into one fma"
    assert _norm_ops(ptx) == _norm_ops(_rms_ptx(dtype, block_q))
    kv_norm = _second_norm_ops(ptx)
    want = [op for op in _norm_ops(_rms_ptx(dtype, block_r)) if op != "bar.sync"]
    assert kv_norm[-len(want) :] == want
    assert set(kv_norm[: -len(want)]) <= {"mul.f32"}  # the q_a norm's scaling


def _mm_rope_ptx(split: int, interleave: bool) -> str:
    """`invariant._mm_kernel` with the RoPE epilogue for sm_90 at K2.6's q_b_proj (tp = 8:
    1536 -> 8 heads of 128 + 64, `mm_config`'s 64 x 64 x 64 tiles), pointers and row strides
    16-divisible, unit strides constant, as the JIT specialises `linear_rope`'s launch."""
    import inspect

    from ddserve.kernels import invariant

    consts = dict(K=1536, sxh=0, sxk=1, swh=0, swk=1, syh=0, syn=1, BLOCK_M=64, BLOCK_N=64,
                  BLOCK_K=64, SPLIT=split, K_PER=1536 // split, FP32=False, PRECISION="",
                  INTERPRET=False, REDUCE=True, PF_LINES=0, PF_STEP=64, PDL=False, ADD=False,
                  TOPK=0, srm=0, ROPE=True, NOPE=128, HEAD=192, INTERLEAVE=interleave)  # fmt: skip
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", r_ptr="*bf16", part_ptr="*fp32",
                ticket_ptr="*i32", cos_ptr="*bf16", sin_ptr="*bf16")  # fmt: skip
    names = list(inspect.signature(invariant._mm_kernel.fn).parameters)  # the kernel's order
    args = {n: ptrs.get(n, "i32") for n in names if n not in consts}
    aligned = tuple(i for i, n in enumerate(names) if n in args and n != "M")
    return _ptx(invariant._mm_kernel, args, consts, aligned, 4)


@pytest.mark.parametrize("split", [1, 2])  # 2: K2.6's q_b at decode (the in-kernel split sum)
@pytest.mark.parametrize("interleave", [False, True])
def test_linear_rope_epilogue_on_sm90_rounds_both_products(split: int, interleave: bool) -> None:
    """The epilogue's RoPE compiles for sm_90 (the tile split into rope halves and joined back)
    and keeps torch's roundings: each product a `mul.rn.f32` rounded before the add, no 16-bit
    fma."""
    require_triton()
    ptx = _mm_rope_ptx(split, interleave)
    assert HALF_FMA.findall(ptx) == [], "a 16-bit product and add contracted into one fma"
    assert "mul.rn.f32" in ptx


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
