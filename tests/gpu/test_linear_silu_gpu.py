"""The shared expert's gate/up matmul with silu(gate) * up in its epilogue (`invariant.linear_silu`,
`backend.linear_silu`) on the GPU: bitwise the two launches it replaces (`invariant.linear` of the
stacked weight, then `fused.silu_mul`) at K2.6 rank shapes (tp = 8) for every row count 1..170,
eager, on the side stream and replayed from a CUDA graph; `DenseMLP.activation` the same bits
as before. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ddserve.distributed import LocalComm
from ddserve.kernels import backend, fused, invariant
from ddserve.kernels.config import KernelConfig
from ddserve.model.moe import DenseMLP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
D = 7168
SHAPES = {"shared": 256, "dense_layer0": 18432 // 8}  # I per rank at tp = 8 (stacked N = 2I)
INVARIANT = KernelConfig(batch_invariant=True)


def rand(*shape, dtype=torch.bfloat16, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return fused.silu_mul(invariant.linear(x, w))


def _tickets_clear() -> bool:
    tables = (invariant._SCRATCH, invariant._SIDE_SCRATCH)
    return all(int(s.tickets.abs().sum()) == 0 for t in tables for s in t.values()
               if s.tickets is not None)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_linear_silu_is_linear_then_silu_mul_at_every_m(name: str, dtype) -> None:
    """Every M of 1..170: bitwise `silu_mul(linear(x, w))` and the rows of the 170-row launch;
    20 repeats of the split-K launch equal (a ticket race would show); tickets all 0."""
    inner = SHAPES[name]
    x = rand(170, D, dtype=dtype, seed=1)
    w = rand(2 * inner, D, dtype=dtype, scale=D**-0.5, seed=2)  # [2I, D] gate rows, up rows
    full = invariant.linear_silu(x, w)  # [170, I]
    bad = []
    for m in range(1, 171):
        got = invariant.linear_silu(x[:m], w)  # [M, I]
        if not (torch.equal(got, unfused(x[:m], w)) and torch.equal(got, full[:m])):
            bad.append(m)
    assert bad == [], f"M = {bad} differ from the two launches or the 170-row launch"
    repeats = [torch.equal(invariant.linear_silu(x[:10], w), full[:10]) for _ in range(20)]
    assert all(repeats)
    torch.cuda.synchronize()
    assert _tickets_clear()


def test_linear_silu_prompt_chunk_configuration() -> None:
    """Prompt chunks' configuration (128 x 128 tiles, no K split) gives the two launches' bits."""
    x, w = rand(300, D, seed=3), rand(512, D, scale=D**-0.5, seed=4)
    with backend.prefill_phase():
        assert invariant.mm_config(512, D, torch.bfloat16).split == 1
        assert torch.equal(invariant.linear_silu(x, w), unfused(x, w))


@pytest.mark.parametrize("side", [False, True])
def test_linear_silu_in_a_cuda_graph(side: bool) -> None:
    """Captured (on the side stream as `MoE.forward` runs the shared expert, or in place) and
    replayed with fresh inputs: the two launches' bits, tickets all 0 after."""
    w = rand(512, D, scale=D**-0.5, seed=5)
    static = rand(17, D, seed=6)  # [17, D]
    cfg = KernelConfig(batch_invariant=True, side_stream=side)

    def step() -> torch.Tensor:
        with backend.side_branch(static) as join:
            h = backend.linear_silu(static, w)  # [17, 256]
        join()
        return h

    with backend.kernel_mode(cfg):
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            step()  # compile, scratch sized outside capture
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for seed in (7, 8):
            static.copy_(rand(17, D, seed=seed))
            graph.replay()
            assert torch.equal(out, unfused(static, w)), seed
    torch.cuda.synchronize()
    assert _tickets_clear()


def test_dense_mlp_activation_keeps_its_bits() -> None:
    """The shared expert's `activation` on the CUDA invariant path: the stacked matmul then
    `silu_mul`, bit for bit, and close to torch's silu(gate) * up."""
    mlp = DenseMLP(D, 256, LocalComm(), torch.bfloat16, "cuda", reduce=False)
    with torch.no_grad():
        for seed, p in enumerate((mlp.gate_proj.weight, mlp.up_proj.weight)):
            p.copy_(rand(*p.shape, scale=D**-0.5, seed=9 + seed))
    x = rand(10, D, seed=11)
    with backend.kernel_mode(INVARIANT):
        got = mlp.activation(x)  # [10, 256]
        assert torch.equal(got, unfused(x, mlp.gate_up_weight()))
    want = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
