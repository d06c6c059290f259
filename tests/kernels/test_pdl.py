"""Programmatic dependent launch (ddserve/kernels/pdl.py): when it is on, and the contract every
PDL kernel keeps (its programs wait for the previous kernel before touching memory that another
kernel writes or reads, reading before it only metadata that no layer of the forward writes, and
before any early return). The contract is checked on the source of
every kernel with a `PDL` parameter and on the sm_90 PTX of the matmul (whose weight prefetch
comes before the wait) and of the Gluon MoE kernel, compiled on the CPU. That PDL leaves results
unchanged on an H200 is checked by tests/gpu/test_pdl_gpu.py."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap

import pytest
import torch

from ddserve.kernels import backend, pdl
from ddserve.kernels.config import KernelConfig
from tests.triton_interp import require_sm90_compiler, require_triton

PDL_MODULES = (
    "invariant", "fused", "router", "tree_attn_invariant", "moe_align", "moe_reduce", "moe_gluon",
    "draft_topk", "tree_beam",
)  # fmt: skip
MEMORY_CALLS = {"load", "store", "async_copy", "async_copy_global_to_shared"} | {
    f"atomic_{op}" for op in ("add", "cas", "xchg", "max", "min", "and", "or", "xor")
}  # fmt: skip


def test_pdl_is_on_by_default_and_ddserve_pdl_0_turns_it_off() -> None:
    assert KernelConfig().pdl
    assert KernelConfig.resolve(True, env={}).pdl
    for off in ("0", "off", "False", "no"):
        assert not KernelConfig.resolve(True, env={"DDSERVE_PDL": off}).pdl
    assert KernelConfig.resolve(False, env={"DDSERVE_PDL": "1"}).pdl


def test_no_pdl_on_the_cpu_or_when_the_config_says_off(monkeypatch) -> None:
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setattr(pdl, "_interpreting", lambda: False)
    cuda = torch.device("cuda", 0)
    assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    with backend.kernel_mode(KernelConfig(pdl=False)):
        assert pdl.launch_options(cuda) == {"PDL": False}
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # before sm_90
    assert pdl.launch_options(cuda) == {"PDL": False}


def _pdl_kernels() -> list[tuple[str, ast.FunctionDef]]:
    out = []
    for name in PDL_MODULES:
        mod = importlib.import_module(f"ddserve.kernels.{name}")
        tree = ast.parse(textwrap.dedent(inspect.getsource(mod)))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and "PDL" in [a.arg for a in node.args.args]:
                out.append((f"{name}.{node.name}", node))
    return out


def _is_wait(stmt: ast.stmt) -> bool:
    """`pdl_begin(PDL)`, or an `if PDL:` whose body executes griddepcontrol.wait (Gluon)."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        return ast.unparse(stmt.value) == "pdl_begin(PDL)"
    return isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "PDL" and (
        "griddepcontrol.wait" in ast.unparse(stmt)
    )  # fmt: skip


PRE_WAIT = ("prefetch", "read_meta")  # name prefixes of the helpers a kernel may call pre-wait


def test_prefetch_helpers_only_read() -> None:
    """What a kernel may call before its wait besides `prefetch_l2`: `prefetch_*` helpers, which
    load addresses (metadata) and ask L2 for lines, and `read_meta_*` helpers, which load
    metadata no layer of the forward writes; neither writes."""
    require_triton()
    helpers = []
    for name in PDL_MODULES:
        mod = importlib.import_module(f"ddserve.kernels.{name}")
        tree = ast.parse(textwrap.dedent(inspect.getsource(mod)))
        helpers += [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                    and n.name.startswith(PRE_WAIT)]  # fmt: skip
    assert sorted(h.name for h in helpers) == [
        "prefetch_prefix_keys", "read_meta_block", "read_meta_in_blocks"]  # fmt: skip
    for h in helpers:
        calls = {n.func.attr for n in ast.walk(h) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute)}  # fmt: skip
        assert not calls & (MEMORY_CALLS - {"load"}), (h.name, calls)


def test_every_pdl_kernel_waits_before_touching_memory_or_returning() -> None:
    require_triton()
    kernels = _pdl_kernels()
    names = {n for n, _ in kernels}
    assert {"invariant._mm_kernel", "moe_gluon._w4_gemm_kernel", "router._select_kernel"} <= names
    for name, fn in kernels:
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(
            fn.body[0].value, ast.Constant) else fn.body  # fmt: skip
        waits = [i for i, st in enumerate(body) if _is_wait(st)]
        assert waits, f"{name} has a PDL parameter but never waits"
        for stmt in body[: waits[0]]:
            for node in ast.walk(stmt):
                assert not isinstance(node, ast.Return), f"{name} may return before its wait"
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    assert node.func.attr not in MEMORY_CALLS, (
                        f"{name}: {ast.unparse(node)[:80]} before the wait"
                    )  # fmt: skip
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    assert node.func.id.startswith(PRE_WAIT), (
                        f"{name}: {node.func.id}(...) before the wait (only {PRE_WAIT} helpers)"
                    )  # fmt: skip


def _order(ptx: str) -> tuple[int, int, int]:
    """(first griddepcontrol.wait, first global memory access, last L2 prefetch) in the PTX."""
    wait = ptx.find("griddepcontrol.wait")
    mem = re.search(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.)", ptx)
    pref = ptx.rfind("prefetch.global.L2")
    return wait, mem.start() if mem else len(ptx), pref


def _compile(src, warps: int, stages: int = 3) -> str:
    """PTX for sm_90; skips only where this triton has no CUDA backend (a compile error of the
    kernel fails the test)."""
    import triton
    from triton.backends.compiler import GPUTarget

    require_sm90_compiler()
    opts = {"num_warps": warps, "num_stages": stages, "launch_pdl": True}
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]


def test_matmul_ptx_prefetches_weights_then_waits_before_any_memory_access() -> None:
    require_triton()
    from triton.compiler import ASTSource

    from ddserve.kernels import invariant

    strides = ["sxm", "sxh", "sxk", "swh", "swk", "swn", "sps", "sym", "syh", "syn"]
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", r_ptr="*bf16", part_ptr="*fp32",
               ticket_ptr="*i32")  # fmt: skip
    sig.update(M="i32", N="i32", **dict.fromkeys(strides, "i32"))
    consts = dict(K=7168, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT=8, K_PER=896, FP32=False)
    consts.update(PRECISION="", INTERPRET=False, REDUCE=True, PF_LINES=4, PF_STEP=64, PDL=True,
                  ADD=False)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    ptx = _compile(ASTSource(invariant._mm_kernel, sig, constexprs=consts), warps=4, stages=4)
    wait, mem, pref = _order(ptx)
    assert 0 <= pref < wait < mem, (pref, wait, mem)
    assert "griddepcontrol.launch_dependents" in ptx


def test_router_ptx_prefetches_the_gate_then_waits_before_any_memory_access() -> None:
    require_triton()
    from triton.compiler import ASTSource

    from ddserve.kernels import router

    sig = dict(x_ptr="*bf16", w_ptr="*bf16", part_ptr="*fp32", T="i32", sx="i32", sw="i32")
    consts = dict(E=384, D=7168, E_PAD=384, BLOCK_T=64, BLOCK_E=32, BLOCK_K=32, UNROLL=4, SPLIT=7)
    consts.update(K_PER=1024, MMA=True, BF16=True, PDL=True, PF_LINES=16, PF_STEP=64)
    sig.update(dict.fromkeys(consts, "constexpr"))
    ptx = _compile(ASTSource(router._gate_partials_kernel, sig, constexprs=consts), warps=4)
    wait, mem, pref = _order(ptx)
    assert 0 <= pref < wait < mem, (pref, wait, mem)


def test_tree_attention_ptx_reads_only_metadata_before_its_wait() -> None:
    """Before the wait: the prefix length and slots (loads) and the key prefetches; every store,
    copy and atomic after it, and the query/key loads too (checked as: the first load after the
    prefetches comes after the wait). Compiled at the engine's sm_90 configuration with the
    16-divisibility the JIT gives the pointers and the specialised strides on the GPU; a compile
    error fails the test."""
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import tree_attn_invariant as ta

    require_sm90_compiler()
    names = ("ql_ptr", "qr_ptr", "kv_ptr", "out_ptr", "po_ptr", "plse_ptr", "pl_ptr",
             "q_starts_ptr", "q_lens_ptr", "pslots_ptr", "plens_ptr", "bslots_ptr",
             "mask_ptr")  # fmt: skip
    types = ("*bf16",) * 4 + ("*fp32",) * 3 + ("*i64",) * 5 + ("*u8",)
    sig = dict(zip(names, types, strict=True), scale_log2="fp32")
    ints = ("tiles", "nsplit", "stride_qt", "stride_qh", "stride_rt", "stride_rh", "stride_kv",
            "stride_ot", "stride_oh", "stride_ps", "stride_mb", "stride_mq")  # fmt: skip
    sig.update(dict.fromkeys(ints, "i32"))
    consts = dict(H=8, R=512, P=64, BM=16, BN=64, SPLIT=256, PDL=True, ROW_LINES=9, LINE_PAD=16)
    consts.update(LINE_STEP=64, OFF64=False, LEAVES=1)
    sig.update(dict.fromkeys(consts, "constexpr"))
    kernel = ta._tree_attn_inv_kernel
    divisible = [*names, *(n for n in ints if n not in kernel.do_not_specialize)]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 8, "num_stages": 3, "launch_pdl": True}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]
    wait, pref = ptx.find("griddepcontrol.wait"), ptx.rfind("prefetch.global.L2")
    write = re.search(r"\b(st\.global|cp\.async|atom\.|red\.)", ptx)
    assert 0 <= pref < wait < (write.start() if write else len(ptx))
    before = ptx[:wait]
    assert len(re.findall(r"\bld\.global", before)) <= 2 + 256, "more than plen and the slots"


@pytest.mark.parametrize("pfa,down", [(0, False), (2, False), (0, True)])
def test_gluon_moe_ptx_waits_before_any_memory_access(pfa: int, down: bool) -> None:
    """The up GEMM (fp32 partials; with and without its L2 asks) and the down GEMM (bf16 pair
    outputs, `moe_v3` PAIRS) compile for sm_90 and touch memory only after the PDL wait."""
    require_triton()
    from triton.experimental.gluon._runtime import GluonASTSource

    from ddserve.kernels.moe_gluon import _w4_gemm_kernel

    sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", out_ptr="*bf16" if down else "*fp32",
               pairs_ptr="*i64", bexp_ptr="*i64", tw_ptr="*fp32")  # fmt: skip
    ints = ("num_pairs", "num_experts", "num_mblocks", "N", "K", "stride_x", "stride_os",
            "stride_or", "expert_words", "expert_scales")  # fmt: skip
    sig.update(dict.fromkeys(ints, "i32"))
    shape = dict(KS_TOTAL=2, KSTEPS=2, NT=4, SPLIT=1) if down else dict(KS_TOTAL=56, KSTEPS=14,
                                                                        NT=1, SPLIT=4)  # fmt: skip
    consts = dict(TOPK=8, GATHER=not down, W=4, NREP=2, BM=8, **shape, DOWN=down, DEPTH=1,
                  UNROLL=False, PDL=True, PFA=pfa)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    ptx = _compile(GluonASTSource(fn=_w4_gemm_kernel, signature=sig, constexprs=consts), warps=4)
    wait, mem, _ = _order(ptx)
    assert 0 <= wait < mem, (wait, mem)
    first_ask = ptx.find("prefetch.global.L2")  # the L2 asks ahead come after the wait too
    assert (first_ask > wait) if pfa else first_ask == -1
    assert "griddepcontrol.launch_dependents" in ptx
