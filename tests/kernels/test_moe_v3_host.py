"""Host-side choices of the MoE v3 (`kernels/moe_v3.py`) that need no GPU: per-call tiles, the
config check, the fused SiLU's precondition and arrival counters, and the fused up kernel's sm_90
build (compiled on the CPU). The kernels themselves are tested on the GPU
(`tests/gpu/test_moe_v3.py`)."""

from __future__ import annotations

import pytest

from ddserve.kernels import moe_v3
from tests.triton_interp import require_sm90_compiler


def test_tokens_per_block_follow_tokens_per_expert() -> None:
    assert moe_v3.pick_bm(8, 384) == 8  # one decode token, top-8
    assert moe_v3.pick_bm(192 * 8, 384) == 8  # 4 tokens per expert
    assert moe_v3.pick_bm(288 * 8, 384) == 8  # 6
    assert moe_v3.pick_bm(384 * 8, 384) == 16  # 8
    assert moe_v3.pick_bm(768 * 8, 384) == 16  # 16


def test_down_tiles_per_program_keep_two_programs_per_sm() -> None:
    # K2.6 down projection: 7168 rows = 56 tiles of 128
    assert moe_v3.pick_nt(56, 8, 132) == 1  # T = 1: 8 blocks, 448 programs at 1 tile each
    assert moe_v3.pick_nt(56, 12, 132) == 2  # 336 programs at 2 tiles
    assert moe_v3.pick_nt(56, 300, 132) == 4
    assert moe_v3.pick_nt(57, 300, 132) == 1  # 4 and 2 do not divide the tiles


def test_l2_asks_ahead_only_where_up_programs_fit_one_per_sm() -> None:
    cfg = moe_v3._config(None)
    assert moe_v3.pick_pfa(cfg, 128, 132) == moe_v3.PFA_FEW_PROGRAMS == 2  # K2.6 tp 8, T = 1
    assert moe_v3.pick_pfa(cfg, 256, 132) == 0  # T = 2 (or T = 1 at tp = 4)
    assert moe_v3.pick_pfa(cfg, 1152, 132) == 0  # T = 10
    assert moe_v3.pick_pfa(moe_v3._config({"PFA": 3}), 4096, 132) == 3


def test_config_keys_and_values_are_checked() -> None:
    assert moe_v3._config(None) == moe_v3.CONFIG
    assert moe_v3._config({"BM": 16})["BM"] == 16
    with pytest.raises(ValueError, match="unknown keys"):
        moe_v3._config({"BN2": 32})
    with pytest.raises(ValueError, match="BM=12"):
        moe_v3._config({"BM": 12})
    with pytest.raises(ValueError, match="W=3"):
        moe_v3._config({"W": 3})


def test_cpu_tensors_get_a_clear_error() -> None:
    import torch

    from ddserve.kernels.moe_ref import ExpertWeights, quantize_int4

    p13, s13 = quantize_int4(torch.randn(2, 256, 128).to(torch.bfloat16))
    p2, s2 = quantize_int4(torch.randn(2, 128, 128).to(torch.bfloat16))
    w = ExpertWeights(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="CUDA"):
        moe_v3.fused_moe_v3(x, torch.tensor([[0], [1]]), torch.ones(2, 1), w)


@pytest.mark.parametrize("bm", [8, 16])
def test_one_token_blocks_hold_the_aligned_pairs_in_slot_order(bm: int) -> None:
    """One token skips the alignment: its k blocks hold the same (expert, pair) sets as
    `align_by_expert`'s, one pair in each block's first row, padding (P = k) elsewhere, in slot
    order instead of expert order."""
    import torch

    from ddserve.kernels.moe_align import align_by_expert

    ids = torch.tensor([[17, 3, 250, 99, 0, 383, 42, 7]])  # [1, k]: distinct experts
    k = ids.shape[1]
    pairs, experts = moe_v3._one_token_blocks(ids, bm)
    assert pairs.dtype == torch.int64 and pairs.shape == (k * bm,)
    assert experts.tolist() == ids[0].tolist()  # block j: slot j's expert
    rows = pairs.view(k, bm)
    assert rows[:, 0].tolist() == list(range(k)) and bool((rows[:, 1:] == k).all())
    ref_pairs, ref_experts = align_by_expert(ids, 384, bm)
    ref = {
        int(e): sorted(int(p) for p in ref_pairs.view(-1, bm)[b] if p < k)
        for b, e in enumerate(ref_experts) if e < 384
    }  # fmt: skip
    assert {int(e): [j] for j, e in enumerate(ids[0])} == ref
    assert moe_v3._one_token_blocks(ids, bm)[0] is pairs  # made once, kept (graphs hold it)


def test_pair_outputs_are_refused_past_one_chunk() -> None:
    """combine=False returns the per-pair buffer that CHUNK bounds: a longer call is refused
    (before anything runs)."""
    import torch

    from ddserve.kernels.moe_ref import ExpertWeights

    t = moe_v3.CHUNK + 1
    weights = ExpertWeights(w13_packed=torch.zeros(1, 2, 1, dtype=torch.int32),
                            w13_scale=torch.zeros(1, 2, 1, dtype=torch.bfloat16))  # fmt: skip
    args = (torch.zeros(t, 8), torch.zeros(t, 2, dtype=torch.long), torch.ones(t, 2), weights)
    with pytest.raises(ValueError, match=f"at most {moe_v3.CHUNK} tokens"):
        moe_v3.fused_moe_v3(*args, combine=False)
    with pytest.raises(RuntimeError, match="CUDA GPUs only"):  # with its combine: chunked
        moe_v3.fused_moe_v3(*args)


def test_silu_is_fused_when_asked_and_each_up_tile_is_all_gate_or_all_up() -> None:
    """FUSED_SILU folds SiLU-and-mul into the up launch only when the intermediate size I is a
    multiple of the up tile's rows (then a (block, gate tile) unit is 2 SPLIT programs); else the
    two launches run."""
    on, off = moe_v3._config({"FUSED_SILU": True}), moe_v3._config({"FUSED_SILU": False})
    assert moe_v3.fuses_silu(on, 256, 128)  # K2.6 at tp = 8, default tiles (BN = 16 W NREP)
    assert moe_v3.fuses_silu(on, 256, 64) and moe_v3.fuses_silu(on, 256, 256)  # NREP 1, 4
    assert not moe_v3.fuses_silu(on, 320, 128)  # a tile would hold gate and up columns
    assert not moe_v3.fuses_silu(on, 64, 128)
    assert not moe_v3.fuses_silu(off, 256, 128)
    with pytest.raises(ValueError, match="FUSED_SILU='yes'"):
        moe_v3._config({"FUSED_SILU": "yes"})


def test_tickets_are_zeros_kept_while_they_suffice_and_retired_when_outgrown() -> None:
    """The arrival counters: one zeroed buffer of at least 4096, handed out again while large
    enough (captured graphs hold its address); a larger need gets a new one (at least double)
    and the old one is kept alive in `retired`, never freed."""
    import torch

    tickets = moe_v3._Tickets()
    cpu = torch.device("cpu")
    first = tickets.take(16, cpu)
    assert first.dtype == torch.int32 and first.numel() == 4096 and not first.any()
    assert tickets.take(4096, cpu) is first
    bigger = tickets.take(5000, cpu)
    assert bigger.numel() == 8192 and not bigger.any()
    assert tickets.retired == [first] and tickets.take(100, cpu) is bigger


def _sm90_ptx(kernel, sig: dict, consts: dict, warps: int) -> str:
    """PTX of a Triton or Gluon kernel for sm_90 (compiled on the CPU, PDL on), with the 16-byte
    divisibility the JIT gives the K2.6 call's pointers and integers."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    require_sm90_compiler()
    sig = dict(sig, **dict.fromkeys(consts, "constexpr"))
    divisible = [n for n, ty in sig.items() if ty != "constexpr"
                 and n not in kernel.do_not_specialize]  # fmt: skip
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    if kernel.is_gluon():
        src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    else:
        src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": warps, "launch_pdl": True}
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]


def _float_ops_per_element(ptx: str, elements: int) -> dict[str, float]:
    import collections
    import re

    op = r"^\s*(?:@%p\d+\s+)?((?:add|sub|mul|fma|div|ex2|rcp|neg|max|min|cvt)[.\w]*\.f32)\s"
    counts = collections.Counter(re.findall(op, ptx, re.M))
    return {name: n / elements for name, n in sorted(counts.items())}


@pytest.mark.parametrize("pfa,unroll", [(0, False), (3, False), (2, True)])
def test_fused_up_kernel_builds_for_sm90_with_the_ticket_protocol(pfa: int, unroll: bool) -> None:
    """`_w4_up_silu_kernel` at K2.6 shapes (BM 8, SPLIT 4; without and with the L2 asks of the
    step PFA ahead, the step loop rolled or unrolled), compiled for sm_90 on the CPU: the
    PDL wait comes before any memory access; every thread's partial stores, then a CTA barrier,
    then one acq_rel gpu-scope atomic add (the ticket); after it the partials are read from L2
    (.cg) only, and the ticket reset is the last store. Per h element, the epilogue's fp32
    instructions are `_silu_kernel`'s (the same operations, so the same bits)."""
    import re

    from ddserve.kernels.moe_gluon import _w4_up_silu_kernel
    from ddserve.kernels.moe_reduce import _silu_kernel

    sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", part_ptr="*fp32", pairs_ptr="*i64",
               bexp_ptr="*i64", h_ptr="*bf16", ticket_ptr="*i32")  # fmt: skip
    ints = ("num_pairs", "num_experts", "num_mblocks", "N", "K", "stride_x", "stride_ps",
            "stride_pr", "stride_h", "expert_words", "expert_scales")  # fmt: skip
    sig.update(dict.fromkeys(ints, "i32"))
    consts = dict(TOPK=8, W=4, NREP=2, BM=8, KS_TOTAL=56, KSTEPS=14, SPLIT=4, DEPTH=1, PDL=True,
                  PFA=pfa, UNROLL=unroll)  # fmt: skip
    ptx = _sm90_ptx(_w4_up_silu_kernel, sig, consts, warps=4)
    # weights and scales: steps 1..PFA at the start, then one step per loop body (rolled) or
    # per each of the 14 steps (unrolled)
    asks = 2 * (pfa + (14 if unroll else 1)) if pfa else 0
    assert ptx.count("prefetch.global.L2") == asks
    ptx = ptx[: ptx.find(".section\t.debug")] if ".section\t.debug" in ptx else ptx
    wait = ptx.find("griddepcontrol.wait")
    first_mem = re.search(r"\b(ld\.global|st\.global|atom\.|red\.)", ptx).start()
    assert 0 <= wait < first_mem
    atoms = [m.start() for m in re.finditer(r"\batom\.", ptx)]
    assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in ptx
    before, after = ptx[: atoms[0]], ptx[atoms[0] :]
    assert before.rfind("bar.sync") > before.rfind("st.global")  # partials stored, then barrier
    assert after.find("bar.sync") < after.find("ld.global")  # the ticket shared, then loads
    loads = re.findall(r"\bld\.global[.\w]*", after)
    partials = [ld for ld in loads if ld != "ld.global.b64"]  # (b64: the rows' pair indices)
    per_thread = 8 * 128 // 128  # [BM, BN] fp32 values of one split's gate (or up) tile
    assert len(partials) == 2 * 4 * per_thread // 4  # gate and up, 4 splits, 16 bytes a load
    assert set(partials) == {"ld.global.cg.v4.b32"}
    stores = re.findall(r"\bst\.global[.\w]*[^\n]*", after)
    assert stores[-1].startswith("st.global.b32") and len(stores) == 3  # h (2 x 8 bytes), ticket
    silu_sig = dict(part_ptr="*fp32", h_ptr="*bf16", bexp_ptr="*i64", num_experts="i32",
                    N_half="i32", stride_ps="i32", stride_pr="i32", stride_h="i32")  # fmt: skip
    silu = _sm90_ptx(_silu_kernel, silu_sig, dict(SPLIT=4, BM=8, BC=64, PDL=True), warps=4)
    fused_ops = _float_ops_per_element(after, per_thread)
    assert fused_ops == _float_ops_per_element(silu, 8 * 64 // 128)  # [BM, BC] over 128 threads
    assert fused_ops["div.full.f32"] == 1 and fused_ops["ex2.approx.f32"] == 1
