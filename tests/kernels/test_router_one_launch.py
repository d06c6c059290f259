"""The router's one-launch path (`router._route_kernel`: the select done by the last gate program
of each token tile, after a ticket) against its two-launch path (`_gate_partials_kernel` +
`_select_kernel`), in the Triton interpreter on the CPU: the same ids and weights bit for bit,
whatever T, shape, gate dtype or configuration, ties included; its tickets back at 0 after every
call, so a second call (or a CUDA-graph replay) on the same scratch gives the same result.

As in tests/kernels/test_router_kernel.py (whose shapes and inputs these checks reuse), the
kernel checks run in one TRITON_INTERPRET=1 subprocess. tests/gpu/test_router_gpu.py compares
the two paths on the GPU at K2.6's gate, eagerly and in a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddserve.kernels.router_ref import RoutingParams
from tests.kernels.test_router_kernel import SHAPES, inputs
from tests.triton_interp import interpreter_results, patch_interpreter, require_triton, run_cases

T_LIST = (1, 2, 5, 17, 70)  # 70: two tiles of 64 tokens, five of 16


def _both_paths_equal(router, x, w, b, p, cfg=None, t_list=T_LIST) -> None:
    for t in t_list:
        one = router.route(x[:t], w, b, p, cfg, one_launch=True)
        two = router.route(x[:t], w, b, p, cfg, one_launch=False)
        assert torch.equal(one[0], two[0]), (t, one[0], two[0])
        assert torch.equal(one[1], two[1]), (t, (one[1] - two[1]).abs().max())


def check_one_launch_is_the_two_launch_bits(router, name: str, gate_dtype: torch.dtype) -> None:
    """The default configuration: at 17 tokens three select blocks in one tile, at 70 two tiles
    (the second of 6 tokens)."""
    _, e, d, p = SHAPES[name]
    x, w, b = inputs(max(T_LIST), e, d, seed=200 + len(name))
    _both_paths_equal(router, x, w.to(gate_dtype), b, p)


def check_fma_config_with_tiles_smaller_than_a_select_block(router) -> None:
    """FMA chains, 4-token tiles (below SELECT_T): each tile's last program selects its own
    tokens only, fp32 and bf16 x."""
    _, e, d, p = SHAPES["grouped"]
    cfg = router.RouterConfig(block_t=4, block_e=8, block_k=16, unroll=2, split=3, warps=4)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = inputs(17, e, d, seed=21, dtype=dtype)
        _both_paths_equal(router, x, w, b, p, cfg, t_list=(1, 5, 17))


def check_ties_resolve_alike(router) -> None:
    """Equal expert scores (experts 3 and 10: the same gate row and bias; lower id first) and
    equal group scores at the group filter's boundary (groups 1 and 2 identical, behind group 0
    and ahead of group 3; the lower group kept): both paths, the same bits."""
    t, e, d = 4, 16, 64
    x, w, b = inputs(t, e, d, seed=8)
    x = x.abs()
    w[3] = w[10] = 0.05
    b[3] = b[10] = 0.0
    p = RoutingParams(4, 1, 1, True, 1.0)
    one = router.route(x, w, b, p, one_launch=True)
    assert one[0][:, :2].tolist() == [[3, 10]] * t, one[0]
    _both_paths_equal(router, x, w, b, p, t_list=(t,))
    w[8:12], b[8:12] = w[4:8], b[4:8]  # group 2 = group 1
    w[12:] = -0.05  # group 3 last
    grouped = RoutingParams(4, 4, 2, True, 1.0)
    assert (router.route(x, w, b, grouped, one_launch=True)[0] < 8).all()  # groups 0 and 1
    _both_paths_equal(router, x, w, b, grouped, t_list=(1, t))


def check_tickets_reset_so_a_second_call_agrees(router) -> None:
    """After a one-launch call every ticket is 0 again; calls reusing the scratch (the same T,
    another T, more tiles) give the first call's bits."""
    from ddserve.kernels import invariant

    _, e, d, p = SHAPES["grouped"]
    x, w, b = inputs(70, e, d, seed=31)
    cfg = router.RouterConfig(16, 16, 16, 2, 3, 4, mma=True)
    first = router.route(x[:17], w, b, p, cfg, one_launch=True)
    scratch = invariant._SCRATCH[x.device]
    assert int(scratch.tickets.count_nonzero()) == 0
    router.route(x, w, b, p, cfg, one_launch=True)  # five tiles
    assert int(scratch.tickets.count_nonzero()) == 0
    again = router.route(x[:17], w, b, p, cfg, one_launch=True)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


CASES = (
    [(f"one_launch_is_the_two_launch_bits[{n}]", check_one_launch_is_the_two_launch_bits,
      (n, torch.float32)) for n in SHAPES]
    + [(f"one_launch_is_the_two_launch_bits[{n}-bf16_gate]",
        check_one_launch_is_the_two_launch_bits, (n, torch.bfloat16))
       for n in ("ungrouped_k8_e384", "grouped")]
    + [("fma_config_with_tiles_smaller_than_a_select_block",
        check_fma_config_with_tiles_smaller_than_a_select_block, ())]
    + [("ties_resolve_alike", check_ties_resolve_alike, ())]
    + [("tickets_reset_so_a_second_call_agrees", check_tickets_reset_so_a_second_call_agrees, ())]
)  # fmt: skip


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


class _Launches:
    """Stands in for a kernel: records the launches `route` makes (no kernel runs)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(self.name)


def test_route_takes_one_launch_up_to_one_launch_max_t(monkeypatch) -> None:
    """The default: one launch for T <= ONE_LAUNCH_MAX_T, two above; `one_launch` overrides."""
    require_triton()
    from ddserve.kernels import router

    log: list[str] = []
    for kernel in ("_route_kernel", "_gate_partials_kernel", "_select_kernel"):
        monkeypatch.setattr(router, kernel, _Launches(kernel, log))
    _, e, d, p = SHAPES["grouped"]
    x, w, b = inputs(router.ONE_LAUNCH_MAX_T + 1, e, d, seed=1)
    expect = {1: ["_route_kernel"], router.ONE_LAUNCH_MAX_T: ["_route_kernel"],
              router.ONE_LAUNCH_MAX_T + 1: ["_gate_partials_kernel", "_select_kernel"]}  # fmt: skip
    for t, kernels in expect.items():
        log.clear()
        router.route(x[:t], w, b, p)
        assert log == kernels, t
    log.clear()
    router.route(x[:1], w, b, p, one_launch=False)
    router.route(x, w, b, p, one_launch=True)
    assert log == ["_gate_partials_kernel", "_select_kernel", "_route_kernel"]


def _run_checks() -> dict[str, str]:
    """In the interpreter subprocess: every case -> "ok" or its failure text."""
    from ddserve.kernels import router

    return run_cases(CASES, router)


if __name__ == "__main__":  # the interpreter subprocess
    patch_interpreter()
    print(json.dumps(_run_checks()))
