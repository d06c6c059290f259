"""Batch-invariant dense ops on a GPU at K2.6-like shapes; DDTree == AR in bf16 through the engine.

Op tests: a row's bits must not depend on how many rows share the launch (M = 1..600), and the
kernels must match float64 within bf16 tolerance. Each test collects every failing M before it
asserts, so one device run tells the whole story. The engine test needs the attention and MoE
kernels' invariant modes too; it reports which streams differ and where.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import run_all

from ddserve.drafter.testing import OracleDrafter
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels import backend
from ddserve.model.tiny import make_tiny
from ddserve.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
M_LIST = [*range(1, 41), 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 400, 511, 512, 513, 599]
MAX_M = 600
PROMPTS = [list(range(5 + 7 * i, 5 + 7 * i + 3 + 5 * i)) for i in range(8)]


def rand(*shape, dtype=torch.bfloat16, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def differing_m(fn, x: torch.Tensor, *args) -> list[int]:
    """M values whose rows differ from the same rows computed in the MAX_M-row launch."""
    full = fn(x, *args)
    return [m for m in M_LIST if not torch.equal(fn(x[:m], *args), full[:m])]


LINEARS = [  # (name, N, K, dtype) at tp = 1
    ("q_a_proj", 1536, 7168, torch.bfloat16),
    ("kv_a_proj", 576, 7168, torch.bfloat16),
    ("q_b_proj", 12288, 1536, torch.bfloat16),
    ("o_proj", 7168, 8192, torch.bfloat16),
    ("dense_down", 7168, 18432, torch.bfloat16),
    ("lm_head_slice", 32768, 7168, torch.bfloat16),
    ("fp16", 4096, 7168, torch.float16),
    ("router_fp32", 384, 7168, torch.float32),
]


@pytest.mark.parametrize("name,n,k,dtype", LINEARS, ids=[c[0] for c in LINEARS])
def test_linear_rows_do_not_depend_on_m(name: str, n: int, k: int, dtype) -> None:
    from ddserve.kernels.invariant import linear

    x, w = rand(MAX_M, k, dtype=dtype, seed=1), rand(n, k, dtype=dtype, scale=k**-0.5, seed=2)
    assert differing_m(linear, x, w) == []
    expected = x[:64].double() @ w.double().T
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(linear(x[:64], w).double(), expected, **tol)


@pytest.mark.parametrize("n,k", [(7168, 256), (1536, 7168)], ids=["shared_down", "split_k"])
def test_linear_with_add_is_linear_then_torch_add_bit_for_bit(n: int, k: int) -> None:
    """The residual epilogue (the MoE adds its routed output in the shared expert's down
    matmul) gives torch's `linear(x, w) + add` exactly, at every M, with a K split or without."""
    from ddserve.kernels.invariant import linear

    x, w = rand(MAX_M, k, seed=3), rand(n, k, scale=k**-0.5, seed=4)
    add = rand(MAX_M, n, seed=5)
    fused = {m: linear(x[:m], w, add[:m]) for m in M_LIST}
    assert [m for m in M_LIST if not torch.equal(fused[m], linear(x[:m], w) + add[:m])] == []


@pytest.mark.parametrize("pair_dtype", [torch.bfloat16, torch.float32])
def test_topk_epilogue_is_the_moe_combine_then_the_add_bit_for_bit(pair_dtype) -> None:
    """The shared expert's down matmul at K2.6 rank shapes (K = 256, N = 7168) adding the MoE's
    top-8 pair outputs (`add_topk`: their slot-order sum in its epilogue) gives exactly what the
    launches it replaces give (`moe_reduce._combine_kernel`, then the add epilogue), at every
    M, for bf16 and fp32 pairs (`moe_v3` PAIRS)."""
    from ddserve.kernels.invariant import linear
    from ddserve.kernels.moe_reduce import _combine_kernel

    n, k, topk = 7168, 256, 8
    x, w = rand(MAX_M, k, seed=6), rand(n, k, scale=k**-0.5, seed=7)
    pairs = rand(MAX_M * topk, n, dtype=pair_dtype, scale=0.1, seed=8)
    combined = torch.empty(MAX_M, n, dtype=torch.bfloat16, device="cuda")
    _combine_kernel[(MAX_M, 7)](pairs, combined, n, pairs.stride(0), combined.stride(0), TOPK=topk,
                                BC=1024, PDL=False)  # fmt: skip
    bad = []
    for m in M_LIST:
        want = linear(x[:m], w, combined[:m])
        if not torch.equal(linear(x[:m], w, pairs[: m * topk], add_topk=topk), want):
            bad.append(m)
    assert bad == []


SET_SHAPES = [  # (name, N, K, dtype): one rank at tp = 8
    ("lm_head", 20480, 7168, torch.bfloat16),
    ("q_a_proj", 1536, 7168, torch.bfloat16),
    ("dense_down", 7168, 2304, torch.bfloat16),
    ("router_fp32", 384, 7168, torch.float32),
]
SET_M = [1, 2, 17, 63, 64, 65, 127, 128, 129, 257, 520, 599]


def test_prefill_configuration_keeps_rows_independent_of_m() -> None:
    """Prompt chunks (`backend.prefill_phase()`, large tiles, no K split): the same bitwise row
    invariance and accuracy at one rank's shapes at tp = 8."""
    from ddserve.kernels import invariant

    bad = {}
    with backend.prefill_phase():
        for name, n, k, dtype in SET_SHAPES:
            x = rand(MAX_M, k, dtype=dtype, seed=11)
            w = rand(n, k, dtype=dtype, scale=k**-0.5, seed=12)
            full = invariant.linear(x, w)  # [600, N]
            diff = [m for m in SET_M if not torch.equal(invariant.linear(x[:m], w), full[:m])]
            ref = x[:64].double() @ w.double().T  # [64, N]
            t = 1e-4 if dtype == torch.float32 else 2e-2  # atol = rtol = t
            err = float(((full[:64].double() - ref).abs() / (t + t * ref.abs())).max())
            if diff or err > 1:
                bad[name] = {"differing_m": diff, "err_over_tolerance": err}
    assert bad == {}


def test_unaligned_or_strided_x_gives_the_same_rows() -> None:
    """_launch copies an x whose base is not 16-byte aligned and gives a size-1 leading dim its
    contiguous stride, so such calls run the same binary (and bits) as a contiguous x."""
    from ddserve.kernels.invariant import bmm_heads, linear

    w = rand(1536, 7168, scale=7168**-0.5, seed=13)
    buf = rand(40, 7169, seed=14)  # [40, 7169]: x = buf[:, 1:] is unaligned and strided
    x = buf[:, 1:]  # [40, 7168]
    full = linear(x.contiguous(), w)  # [40, 1536]
    assert torch.equal(linear(x, w), full)
    assert torch.equal(linear(x[3:4], w), full[3:4])
    assert torch.equal(linear(x.contiguous().as_strided((1, 7168), (5, 1), 3 * 7168), w), full[3:4])
    wb = rand(8, 128, 512, scale=128**-0.5, seed=15)  # [H, K, N]
    q = rand(6, 8, 192, seed=16)[..., :128]  # [T, H, 128]: MLA's q_nope slice
    fb = bmm_heads(q.contiguous(), wb)
    assert torch.equal(bmm_heads(q, wb), fb) and torch.equal(bmm_heads(q[2:3], wb), fb[2:3])


@pytest.mark.parametrize("which", ["q_absorb", "o_absorb"])
def test_bmm_heads_rows_do_not_depend_on_m(which: str) -> None:
    from ddserve.kernels.invariant import bmm_heads

    kv_b = rand(64, 256, 512, scale=512**-0.5, seed=3)  # [H, nope + v, R]
    if which == "q_absorb":
        x, w = rand(MAX_M, 64, 128, seed=4), kv_b[:, :128]  # W_UK [H, nope, R]
    else:
        x, w = rand(MAX_M, 64, 512, seed=4), kv_b[:, 128:].transpose(1, 2)  # W_UV^T [H, R, v]
    assert differing_m(bmm_heads, x, w) == []
    expected = torch.einsum("thk,hkn->thn", x[:32].double(), w.double())
    torch.testing.assert_close(bmm_heads(x[:32], w).double(), expected, atol=2e-2, rtol=2e-2)


SPLIT_SHAPES = [  # (name, heads, N, K, dtype, forced split or None): one rank at tp = 8
    ("q_a", 1, 1536, 7168, torch.bfloat16, None),
    ("q_a", 1, 1536, 7168, torch.bfloat16, 16),
    ("o_proj", 1, 7168, 1024, torch.bfloat16, None),
    ("shared_gate_up", 1, 512, 7168, torch.bfloat16, None),
    ("absorb_uv", 8, 128, 512, torch.bfloat16, 4),
    ("router_fp32", 1, 384, 7168, torch.float32, None),
]


def _split_mm(x, w, heads: int, split: int | None, two_launch: bool):
    """y from `invariant._launch` (w [N, K] for heads = 1, else [H, K, N]) and the fp32
    partials it left in the scratch [S, *y.shape] (None without a split)."""
    from ddserve.kernels import invariant

    n, k = (w.shape[0], w.shape[1]) if heads == 1 else (w.shape[2], w.shape[1])
    cfg = invariant.mm_config(n, k, x.dtype, heads)
    cfg = cfg if split is None else cfg._replace(split=split)
    shape = (x.shape[0], n) if heads == 1 else (x.shape[0], heads, n)
    y = torch.empty(shape, dtype=x.dtype, device="cuda")
    strides = (0, w.stride(1), w.stride(0)) if heads == 1 else w.stride()
    invariant._launch(x, w, y, strides, heads, cfg, two_launch)
    stride = -(-y.numel() // 16) * 16
    if cfg.split == 1 or 4 * cfg.split * stride > invariant._Scratch.PARTIALS_MAX:
        return y, None  # no partials, or the call's own (not kept)
    part = invariant._SCRATCH[y.device].partials
    return y, part[: cfg.split * stride].view(cfg.split, stride)[:, : y.numel()].reshape(
        cfg.split, *shape
    )


@pytest.mark.parametrize("name,heads,n,k,dtype,split", SPLIT_SHAPES,
                         ids=[f"{c[0]}-split{c[5]}" for c in SPLIT_SHAPES])  # fmt: skip
def test_split_k_in_kernel_sum_equals_two_launch_sum(name, heads, n, k, dtype, split) -> None:
    """The last-ticket program's split-order sum: bitwise the `_sum_splits_kernel` result and
    `split_sum_ref` of the same partials, at every M, 20 launches in a row (a race would show
    as a launch that differs), tickets all 0 afterwards."""
    from ddserve.kernels import invariant
    from ddserve.kernels.invariant_ref import split_sum_ref

    x = rand(600, heads, k, dtype=dtype, seed=21) if heads > 1 else rand(600, k, dtype=dtype,
                                                                         seed=21)  # fmt: skip
    w = rand(heads, n, k, dtype=dtype, scale=k**-0.5, seed=22).transpose(1, 2) if heads > 1 else (
        rand(n, k, dtype=dtype, scale=k**-0.5, seed=22))  # fmt: skip
    bad = {}
    for m in (1, 10, 17, 170, 599):
        fused, parts = _split_mm(x[:m], w, heads, split, False)
        ref = split_sum_ref(parts, dtype) if parts is not None else fused
        two, _ = _split_mm(x[:m], w, heads, split, True)
        repeats = (_split_mm(x[:m], w, heads, split, False)[0] for _ in range(20))
        again = [i for i, y in enumerate(repeats) if not torch.equal(y, fused)]
        if not (torch.equal(fused, two) and torch.equal(fused, ref)) or again:
            bad[m] = {"eq_two_launch": torch.equal(fused, two), "eq_ref": torch.equal(fused, ref),
                      "differing_repeats": len(again)}  # fmt: skip
    scratch = invariant._SCRATCH.get(x.device)
    assert scratch is None or int(scratch.tickets.abs().sum()) == 0
    assert bad == {}


def test_split_k_graph_replays_stay_exact_after_the_scratch_grows() -> None:
    """A captured split matmul replays with fresh inputs bitwise like eager calls, also after an
    eager call grew the scratch (the graph keeps using the buffers it was captured with)."""
    from ddserve.kernels import invariant
    from ddserve.kernels.invariant import linear

    w = rand(1536, 7168, scale=7168**-0.5, seed=23)  # q_a: split K
    split = invariant.mm_config(1536, 7168, torch.bfloat16).split
    assert split > 1
    invariant._SCRATCH.pop(w.device, None)  # a fresh scratch: its first size is known
    static = rand(10, 7168, seed=24)  # [10, K]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear(static, w)  # warm-up: compile, scratch sized outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(static, w)  # [10, 1536]
    for seed in (25, 26):
        static.copy_(rand(10, 7168, seed=seed))
        graph.replay()
        assert torch.equal(out, linear(static, w)), seed
    scratch = invariant._SCRATCH[w.device]
    before = scratch.partials
    big = rand(before.numel() // (1536 * split) + 64, 7168, seed=27)  # outgrows the partials
    linear(big, w)
    assert scratch.partials is not before
    static.copy_(rand(10, 7168, seed=28))
    graph.replay()
    assert torch.equal(out, linear(static, w))
    torch.cuda.synchronize()
    assert int(scratch.tickets.abs().sum()) == 0


@pytest.mark.parametrize("d,strided", [(7168, False), (1536, False), (512, True)])
def test_rms_norm_rows_do_not_depend_on_m(d: int, strided: bool) -> None:
    from ddserve.kernels.invariant import rms_norm
    from ddserve.kernels.invariant_ref import rms_norm_ref

    x = rand(MAX_M, d + 64, seed=5)[:, :d] if strided else rand(MAX_M, d, seed=5)
    w = rand(d, seed=6)
    assert differing_m(rms_norm, x, w, 1e-6) == []
    got, ref = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_row_sum8_is_fixed_order_sum_for_every_m() -> None:
    from ddserve.kernels.invariant import row_sum8
    from ddserve.kernels.invariant_ref import fixed_order_sum

    x = torch.rand(MAX_M, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    assert differing_m(row_sum8, x) == []
    assert torch.equal(row_sum8(x), fixed_order_sum(x))


def test_backend_picks_triton_only_in_invariant_mode() -> None:
    from ddserve.kernels.invariant import linear

    x, w = rand(7, 512, seed=7), rand(256, 512, scale=512**-0.5, seed=8)
    was = backend.batch_invariant()
    try:
        backend.set_batch_invariant(True)
        assert torch.equal(backend.linear(x, w), linear(x, w))
        backend.set_batch_invariant(False)
        assert torch.equal(backend.linear(x, w), F.linear(x, w))
    finally:
        backend.set_batch_invariant(was)


def _decode(runner: ModelRunner, speculative: bool, budget: int | None = None) -> list[list[int]]:
    return run_all(runner, PROMPTS, SamplingParams(max_tokens=48), speculative, budget)


def _first_diffs(got: list[list[int]], ref: list[list[int]]) -> dict[int, int]:
    """stream -> first differing position, for the streams that differ."""
    diffs = {}
    for s, (g, r) in enumerate(zip(got, ref, strict=True)):
        pos = next((i for i, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), None)
        if pos is not None or len(g) != len(r):
            diffs[s] = pos if pos is not None else min(len(g), len(r))
    return diffs


def test_ddtree_equals_ar_in_bf16_with_batch_invariant_kernels(tmp_path) -> None:
    model = make_tiny(tmp_path / "tiny", int4=True, seed=0)
    cfg = EngineConfig(num_slots=8192, budget=32, dtype="bfloat16", batch_invariant=True)
    ref = _decode(ModelRunner(model, engine_cfg=cfg, device="cuda"), False)
    table = {tuple(p): r for p, r in zip(PROMPTS, ref, strict=True)}
    report = {}
    for budget in (4, 32):
        for kind in ("dflash", "oracle"):
            drafter = (
                model / "drafter"
                if kind == "dflash"
                else OracleDrafter(table, 264, depth=7, corrupt=0.3, seed=1)
            )
            runner = ModelRunner(model, engine_cfg=cfg, drafter=drafter, device="cuda")
            got = _decode(runner, True, budget)
            report[f"{kind}/budget={budget}"] = _first_diffs(got, ref)
    assert all(not d for d in report.values()), f"stream -> first differing token: {report}"
