"""The invariant tree attention's in-kernel split merge (ddserve/kernels/tree_attn_invariant.py),
without a GPU: its sm_90 PTX keeps the ticket protocol's order (partials stored, CTA barrier,
one acq_rel atomic at GPU scope, the ticket broadcast behind a barrier, partials read back
through L2), and the ticket scratch keeps every buffer it handed out. The merge's results
(bitwise the two-launch merge, in any program order) are checked in the interpreter
(test_tree_attn_triton_interp.py) and on an H200 (tests/gpu/test_tree_attn_triton.py)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from tests.triton_interp import require_triton


def _one_launch_ptx() -> str:
    """PTX of the one-launch kernel at the engine's sm_90 configuration (K2.6 widths, 64-key
    tiles in 3 stages, 8 warps), with the 16-divisibility the JIT gives the pointers and the
    specialised strides on the GPU (an sm_90 pass failed on exactly that: tests/gpu found it)."""
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import tree_attn_invariant as ta

    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton has no CUDA backend to compile for sm_90: {e}")
    names = ("ql_ptr", "qr_ptr", "kv_ptr", "out_ptr", "po_ptr", "plse_ptr", "ticket_ptr",
             "q_starts_ptr", "q_lens_ptr", "pslots_ptr", "plens_ptr", "bslots_ptr",
             "mask_ptr")  # fmt: skip
    types = ("*bf16",) * 4 + ("*fp32",) * 2 + ("*i32",) + ("*i64",) * 5 + ("*i8",)
    sig = dict(zip(names, types, strict=True), scale_log2="fp32")
    ints = ("tiles", "nsplit", "nrows", "stride_qt", "stride_qh", "stride_rt", "stride_rh",
            "stride_kv", "stride_ot", "stride_oh", "stride_ps", "stride_mb",
            "stride_mq")  # fmt: skip
    sig.update(dict.fromkeys(ints, "i32"))
    consts = dict(H=8, R=512, P=64, BM=16, BN=64, SPLIT=256, PDL=True, ROW_LINES=0, LINE_PAD=1)
    consts.update(LINE_STEP=64, REDUCE=True)
    sig.update(dict.fromkeys(consts, "constexpr"))
    divisible = [*names, "stride_qt", "stride_qh", "stride_rt", "stride_rh", "stride_kv",
                 "stride_ot", "stride_oh"]  # fmt: skip
    arg_names = list(sig)
    attrs = {(arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(ta._tree_attn_inv_kernel, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 8, "num_stages": 3, "launch_pdl": True}
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]


def _at(ptx: str, pattern: str) -> list[int]:
    return [m.start() for m in re.finditer(pattern, ptx)]


def test_merge_ptx_takes_one_acq_rel_ticket_between_barriers_and_reads_partials_from_l2():
    ptx = _one_launch_ptx()
    wait = ptx.find("griddepcontrol.wait")
    writes = _at(ptx, r"\b(st\.global|atom\.|red\.)")
    assert 0 <= wait < min(writes), "a global write before the PDL wait"
    atoms = re.findall(r"\batom\.\S+", ptx)
    assert atoms == ["atom.global.gpu.acq_rel.add.u32"], atoms  # one ticket, GPU scope
    atom = ptx.find("atom.global")
    stores = [p for p in _at(ptx, r"\bst\.global") if p < atom]
    barriers = _at(ptx, r"\bbar\.sync")
    assert any(max(stores) < b < atom for b in barriers), "no barrier between partials and ticket"
    reads = _at(ptx, r"\bld\.global\.cg")
    assert reads and min(reads) > atom, "partials read back before the ticket, or through L1"
    assert any(atom < b < min(reads) for b in barriers), "the ticket reaches the CTA unsynced"


def test_merge_source_syncs_the_cta_before_taking_the_ticket():
    """The barrier before the atomic is in the source: the PTX above also has one from triton's
    own shared-memory synchronisation, which no kernel change should be left to rely on."""
    require_triton()
    from ddserve.kernels import tree_attn_invariant as ta

    src = inspect.getsource(ta._merge_if_last.fn)
    assert 0 <= src.find("tl.debug_barrier()") < src.find("tl.atomic_add(")


def test_tickets_grow_by_doubling_and_keep_every_buffer_handed_out():
    from ddserve.kernels.tree_attn_invariant import _Tickets

    cpu = torch.device("cpu")
    scratch = _Tickets()
    first = scratch.take(10, cpu)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert scratch.take(first.numel(), cpu) is first  # fits: the same buffer
    grown = scratch.take(first.numel() + 1, cpu)
    assert grown.numel() >= 2 * first.numel() and not grown.any()
    assert scratch.retired == [first] and scratch.take(5, cpu) is grown
