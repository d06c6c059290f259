"""`sass_loop`'s SASS parsing on a hand-written loop (no compiler needed), and, where Triton can
compile for sm_90 offline, the MoE up GEMM's loop itself."""

from __future__ import annotations

import sass_loop

from tests.triton_interp import require_sm90_compiler

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;  /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E.128 R8, desc[UR6][R2.64] ;  /* 0x0000000602087981 */
        /*0020*/                   LDG.E.64 R12, desc[UR6][R4.64] ;  /* 0x0000000604047981 */
        /*0030*/                   IADD3 R20, R12, 0x1, RZ ;  /* 0x000000010c147810 */
        /*0040*/                   FADD R21, R9, R21 ;  /* 0x0000001509157221 */
        /*0050*/                   LDG.E R30, desc[UR6][R6.64] ;  /* 0x0000000606067981 */
        /*0058*/                   LDGDEPBAR ;  /* 0x000000000000799a */
        /*0060*/               @P1 BRA 0x10 ;  /* 0xffffffec003c1947 */
        /*0070*/                   STG.E desc[UR6][R2.64], R30 ;  /* 0x0000001e02007986 */
        /*0080*/                   EXIT ;  /* 0x000000000000794d */
"""


def test_the_main_loop_and_each_loads_first_read() -> None:
    ins = sass_loop.parse(SASS)
    assert len(ins) == 10 and ins[1] == (0x10, "LDG.E.128 R8, desc[UR6][R2.64]")
    first, last = sass_loop.main_loop(ins)
    assert (first, last) == (1, 7)
    rep = sass_loop.loads_report(ins, first, last)
    assert rep["instructions"] == 7 and rep["mma"] == 0  # LDGDEPBAR is not a load
    # R8..R11 first read by the FADD (R9), 3 later; R12..R13 by the IADD3, 1 later; R30 is never
    # read inside the loop (only by the store after it)
    assert [(ld["at"], ld["read_after"]) for ld in rep["loads"]] == [(0, 3), (1, 1), (4, None)]
    assert sass_loop.issued_before_first_read(rep["loads"]) == 2  # read first at +1 (R12)


PREDICATED = """
        /*0000*/               @P1 LDG.E.64 R40, desc[UR6][R2.64] ;  /* 0x0000000602287981 */
        /*0010*/                   LDG.E R30, desc[UR6][R6.64] ;  /* 0x00000006061e7981 */
        /*0020*/                   FADD R5, R31, R50 ;  /* 0x0000003205057221 */
        /*0030*/                   MOV R30, R7 ;  /* 0x00000007001e7202 */
        /*0040*/                   FMUL R9, R41, R9 ;  /* 0x0000000929097220 */
        /*0050*/                   LDG.E R50, desc[UR6][R8.64] ;  /* 0x0000000608327981 */
        /*0060*/               @P0 BRA 0x0 ;  /* 0xfffffff800000947 */
"""


def test_widths_predicates_overwrites_and_the_back_edge() -> None:
    """A predicated 64-bit load is read through its second register; a 32-bit load's value is
    not read by an instruction that reads the register after it (the .64 of its address is not
    its width), and is dead once overwritten; a load read only in the next iteration counts
    around the back edge."""
    ins = sass_loop.parse(PREDICATED)
    rep = sass_loop.loads_report(ins, *sass_loop.main_loop(ins))
    assert rep["instructions"] == 7
    got = [(ld["at"], ld["load"], ld["read_after"]) for ld in rep["loads"]]
    assert got == [(0, "@P1 LDG.E.64", 4), (1, "LDG.E", None), (5, "LDG.E", 4)]


def test_straight_line_code_has_no_loop_and_reads_do_not_wrap() -> None:
    ins = sass_loop.parse(SASS.replace("@P1 BRA 0x10", "@P1 BRA 0x70"))
    assert sass_loop.main_loop(ins) is None
    rep = sass_loop.loads_report(ins, 0, len(ins) - 1, wrap=False)
    # the store after the former loop reads R30 (3 later); nothing reads a load past the end
    assert [(ld["at"], ld["read_after"]) for ld in rep["loads"]] == [(1, 3), (2, 1), (5, 3)]


def _compiled(kernel: str) -> str:
    """The kernel's sm_90 SASS, or a skip where this triton has no CUDA backend (a compile error
    of the kernel fails the test)."""
    require_sm90_compiler()
    return sass_loop.compile_sass(kernel, {})


def test_the_moe_up_gemm_loop_compiles_and_has_its_mmas() -> None:
    ins = sass_loop.parse(_compiled("up"))
    rep = sass_loop.loads_report(ins, *sass_loop.main_loop(ins))
    # BN 128 rows over 4 warps, BK 128, BM 8 tokens: 2 x 8 m16n8k16 MMAs per warp and step
    assert rep["mma"] == 16
    assert any(ld["load"].endswith("LDG.E.128") for ld in rep["loads"])  # the weight stream


def test_loops_report_lists_every_loop_with_its_opcodes() -> None:
    two = SASS.replace("/*0080*/                   EXIT", "/*0080*/               @P2 BRA 0x70")
    loops = sass_loop.loops_report(sass_loop.parse(two))
    assert [(lp["first"], lp["last"], lp["instructions"]) for lp in loops] == [(1, 7, 7), (8, 9, 2)]
    assert loops[0]["opcodes"]["LDG"] == 3 and loops[0]["opcodes"]["BRA"] == 1
    assert loops[1]["opcodes"] == {"STG": 1, "BRA": 1}


def test_the_tree_attention_kernel_compiles_with_its_shared_tile_loop() -> None:
    loops = sass_loop.loops_report(sass_loop.parse(_compiled("tree")))
    # the shared-tile loop: one 64-key tile over 8 warps at 16 rows: 36 MMAs for the scores
    # (512 + 64 columns), 32 for the values, 4 for the row sums
    assert any(lp["opcodes"].get("HMMA") == 72 and lp["opcodes"].get("LDGSTS") for lp in loops)


def test_the_split_merge_compiles_with_its_loop_over_runs_of_groups() -> None:
    ins = sass_loop.parse(_compiled("merge"))
    rep = sass_loop.loads_report(ins, *sass_loop.main_loop(ins))
    # a run of MERGE_GROUPS groups of 4 parts: each part's max, sum and values (one 128-bit
    # load per thread and 128 values), so at least 3 loads per part
    from ddserve.kernels.tree_attn_invariant import MERGE_GROUPS

    assert len(rep["loads"]) >= 3 * 4 * MERGE_GROUPS
    assert sass_loop.issued_before_first_read(rep["loads"]) >= 4  # more than one part's
