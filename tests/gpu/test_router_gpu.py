"""The fused MoE router (ddserve/kernels/router.py) and the dense MLP's merged gate/up matmul on a
GPU, at Kimi K2.6 rank shapes (D 7168, E 384, top-8, one group) and DeepSeek-V3's grouped routing
(E 256, 8 groups, best 4).

A token's ids and weights must be bitwise the same whatever else is in the launch (T = 1..600,
alone, other neighbours, inside a CUDA graph); they must match a reference whose gate logits are
computed in float64 (ids equal except where the reference itself has a near-tie, weights to fp32
rounding). Each test collects every failure before it asserts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddserve.kernels import backend, router
from ddserve.kernels.router_ref import RoutingParams, route_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
D = 7168
CASES = {
    "k26": (384, RoutingParams(8, 1, 1, True, 2.827)),
    "grouped": (256, RoutingParams(8, 8, 4, True, 2.5)),
    "k26_no_norm": (384, RoutingParams(8, 1, 1, False, 1.0)),
}
T_LIST = [1, 2, 3, 5, 8, 10, 16, 17, 33, 85, 128, 170, 171, 255, 256, 511]
MAX_T = 600


def inputs(e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [MAX_T, D] bf16 of a hidden state's scale, gate [E, D] fp32, bias [E] fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(MAX_T, D, generator=g, device="cuda").bfloat16()
    w = torch.randn(e, D, generator=g, device="cuda") * (2.0 / D**0.5)
    return x, w, torch.randn(e, generator=g, device="cuda") * 0.05


def f64_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()  # the fp32 rounding of the exact logits


def near_tie(x, w, b, p: RoutingParams, gap: float = 1e-5) -> torch.Tensor:
    """[T] bool: the exact choice scores (or group scores) at the top-k boundary or between two
    chosen experts are within `gap`, so fp32 rounding may legitimately reorder them."""
    choice = (x.double() @ w.double().T).sigmoid() + b.double()  # [T, E]
    top = choice.topk(p.top_k + 1, dim=-1).values  # [T, k + 1]
    tie = (top[:, :-1] - top[:, 1:]).min(-1).values < gap
    if p.topk_group < p.n_group:
        grouped = choice.view(x.shape[0], p.n_group, -1).topk(2, dim=-1).values.sum(-1)
        gtop = grouped.topk(p.topk_group + 1, dim=-1).values  # [T, topk_group + 1]
        tie |= (gtop[:, :-1] - gtop[:, 1:]).min(-1).values < gap
    return tie


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_float64_gate_reference(case: str) -> None:
    e, p = CASES[case]
    x, w, b = inputs(e, seed=1)
    ids, wts = router.route(x, w, b, p)
    ref_ids, ref_wts = route_ref(x, w, b, p, linear=f64_linear)
    differ = (ids != ref_ids).any(-1)  # [T]
    unexplained = (differ & ~near_tie(x, w, b, p)).nonzero().flatten().tolist()
    assert unexplained == [] and int(differ.sum()) <= MAX_T // 50, int(differ.sum())
    same = ~differ
    torch.testing.assert_close(wts[same], ref_wts[same], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["grouped", "k26"])
def test_a_tokens_route_does_not_depend_on_the_other_tokens(case: str) -> None:
    e, p = CASES[case]
    x, w, b = inputs(e, seed=2)
    ids, wts = router.route(x, w, b, p)  # [MAX_T, k]
    bad = []
    for t in T_LIST:
        i, wt = router.route(x[:t], w, b, p)
        if not (torch.equal(i, ids[:t]) and torch.equal(wt, wts[:t])):
            bad.append(f"T={t}")
    for r in (0, 99, 599):
        i, wt = router.route(x[r : r + 1], w, b, p)
        if not (torch.equal(i[0], ids[r]) and torch.equal(wt[0], wts[r])):
            bad.append(f"row {r} alone")
    i, wt = router.route(x[300:470].clone(), w, b, p)  # other neighbours, another buffer
    if not (torch.equal(i, ids[300:470]) and torch.equal(wt, wts[300:470])):
        bad.append("rows 300:470")
    assert bad == []


def test_cuda_graph_replay_gives_the_eager_result() -> None:
    e, p = CASES["k26"]
    x, w, b = inputs(e, seed=3)
    static = x[:17].clone()
    router.route(static, w, b, p)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router.route(static, w, b, p)
    for seed in (4, 5):
        static.copy_(inputs(e, seed=seed)[0][:17])
        graph.replay()
        eager = router.route(static, w, b, p)
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1]), seed


def test_backend_dispatch() -> None:
    """Batch-invariant mode: the fused kernel; otherwise the torch math, bitwise as before."""
    e, p = CASES["grouped"]
    x, w, b = inputs(e, seed=6)
    with backend.invariant_mode(True):
        got = backend.route(x[:10], w, b, p)
    fused = router.route(x[:10], w, b, p)
    assert torch.equal(got[0], fused[0]) and torch.equal(got[1], fused[1])
    with backend.invariant_mode(False):
        got = backend.route(x[:10], w, b, p)
    ref = route_ref(x[:10], w, b, p, linear=F.linear, row_sum=lambda v: v.sum(-1, keepdim=True))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_dense_mlp_merged_gate_up_is_row_invariant_and_close_to_two_matmuls() -> None:
    """The K2.6 shared expert at tp = 8 (I_local 256): one [512, D] matmul on the invariant path."""
    from ddserve.distributed import LocalComm
    from ddserve.model.moe import DenseMLP

    mlp = DenseMLP(D, 256, LocalComm(), torch.bfloat16, "cuda", reduce=False)
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for prm in mlp.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, device="cuda") * prm.shape[1] ** -0.5)
    x = torch.randn(MAX_T, D, generator=g, device="cuda").bfloat16()
    assert mlp.gate_up_weight() is not None
    with backend.invariant_mode(True):
        full = mlp(x)  # [MAX_T, D]
        bad = [t for t in T_LIST if not torch.equal(mlp(x[:t]), full[:t])]
    assert bad == []
    with backend.invariant_mode(False):
        two = mlp(x)  # torch, two matmuls
    torch.testing.assert_close(full.float(), two.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("case", ["k26", "grouped"])
def test_bf16_gate_matches_the_reference_and_is_row_invariant(case: str) -> None:
    """A gate whose values are bf16 (as checkpoints store it), passed as bf16: bf16 tensor-core
    products, the float64 reference's ids and weights, and the same bits at every T."""
    e, p = CASES[case]
    x, w, b = inputs(e, seed=7)
    w16 = w.bfloat16()
    w = w16.float()  # the same values in fp32
    ids, wts = router.route(x, w16, b, p)
    ref_ids, ref_wts = route_ref(x, w, b, p, linear=f64_linear)
    differ = (ids != ref_ids).any(-1)
    unexplained = (differ & ~near_tie(x, w, b, p)).nonzero().flatten().tolist()
    assert unexplained == [] and int(differ.sum()) <= MAX_T // 50, int(differ.sum())
    torch.testing.assert_close(wts[~differ], ref_wts[~differ], atol=2e-6, rtol=1e-5)
    bad = []
    for t in T_LIST:
        i, wt = router.route(x[:t], w16, b, p)
        if not (torch.equal(i, ids[:t]) and torch.equal(wt, wts[:t])):
            bad.append(f"T={t}")
    i, wt = router.route(x[300:470].clone(), w16, b, p)
    if not (torch.equal(i, ids[300:470]) and torch.equal(wt, wts[300:470])):
        bad.append("rows 300:470")
    assert bad == []


def test_model_router_reads_an_exact_bf16_copy_of_its_gate() -> None:
    """`Router.gate_for` on the fused path: a bf16 copy when the fp32 gate holds bf16 values, the
    fp32 gate when it does not, rebuilt after the gate is written; fp32 x keeps the fp32 gate."""
    from ddserve.config import ModelConfig
    from ddserve.model.moe import Router

    e, p = CASES["k26"]
    cfg = ModelConfig.from_hf(dict(hidden_size=D, n_routed_experts=e, num_experts_per_tok=8,
                                   n_group=1, topk_group=1))  # fmt: skip
    r = Router(cfg, torch.bfloat16, "cuda")
    x, w, b = inputs(e, seed=8)
    with torch.no_grad():
        r.weight.copy_(w.bfloat16().float())
        r.e_score_correction_bias.copy_(b)
    with backend.invariant_mode(True):
        g = r.gate_for(x)
        assert g.dtype == torch.bfloat16 and torch.equal(g.float(), r.weight)
        assert r.gate_for(x) is g  # cached
        assert r.gate_for(x.float()) is r.weight
        ids, wts = r(x[:17])
        ref = router.route(x[:17], r.weight, b, r.params)  # tf32x3 on the same values
        assert (ids != ref[0]).any(-1).sum() <= 1
        with torch.no_grad():
            r.weight.copy_(w)  # not bf16 values
        assert r.gate_for(x) is r.weight
    with backend.invariant_mode(False):
        assert r.gate_for(x) is r.weight


def _k26_router(seed: int):
    from ddserve.config import ModelConfig
    from ddserve.model.moe import Router

    e, _ = CASES["k26"]
    cfg = ModelConfig.from_hf(dict(hidden_size=D, n_routed_experts=e, num_experts_per_tok=8,
                                   n_group=1, topk_group=1))  # fmt: skip
    r = Router(cfg, torch.bfloat16, "cuda")
    x, w, b = inputs(e, seed=seed)
    with torch.no_grad():
        r.weight.copy_(w.bfloat16().float())
        r.e_score_correction_bias.copy_(b)
    return r, x, w


def _capture(r, static):
    router.route(static, r.weight, r.e_score_correction_bias, r.params)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = r(static)
    return graph, out


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_gate_written_after_capture_routes_alike_in_graph_and_eager(monkeypatch) -> None:
    """Eager first (the bf16 copy), then a capture, then new bf16-valued gate values written in
    place: the copy is refreshed in place, so the graph's replay equals the eager forward."""
    r, x, w = _k26_router(seed=10)
    static = x[:5].clone()
    with backend.invariant_mode(True):
        r(static)
        graph, captured = _capture(r, static)
        with torch.no_grad():
            r.weight.copy_((w * 1.5).bfloat16().float())
        eager = r(static)
        assert r.gate_for(static).dtype == torch.bfloat16
        graph.replay()
        assert _same(captured, eager)
        with torch.no_grad():
            r.weight.add_(0.0)  # written since the copy: using it in a capture is an error
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="eager forward"):
            r.gate_for(static)
    del graph


def test_a_first_gate_use_inside_a_capture_keeps_the_fp32_gate_everywhere() -> None:
    """No exactness check can run inside a capture: the captured forward reads the fp32 gate,
    and so does every forward after it, also after the gate is written."""
    r, x, w = _k26_router(seed=9)
    static = x[:5].clone()
    with backend.invariant_mode(True):
        graph, captured = _capture(r, static)
        assert r.gate_for(static) is r.weight
        with torch.no_grad():
            r.weight.copy_((w * 1.5).bfloat16().float())
        assert r.gate_for(static) is r.weight
        graph.replay()
        assert _same(captured, r(static))
    del graph
