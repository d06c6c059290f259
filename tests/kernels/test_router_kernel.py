"""The fused MoE router (ddserve/kernels/router.py) in the Triton interpreter, on the CPU, against
its torch reference (`router_ref.route_ref`); plus the torch-side contracts of the routing and of
the dense MLP's merged gate/up weight.

The kernel checks run in one subprocess with TRITON_INTERPRET=1 (set before triton is imported),
as tests/kernels/test_invariant_ops.py does: the process runs this file as a script, calls every
`check_*` function and prints one JSON line of results. Ids must equal the reference's on random
inputs (no near-ties there), weights match to fp32 rounding, and a token's ids and weights must be
bitwise the same alone as among any other tokens. tests/gpu/test_router_gpu.py repeats the checks
on the GPU at Kimi K2.6 shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddserve.kernels import backend
from ddserve.kernels.router_ref import RoutingParams, route_ref
from tests.triton_interp import interpreter_results, patch_interpreter, require_triton, run_cases

ROOT = Path(__file__).resolve().parents[2]

# name -> (T, E, D, params): ungrouped and grouped, odd T, E, D and group sizes
SHAPES = {
    "ungrouped": (37, 45, 300, RoutingParams(6, 1, 1, True, 2.5)),
    "ungrouped_k8_e384": (19, 384, 520, RoutingParams(8, 1, 1, True, 2.827)),
    "grouped": (21, 42, 100, RoutingParams(5, 6, 3, True, 1.5)),
    "grouped_no_norm": (9, 42, 133, RoutingParams(5, 6, 3, False, 1.0)),
    "grouped_pow2": (17, 64, 96, RoutingParams(8, 8, 4, True, 2.5)),
    "no_norm_k1": (5, 13, 70, RoutingParams(1, 1, 1, False, 1.0)),
}


def inputs(t: int, e: int, d: int, seed: int, dtype=torch.bfloat16):
    """x [T, D] in `dtype`, gate [E, D] fp32 (logits of order 1), bias [E] fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    w = torch.randn(e, d, generator=g) / d**0.5
    return x, w, torch.randn(e, generator=g) * 0.1


def check_matches_reference(router, name: str) -> None:
    t, e, d, p = SHAPES[name]
    x, w, b = inputs(t, e, d, seed=len(name))
    ids, wts = router.route(x, w, b, p)
    ref_ids, ref_wts = route_ref(x, w, b, p)
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32 and ids.shape == (t, p.top_k)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(wts, ref_wts, atol=1e-6, rtol=1e-5)


def check_row_alone_equals_row_among_others(router, name: str) -> None:
    t, e, d, p = SHAPES[name]
    x, w, b = inputs(t, e, d, seed=100 + len(name))
    ids, wts = router.route(x, w, b, p)  # [T, k] each
    for i in sorted({0, 1, t // 2, t - 2, t - 1}):  # first, second, a middle and the last rows
        alone = router.route(x[i : i + 1], w, b, p)
        assert torch.equal(alone[0][0], ids[i]) and torch.equal(alone[1][0], wts[i]), i
    sub = router.route(x[3:t], w, b, p)  # other neighbours, other token tiles
    assert torch.equal(sub[0], ids[3:]) and torch.equal(sub[1], wts[3:])


def check_config_with_k_loop_and_splits(router) -> None:
    """A configuration with several K steps per split, an unroll of 2, three splits (the last
    one partly past D) and small token tiles: still the reference's ids, still row-invariant."""
    p = RoutingParams(6, 3, 2, True, 2.0)
    cfg = router.RouterConfig(block_t=4, block_e=8, block_k=16, unroll=2, split=3, warps=4)
    x, w, b = inputs(11, 45, 300, seed=7, dtype=torch.float32)
    _reference_ids_and_row_invariant(router, x, w, b, p, cfg, rows=(0, 5, 10))


def check_tensor_core_config(router) -> None:
    """The `mma` configuration (tf32x3 tensor-core products per K step; here the interpreter's
    dot, patched to a position-independent product): the reference's ids, row-invariant."""
    p = RoutingParams(6, 1, 1, True, 2.5)
    cfg = router.RouterConfig(16, 16, 16, 2, 3, 4, mma=True)
    x, w, b = inputs(21, 45, 300, seed=12)
    _reference_ids_and_row_invariant(router, x, w, b, p, cfg, rows=(0, 17, 20))


def check_bf16_gate(router) -> None:
    """A gate stored in bf16 (values exact in bf16) with bf16 x: the tensor-core form takes bf16
    products (exact) and the FMA form widens the weight; both give the fp32 reference's ids and
    weights and are row-invariant."""
    p = RoutingParams(6, 1, 1, True, 2.5)
    x, w, b = inputs(18, 45, 120, seed=13)
    w16 = w.bfloat16()
    for cfg in (router.RouterConfig(16, 16, 16, 2, 3, 4, mma=True),
                router.RouterConfig(4, 8, 16, 2, 3, 4)):  # fmt: skip
        _reference_ids_and_row_invariant(router, x, w16, b, p, cfg, rows=(0, 17))
        ref = router.route(x, w16.float(), b, p, cfg)  # the same values as an fp32 gate
        assert torch.equal(router.route(x, w16, b, p, cfg)[0], ref[0]), cfg


def _reference_ids_and_row_invariant(router, x, w, b, p, cfg, rows) -> None:
    """With configuration `cfg`: the reference's ids, its weights to fp32 rounding, and each of
    `rows` routed alone equal to the same row in the batch, bit for bit."""
    ids, wts = router.route(x, w, b, p, cfg)
    ref_ids, ref_wts = route_ref(x, w, b, p)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_wts, atol=1e-6, rtol=1e-5)
    for i in rows:
        alone = router.route(x[i : i + 1], w, b, p, cfg)
        assert torch.equal(alone[0][0], ids[i]) and torch.equal(alone[1][0], wts[i]), i


def check_ties_go_to_the_lower_expert(router) -> None:
    """Experts 3 and 10 have the same gate row and bias, so the same score bit for bit: both are
    chosen, 3 first, with equal weights."""
    t, e, d, p = 4, 16, 64, RoutingParams(4, 1, 1, True, 1.0)
    x, w, b = inputs(t, e, d, seed=8)
    x = x.abs()
    w[3] = w[10] = 0.05
    b[3] = b[10] = 0.0
    ids, wts = router.route(x, w, b, p)
    assert ids[:, :2].tolist() == [[3, 10]] * t, ids
    assert torch.equal(wts[:, 0], wts[:, 1])


def check_no_tokens_and_preconditions(router) -> None:
    _, e, d, p = SHAPES["grouped"]
    x, w, b = inputs(1, e, d, seed=9)
    ids, wts = router.route(x[:0], w, b, p)
    assert ids.shape == (0, p.top_k) and wts.shape == (0, p.top_k)
    for bad in ((x, w.half(), b), (x, w, b[:-1]), (x[:, :-1], w, b)):
        try:
            router.route(*bad, p)
        except AssertionError:
            continue
        raise AssertionError("a bad argument was accepted")


CASES = (
    [(f"matches_reference[{n}]", check_matches_reference, (n,)) for n in SHAPES]
    + [(f"row_invariant[{n}]", check_row_alone_equals_row_among_others, (n,))
       for n in ("ungrouped", "grouped", "grouped_pow2")]
    + [("config_with_k_loop_and_splits", check_config_with_k_loop_and_splits, ())]
    + [("tensor_core_config", check_tensor_core_config, ())]
    + [("bf16_gate", check_bf16_gate, ())]
    + [("ties_go_to_the_lower_expert", check_ties_go_to_the_lower_expert, ())]
    + [("no_tokens_and_preconditions", check_no_tokens_and_preconditions, ())]
)  # fmt: skip


def _run_checks() -> dict[str, str]:
    """In the interpreter subprocess: every case -> "ok" or its failure text."""
    from ddserve.kernels import router

    return run_cases(CASES, router)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


@pytest.mark.parametrize("invariant", [False, True])
def test_route_on_cpu_is_the_torch_math(invariant: bool) -> None:
    """On the CPU `backend.route` is `route_ref` with torch's linear, in both modes (the CPU
    forwards stay bitwise what they were)."""
    _, e, d, p = SHAPES["grouped"]
    x, w, b = inputs(7, e, d, seed=11)
    with backend.invariant_mode(invariant):
        ids, wts = backend.route(x, w, b, p)
    rows = (lambda v: v.sum(-1, keepdim=True)) if not invariant else None
    ref_ids, ref_wts = route_ref(x, w, b, p, F.linear, *([rows] if rows else []))
    assert torch.equal(ids, ref_ids) and torch.equal(wts, ref_wts)


def test_router_reads_the_fp32_gate_off_the_fused_path() -> None:
    """`Router.gate_for`: the fp32 parameter itself on the CPU, in either mode (the bf16 copy is
    only for the fused CUDA router; tests/gpu/test_router_gpu.py checks that side)."""
    from ddserve.config import ModelConfig
    from ddserve.model.moe import Router

    cfg = ModelConfig.from_hf(
        dict(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
    )
    r = Router(cfg, torch.bfloat16, "cpu")
    with torch.no_grad():
        r.weight.copy_(torch.randn(8, 32).bfloat16().float())  # exact in bf16
    for invariant in (False, True):
        with backend.invariant_mode(invariant):
            assert r.gate_for(torch.zeros(3, 32, dtype=torch.bfloat16)) is r.weight


def test_dense_mlp_gate_and_up_are_views_of_one_buffer() -> None:
    from ddserve.distributed import LocalComm
    from ddserve.model.moe import DenseMLP

    mlp = DenseMLP(24, 40, LocalComm(), torch.float32, "cpu")
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    with torch.no_grad():
        gate.normal_()
        up.normal_()
    assert torch.equal(mlp.gate_up_weight(), torch.cat([gate, up]))
    mlp.up_proj.weight = torch.nn.Parameter(up.clone(), requires_grad=False)
    assert mlp.gate_up_weight() is None  # replaced: the two-matmul path


def test_loading_a_checkpoint_fills_the_merged_gate_up(tmp_path) -> None:
    from safetensors.torch import load_file

    from ddserve.model.loader import load_model
    from ddserve.model.moe import DenseMLP
    from ddserve.model.tiny import write_tiny

    path = write_tiny(tmp_path, seed=3)
    model, cfg = load_model(path, dtype=torch.float32, progress=False)
    ckpt = {}
    for f in sorted(path.glob("*.safetensors")):
        ckpt.update(load_file(f))
    mlps = {n: m for n, m in model.named_modules() if isinstance(m, DenseMLP)}
    assert any(".shared_experts" in n for n in mlps) and any(n.endswith(".mlp") for n in mlps)
    for name, mlp in mlps.items():
        stem = cfg.weight_prefix + name
        gate, up = ckpt[stem + ".gate_proj.weight"].float(), ckpt[stem + ".up_proj.weight"].float()
        merged = mlp.gate_up_weight()
        assert merged is not None, name
        assert torch.equal(merged, torch.cat([gate, up])), name


def test_bench_smoke_run_writes_its_json(tmp_path) -> None:
    """bench/bench_router.py --smoke: tiny shapes on the CPU under the interpreter."""
    require_triton()
    out = tmp_path / "router.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "bench" / "bench_router.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shapes = json.loads(out.read_text())["shapes"]
    assert shapes
    for rec in shapes.values():
        assert set(rec["variants"]) == {"fused", "torch_invariant", "torch"}
        assert rec["variants"]["fused"]["differing_t"] == []
        assert all("error" not in v and len(v["us"]) == 3 for v in rec["variants"].values())


if __name__ == "__main__":  # the interpreter subprocess
    patch_interpreter()
    print(json.dumps(_run_checks()))


def test_loading_a_checkpoint_writes_through_the_parameters(tmp_path) -> None:
    """The loader writes through each parameter (not its .data), so a reload bumps the version
    that caches derived from a weight check (`Router.gate_for`'s bf16 copy)."""
    from ddserve.model.loader import load_checkpoint, load_model
    from ddserve.model.moe import Router
    from ddserve.model.tiny import write_tiny

    path = write_tiny(tmp_path, seed=4)
    model, _ = load_model(path, dtype=torch.float32, progress=False)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers
    before = [r.weight._version for r in routers]
    load_checkpoint(model, path, progress=False)
    assert all(r.weight._version > v for r, v in zip(routers, before, strict=True))
