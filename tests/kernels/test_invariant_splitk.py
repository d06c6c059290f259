"""The split-K matmul's in-kernel reduction (ddserve/kernels/invariant.py), Triton interpreter.

With the weight's K split into S ranges, every program stores its fp32 partial and takes a ticket
for its output tile; the program with the last ticket sums the S partials in split order and
rounds once. The specification: the result is bitwise the two-launch result (`_sum_splits_kernel`
summing the same partials) and bitwise `invariant_ref.split_sum_ref` of the partials left in the
scratch, whatever order the programs run in (the interpreter runs them one at a time, so the
checks shuffle that order), and every ticket is back to 0 after each call. The checks run in one
subprocess with TRITON_INTERPRET=1, as in test_invariant_ops.py (which covers accuracy and row
invariance of the public ops).
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch

from ddserve.kernels.invariant_ref import split_sum_ref
from tests.triton_interp import interpreter_results, patch_interpreter, require_triton, run_cases


def wide(*shape, dtype, seed: int) -> torch.Tensor:
    """Values spread over 2^-12..2^12 (fp16: 2^-5..2^5, no overflow), so the order of fp32
    additions shows in the bits."""
    g, e = torch.Generator().manual_seed(seed), 5 if dtype == torch.float16 else 12
    x = torch.randn(*shape, generator=g) * 2.0 ** torch.randint(-e, e + 1, shape, generator=g)
    return x.to(dtype)


def interp_round(y32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype as the interpreter's kernels cast: bf16 toward zero (tensor cores round to
    nearest even; tests/gpu checks that), fp16 to nearest."""
    if dtype != torch.bfloat16:
        return y32.to(dtype)
    return (y32.view(torch.int32) & -65536).view(torch.float32).to(dtype)


@contextlib.contextmanager
def shuffled_programs(seed: int):
    """The interpreter runs a grid's programs in a seeded random order instead of row-major, so
    the last ticket of a tile goes to any of its splits."""
    import triton.runtime.interpreter as ti

    b, rng, state = ti.interpreter_builder, random.Random(seed), {}

    def set_grid_dim(nx, ny, nz):
        order = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        rng.shuffle(order)
        state.update(order=order, dims=(ny, nz))
        type(b).set_grid_dim(b, nx, ny, nz)

    def set_grid_idx(x, y, z):
        ny, nz = state["dims"]
        type(b).set_grid_idx(b, *state["order"][(x * ny + y) * nz + z])

    b.set_grid_dim, b.set_grid_idx = set_grid_dim, set_grid_idx
    try:
        yield
    finally:
        del b.set_grid_dim, b.set_grid_idx


def run(inv, x, w, heads: int, split: int | None, two_launch: bool):
    """y [M, (H,) N] from `_launch` (split None: mm_config's), its config, and the partials the
    call left in the scratch, viewed [S, *y.shape] (None when S = 1)."""
    m, n, k = x.shape[0], w.shape[0] if heads == 1 else w.shape[2], x.shape[-1]
    cfg = inv.mm_config(n, k, x.dtype, heads)
    cfg = cfg if split is None else cfg._replace(split=split)
    shape = (m, n) if heads == 1 else (m, heads, n)
    y = torch.empty(shape, dtype=x.dtype)
    strides = (0, w.stride(1), w.stride(0)) if heads == 1 else w.stride()
    inv._launch(x, w, y, strides, heads, cfg, two_launch)
    scratch = inv._SCRATCH.get(torch.device("cpu"))
    if scratch is not None:
        assert int(scratch.tickets.abs().sum()) == 0, "a ticket was left non-zero"
    if cfg.split == 1:
        return y, cfg, None
    stride = -(-y.numel() // 16) * 16
    parts = scratch.partials[: cfg.split * stride].view(cfg.split, stride)[:, : y.numel()]
    return y, cfg, parts.reshape(cfg.split, *shape).clone()


def check_fused_equals_two_launch_and_split_sum_ref(inv, dtype, heads: int, split) -> None:
    rng = random.Random(f"{dtype}{heads}{split}")
    for trial in range(2):
        m, n, k = rng.choice([1, 7, 37, 70]), rng.choice([13, 45, 70]), rng.choice([200, 333, 600])
        x = wide(m, k, dtype=dtype, seed=trial) if heads == 1 else wide(m, heads, k, dtype=dtype,
                                                                         seed=trial)  # fmt: skip
        w = (wide(n, k, dtype=dtype, seed=trial + 50) if heads == 1
             else wide(heads, n, k, dtype=dtype, seed=trial + 50).transpose(1, 2))  # fmt: skip
        with shuffled_programs(trial):
            fused, cfg, parts = run(inv, x, w, heads, split, two_launch=False)
        two, _, parts2 = run(inv, x, w, heads, split, two_launch=True)
        where = f"m={m} n={n} k={k} split={cfg.split}"
        assert torch.equal(fused, two), where
        if parts is not None:
            assert torch.equal(parts, parts2), where
            assert torch.equal(fused, interp_round(split_sum_ref(parts, torch.float32), dtype)), (
                where
            )


def check_add_epilogue_is_linear_plus_add(inv, dtype, split: int) -> None:
    """linear(x, w, add) == round(linear(x, w) + add), in one launch, with or without a split."""
    x, w = wide(7, 333, dtype=dtype, seed=20), wide(45, 333, dtype=dtype, seed=21)
    add = wide(7, 45, dtype=dtype, seed=22)
    plain, cfg, _ = run(inv, x, w, 1, split, two_launch=False)
    cfg = cfg._replace(split=split)
    y = torch.empty(7, 45, dtype=dtype)
    inv._launch(x, w, y, (0, w.stride(1), w.stride(0)), 1, cfg, add=add)
    assert torch.equal(y, interp_round(plain.float() + add.float(), dtype))
    fused = inv.linear(x, w, add=add)  # the default configuration
    assert torch.equal(fused, interp_round(inv.linear(x, w).float() + add.float(), dtype))


def check_topk_add_is_linear_plus_moe_combine(inv, dtype, split: int, pair_dtype) -> None:
    """linear(x, w, add=pairs, add_topk=k) == round(linear(x, w) + combine(pairs)), with the
    MoE's own combine kernel (`moe_reduce._combine_kernel`: slot-order fp32 sum, rounded) and
    its reference (`invariant_ref.combine_ref`), for fp32 and bf16 pairs (`moe_v3` PAIRS). 70
    rows (two 64-row tiles), row-strided pairs; with x = 0 the output is the combine alone, so
    its order and addressing show in every bit (next to a real product they would round
    away)."""
    from ddserve.kernels.invariant_ref import combine_ref
    from ddserve.kernels.moe_reduce import _combine_kernel

    m, n, k, topk = 70, 45, 333, 3
    x, w = wide(m, k, dtype=dtype, seed=23), wide(n, k, dtype=dtype, seed=24)
    pairs = wide(m * topk, n + 3, dtype=pair_dtype, seed=25)[:, :n]  # row stride n + 3
    combined32 = torch.empty(m, n, dtype=torch.float32)
    _combine_kernel[(m, 1)](pairs, combined32, n, pairs.stride(0), combined32.stride(0),
                            TOPK=topk, BC=64, PDL=False)  # fmt: skip
    assert torch.equal(combined32, combine_ref(pairs, topk, torch.float32))
    combined = interp_round(combined32, dtype)
    for xs in (x, torch.zeros_like(x)):
        plain, cfg, _ = run(inv, xs, w, 1, split, two_launch=False)
        y = torch.empty(m, n, dtype=dtype)
        inv._launch(xs, w, y, (0, w.stride(1), w.stride(0)), 1, cfg._replace(split=split),
                    add=pairs, add_topk=topk)  # fmt: skip
        assert torch.equal(y, interp_round(plain.float() + combined.float(), dtype))
    assert torch.equal(inv.linear(torch.zeros_like(x), w, pairs, add_topk=topk), combined)
    fused = inv.linear(x, w, add=pairs, add_topk=topk)  # the default configuration
    assert torch.equal(fused, interp_round(inv.linear(x, w).float() + combined.float(), dtype))


def check_default_configs_split_and_match(inv) -> None:
    """The default configuration splits a narrow long-K weight; fused == two-launch there too."""
    x, w = (
        wide(19, 1030, dtype=torch.bfloat16, seed=7),
        wide(20, 1030, dtype=torch.bfloat16, seed=8),
    )
    with shuffled_programs(3):
        fused, cfg, _ = run(inv, x, w, 1, None, two_launch=False)
    assert cfg.split > 1
    assert torch.equal(fused, run(inv, x, w, 1, None, two_launch=True)[0])


def check_scratch_grows_and_keeps_old_buffers(inv) -> None:
    """A larger call grows the scratch; the old buffer stays referenced (captured graphs keep
    its address); a smaller call afterwards reuses the grown buffer."""
    inv.linear(
        wide(2, 1030, dtype=torch.float32, seed=9), wide(20, 1030, dtype=torch.float32, seed=10)
    )
    scratch = inv._SCRATCH[torch.device("cpu")]
    before = scratch.partials
    m = before.numel() // (2 * 64) + 1  # split 2 x [m, 64] fp32 partials outgrow it
    x, w = wide(m, 64, dtype=torch.float32, seed=11), wide(64, 64, dtype=torch.float32, seed=12)
    big = run(inv, x, w, 1, 2, two_launch=False)[0]  # [m, 64]
    assert scratch.partials.numel() >= 2 * m * 64 and scratch.partials is not before
    assert any(t is before for t in scratch.retired)
    grown = scratch.partials
    assert torch.equal(run(inv, x[:3], w, 1, 2, two_launch=False)[0], big[:3])
    assert scratch.partials is grown


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CASES = (
    [(f"fused_eq_two_launch[{d},heads={h},split={s}]",
      check_fused_equals_two_launch_and_split_sum_ref, (d, h, s))
     for d in DTYPES for h, s in [(1, 1), (1, 2), (1, 3), (1, 5), (3, 1), (3, 3)]]
    + [("fused_eq_two_launch[heads=3,split=5]", check_fused_equals_two_launch_and_split_sum_ref,
        (torch.bfloat16, 3, 5))]
    + [(f"add_epilogue[{d},split={s}]", check_add_epilogue_is_linear_plus_add, (d, s))
       for d in DTYPES for s in (1, 3)]
    + [(f"topk_add_epilogue[{d},split={s}]", check_topk_add_is_linear_plus_moe_combine,
        (d, s, torch.float32)) for d in DTYPES for s in (1, 3)]
    + [(f"topk_add_epilogue[{d},split={s},bf16 pairs]", check_topk_add_is_linear_plus_moe_combine,
        (d, s, torch.bfloat16)) for d in DTYPES for s in (1, 3)]
    + [("default_configs_split", check_default_configs_split_and_match, ())]
    + [("scratch_grows_keeps_old", check_scratch_grows_and_keeps_old_buffers, ())]
)  # fmt: skip


def _run_checks() -> dict[str, str]:
    """In the interpreter subprocess: every case -> "ok" or its failure text."""
    from ddserve.kernels import invariant

    return run_cases(CASES, invariant)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_split_k_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


def test_split_sum_ref_adds_in_split_order() -> None:
    """The reference is (p0 + p1) + p2 in fp32, not a pairwise or float64 sum."""
    p = torch.tensor([[1.0], [2.0**-24], [2.0**-24]])  # [3, 1]: in order, each add rounds away
    assert split_sum_ref(p, torch.float32).item() == 1.0
    assert split_sum_ref(p.flip(0), torch.float32).item() == 1.0 + 2.0**-23


if __name__ == "__main__":
    patch_interpreter()
    print(json.dumps(_run_checks()))


def test_linear_add_must_match_the_output() -> None:
    require_triton()
    from ddserve.kernels import invariant

    x, w = torch.randn(3, 8), torch.randn(5, 8)
    for bad in (torch.zeros(3, 4), torch.zeros(3, 5, dtype=torch.float64), torch.zeros(5, 3)):
        with pytest.raises(ValueError, match="does not match the output"):
            invariant.linear(x, w, add=bad)


def test_linear_topk_add_is_checked() -> None:
    require_triton()
    from ddserve.kernels import invariant

    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"must be \[6, 5\] float32"):
        invariant.linear(x, w, add=torch.zeros(3, 5), add_topk=2)  # one row per output row
    with pytest.raises(ValueError, match=r"must be \[6, 5\] float32"):
        invariant.linear(x, w, add=torch.zeros(6, 5, dtype=torch.float64), add_topk=2)
    with pytest.raises(ValueError, match="add_topk needs add"):
        invariant.linear(x, w, add_topk=2)


def test_reference_path_adds_the_pairs_slot_by_slot() -> None:
    """The torch path (CPU: `backend.linear` -> `invariant_ref`): a row-parallel partial plus k
    pair rows per output row is F.linear plus their slot-order fp32 sum, rounded; the argument
    is checked there too."""
    from ddserve.distributed import LocalComm
    from ddserve.kernels import backend
    from ddserve.model.layers import RowParallelLinear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=g).bfloat16()
    pairs = torch.randn(12, 5, generator=g) * 2.0 ** torch.randint(-20, 20, (12, 5), generator=g)
    partial = RowParallelLinear(8, 5, LocalComm(), torch.bfloat16, "cpu", reduce=False)
    torch.nn.init.normal_(partial.weight, generator=g)
    rows = pairs.view(4, 3, 5)
    want = ((rows[:, 0] + rows[:, 1]) + rows[:, 2]).bfloat16()  # from 0: 0 + p0 is p0
    got = partial(x, add=pairs, add_topk=3)
    assert torch.equal(got, torch.nn.functional.linear(x, partial.weight) + want)
    half = pairs.bfloat16()  # bf16 pairs (`moe_v3` PAIRS) are summed in fp32 the same way
    rows = half.float().view(4, 3, 5)
    want = ((rows[:, 0] + rows[:, 1]) + rows[:, 2]).bfloat16()
    got = partial(x, add=half, add_topk=3)
    assert torch.equal(got, torch.nn.functional.linear(x, partial.weight) + want)
    with pytest.raises(ValueError, match="bfloat16 pair rows"):
        backend.linear(x, partial.weight, add_topk=3)


def test_row_parallel_linear_adds_only_to_an_unreduced_partial() -> None:
    from ddserve.distributed import LocalComm
    from ddserve.model.layers import RowParallelLinear

    x, add = torch.randn(3, 8), torch.randn(3, 5)
    partial = RowParallelLinear(8, 5, LocalComm(), torch.float32, "cpu", reduce=False)
    torch.nn.init.normal_(partial.weight)
    assert torch.equal(partial(x, add=add), torch.nn.functional.linear(x, partial.weight) + add)
    reduced = RowParallelLinear(8, 5, LocalComm(), torch.float32, "cpu", reduce=True)
    with pytest.raises(ValueError, match="reduce=False"):
        reduced(x, add=add)
