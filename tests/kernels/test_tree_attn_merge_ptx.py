"""Tree attention's split merge (`tree_attn_invariant._combine_kernel`) in its sm_90 PTX,
compiled on the CPU: the weighted sum of a run of groups is the same instructions in the binary
that merges a group per program (LEAVES 1) and in the one that folds a tile per program first
(LEAVES 4), and nothing in it is left to the compiler's contraction. The GPU test that rows do
not depend on the keys per program (tests/gpu/test_tree_attn_triton.py) checks the bits on an
H200; this one runs in CI and names the cause if a compiler or layout change ever splits them.
"""

from __future__ import annotations

import re

from tests.triton_interp import require_sm90_compiler, require_triton

PTRS = ("po_ptr", "plse_ptr", "pl_ptr", "out_ptr", "q_starts_ptr", "q_lens_ptr")
PRODUCT = re.compile(r"^\s*fma\.rn\.f32\s+(%r\d+), (%r\d+), (%r\d+), 0f00000000;")
FP_OP = re.compile(r"^\s*((?:fma|add|sub|mul)\.\S*f32)\s+([^;]*);")


def _ptx(leaves: int) -> str:
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import tree_attn_invariant as ta

    require_sm90_compiler()
    fn = ta._combine_kernel
    sig = dict(zip(PTRS, ("*fp32",) * 3 + ("*bf16",) + ("*i64",) * 2, strict=True))
    sig.update(dict.fromkeys(("nblocks", "stride_ot", "stride_oh", "NSPLIT"), "i32"))
    consts = dict(H=8, R=512, PDL=True, LEAVES=leaves, GB=ta.MERGE_GROUPS, BS=64)
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in PTRS}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 4, "launch_pdl": True}
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]


def _run_sum(ptx: str, products: int) -> list[str]:
    """The floating-point instructions from the run's weighted products (the last `products`
    FMAs with a zero addend) up to the next integer instruction, registers renamed in order of
    appearance (so two binaries compare by their dataflow)."""
    lines = ptx.splitlines()
    at = [i for i, line in enumerate(lines) if PRODUCT.match(line)]
    assert len(at) >= products, f"{len(at)} zero-addend FMAs, expected the run's {products}"
    names: dict[str, str] = {}
    out = []
    for line in lines[at[-products] :]:
        m = FP_OP.match(line)
        if m is None:
            if re.match(r"^\s*(add|mul|mad|setp|mov)\.\S*[su](32|64)", line):
                break  # the loop's index arithmetic: the run's sums are done
            continue
        regs = [names.setdefault(r, f"v{len(names)}") for r in re.findall(r"%r\d+", m.group(2))]
        out.append(f"{m.group(1)} {' '.join(regs)}{' 0' if '0f00000000' in m.group(2) else ''}")
    return out


def test_the_run_sum_is_the_same_rounded_products_and_additions_in_both_merges() -> None:
    from ddserve.kernels.tree_attn_invariant import MERGE_GROUPS

    per_thread = 4  # 512 values over 128 threads
    products = MERGE_GROUPS * per_thread
    group_sum, tile_sum = (_run_sum(_ptx(leaves), products) for leaves in (1, 4))
    assert group_sum == tile_sum
    ops = [s.split()[0] for s in group_sum]
    assert ops[:products] == ["fma.rn.f32"] * products  # rounded products, zero addend
    assert all(s.endswith(" 0") for s in group_sum[:products])
    # then additions only: the tree's (GB - 1) per value and the run sum's one, nothing fused
    assert set(ops[products:]) == {"add.f32"}
    assert ops.count("add.f32") >= (MERGE_GROUPS - 1) * per_thread + per_thread
