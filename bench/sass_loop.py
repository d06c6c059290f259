"""Where the loads of a kernel's main loop sit in its sm_90 SASS, compiled offline (no GPU).

    python bench/sass_loop.py                           # the MoE up GEMM at one token (BM 8)
    python bench/sass_loop.py --kernel down --set BM=16 --set DEPTH=2 --out loop.json
    python bench/sass_loop.py --kernel tree --set BM=32      # tree attention: its loops
    python bench/sass_loop.py --kernel merge                 # tree attention's split merge

Compiles a W4A16 MoE kernel (`moe_gluon._w4_up_silu_kernel` or `_w4_gemm_kernel` as the down
projection) for sm_90 with Triton's bundled ptxas, integer arguments specialised for 16-byte
divisibility as the runtime specialises them (without that, loads come out scalar), disassembles
it (cuobjdump) and finds the main loop: the backward branch that spans the most instructions
(a kernel without one, e.g. with its step loop unrolled, is reported whole, in program order).
For each global load in the loop it reports where it is issued (instructions from the loop's
start) and how many instructions later its first destination register is read, wrapping around
the back edge: a load whose value is read a few instructions later makes the warp wait a whole
memory latency (~600-1000 cycles from HBM) each iteration, unless other warps on the same
scheduler have work. The MoE kernels run one 4-warp program per SM at one token, so one warp
per scheduler.
`--kernel tree` compiles the batch-invariant tree attention (`_tree_attn_inv_kernel`, K2.6 rank
widths, 64-key tiles, 3 stages, 8 warps, decode's 16-row tiles unless --set BM=32) and reports
its size and every loop (instructions and most frequent opcodes): the 64-key shared-tile loop,
the tail tiles' loops, the mask loop; what comes before the first loop is the prologue.
`--kernel merge` compiles tree attention's split merge (`_combine_kernel`, K2.6 widths, a tile per
program: LEAVES 4, MERGE_GROUPS groups a run, 4 warps) and reports its main loop (a run of
groups) like the MoE kernels', plus how many of the loop's loads are issued before the first
loaded value is read (the merge's memory round trips per run).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT_INTS = ("num_pairs", "num_mblocks")  # runtime ints the kernels do not specialise
OPTIONAL = dict(UNROLL=False, PFA=0)  # constexprs of kernel versions that have them (defaults)
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
REG = re.compile(r"\bR(\d+)\b")


TREE_PTRS = ("ql_ptr", "qr_ptr", "kv_ptr", "out_ptr", "po_ptr", "plse_ptr", "pl_ptr",
             "q_starts_ptr", "q_lens_ptr", "pslots_ptr", "plens_ptr", "bslots_ptr",
             "mask_ptr")  # fmt: skip
TREE_TYPES = ("*bf16",) * 4 + ("*fp32",) * 3 + ("*i64",) * 5 + ("*u8",)
# strides the runtime specialises (16-divisible at K2.6 widths); the kernel's do_not_specialize
# integers (tiles, nsplit, stride_ps, stride_mb, stride_mq) get no divisibility
TREE_STRIDES = ("stride_qt", "stride_qh", "stride_rt", "stride_rh", "stride_kv", "stride_ot",
                "stride_oh")  # fmt: skip


def _tree_kernel():
    from ddserve.kernels import tree_attn_invariant

    sig = dict(zip(TREE_PTRS, TREE_TYPES, strict=True))
    sig["scale_log2"] = "fp32"
    ints = ("tiles", "nsplit", *TREE_STRIDES, "stride_ps", "stride_mb", "stride_mq")
    consts = dict(H=8, R=512, P=64, BM=16, BN=64, SPLIT=256, PDL=True, ROW_LINES=0, LINE_PAD=1,
                  LINE_STEP=64, OFF64=False, LEAVES=1)  # fmt: skip
    return tree_attn_invariant._tree_attn_inv_kernel, sig, ints, consts


MERGE_PTRS = ("po_ptr", "plse_ptr", "pl_ptr", "out_ptr", "q_starts_ptr", "q_lens_ptr")


def _merge_kernel():
    from ddserve.kernels import tree_attn_invariant

    sig = dict(zip(MERGE_PTRS, ("*fp32",) * 3 + ("*bf16",) + ("*i64",) * 2, strict=True))
    ints = ("nblocks", "stride_ot", "stride_oh", "NSPLIT")
    consts = dict(H=8, R=512, PDL=True, LEAVES=4, GB=tree_attn_invariant.MERGE_GROUPS, BS=64)
    return tree_attn_invariant._combine_kernel, sig, ints, consts


def _kernel(name: str, pairs: str = "bf16"):
    from ddserve.kernels import moe_gluon

    if name == "tree":
        return _tree_kernel()
    if name == "merge":
        return _merge_kernel()
    if name == "up":
        sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", part_ptr="*fp32",
                   pairs_ptr="*i64", bexp_ptr="*i64", h_ptr="*bf16", ticket_ptr="*i32")  # fmt: skip
        ints = ("num_pairs", "num_experts", "num_mblocks", "N", "K", "stride_x", "stride_ps",
                "stride_pr", "stride_h", "expert_words", "expert_scales")  # fmt: skip
        consts = dict(TOPK=8, W=4, NREP=2, BM=8, KS_TOTAL=56, KSTEPS=14, SPLIT=4, DEPTH=1, PDL=True)
        return moe_gluon._w4_up_silu_kernel, sig, ints, consts
    sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", out_ptr=f"*{pairs}", pairs_ptr="*i64",
               bexp_ptr="*i64", tw_ptr="*fp32")  # fmt: skip
    ints = ("num_pairs", "num_experts", "num_mblocks", "N", "K", "stride_x", "stride_os",
            "stride_or", "expert_words", "expert_scales")  # fmt: skip
    consts = dict(TOPK=8, GATHER=False, W=4, NREP=2, BM=8, KS_TOTAL=2, KSTEPS=2, NT=4, SPLIT=1,
                  DOWN=True, DEPTH=1, PDL=True)  # fmt: skip
    return moe_gluon._w4_gemm_kernel, sig, ints, consts


def compile_sass(kernel: str, overrides: dict, pairs: str = "bf16") -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    fn, sig, ints, consts = _kernel(kernel, pairs)
    consts.update(OPTIONAL)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}  # this version's constexprs
    unknown = set(overrides) - set(consts)
    if unknown:
        raise SystemExit(f"--set: unknown constexprs {sorted(unknown)} (known: {sorted(consts)})")
    consts.update(overrides)
    sig.update(dict.fromkeys(ints, "i32"))
    sig.update(dict.fromkeys(consts, "constexpr"))
    if kernel == "tree":
        div = [n for n in sig if n in TREE_PTRS + TREE_STRIDES]
        source, options = ASTSource, {"num_warps": 8, "num_stages": 3, "launch_pdl": True}
    elif kernel == "merge":
        div = list(MERGE_PTRS)
        source, options = ASTSource, {"num_warps": 4, "launch_pdl": True}
    else:
        div = [n for n in sig if sig[n] != "constexpr" and n not in ROOT_INTS]
        source, options = GluonASTSource, {"num_warps": consts["W"], "launch_pdl": consts["PDL"]}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = source(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def parse(sass: str) -> list[tuple[int, str]]:
    """[(byte offset, instruction text)] in program order."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in INSTR.finditer(sass)]


def _back_edges(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of every backward branch (a loop), in branch order."""
    at = {off: i for i, (off, _) in enumerate(ins)}
    edges = []
    for i, (_, text) in enumerate(ins):
        m = re.search(r"\bBRA 0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) in at and at[int(m.group(1), 16)] < i:
            edges.append((at[int(m.group(1), 16)], i))
    return edges


def main_loop(ins: list[tuple[int, str]]) -> tuple[int, int] | None:
    """(first, last) instruction indices of the backward branch that spans the most; None for
    straight-line code (a kernel whose loops are all unrolled)."""
    best = None
    for span in _back_edges(ins):
        if best is None or span[1] - span[0] > best[1] - best[0]:
            best = span
    return best


def _opcode(text: str) -> str:
    return text.split()[1] if text.startswith("@") else text.split()[0]


def _dests(text: str) -> set[int]:
    """Registers a load writes: R<n> and, for an .64 / .128 opcode, the ones after it."""
    regs = REG.findall(text.split(",")[0])
    if not regs:
        return set()
    op = _opcode(text)
    width = 4 if op.endswith(".128") else 2 if op.endswith(".64") else 1
    return set(range(int(regs[0]), int(regs[0]) + width))


def _sources(text: str) -> set[int]:
    """Registers an instruction reads: every register operand but a destination (the first
    operand, except for stores and reductions, which read all of theirs), and both halves of a
    64-bit address `[Rn.64]`. An operand that spans several registers by its opcode (an MMA
    fragment, a vector store's value) counts by its first register only."""
    parts = text.split(",", 1)
    srcs = parts[1] if len(parts) > 1 else ""
    if re.match(r"(ST|STG|STS|RED)\b|(ST|STG|STS|RED)\.", _opcode(text)):
        srcs = text
    regs = {int(r) for r in REG.findall(srcs)}
    regs |= {int(r) + 1 for r in re.findall(r"\bR(\d+)\.64\b", srcs)}
    return regs


def _overwrites(text: str, regs: set[int]) -> bool:
    """Whether the instruction surely replaces all of `regs` (unpredicated; its destination, the
    first operand of a non-store, covers them)."""
    if text.startswith("@") or re.match(r"(ST|STG|STS|RED|ATOM|BRA)", _opcode(text)):
        return False
    return regs <= _dests(text) if _opcode(text).startswith("LDG") else regs <= {
        int(r) for r in REG.findall(text.split(",")[0])
    }  # fmt: skip


def loads_report(ins: list[tuple[int, str]], first: int, last: int, wrap: bool = True) -> dict:
    """Per register load of ins[first .. last]: where it is and how many instructions later its
    value is first read, around the back edge when `wrap` (a loop body)."""
    body = [text for _, text in ins[first : last + 1]]
    n = len(body)
    loads = []
    for i, text in enumerate(body):
        op = _opcode(text)
        if not (op == "LDG" or op.startswith("LDG.")):  # register loads (not LDGSTS, LDGDEPBAR)
            continue
        dest, use = _dests(text), None
        for d in range(1, n + 1 if wrap else n - i):  # program order (around the back edge)
            nxt = body[(i + d) % n]
            if dest & _sources(nxt):
                use = d
                break
            if _overwrites(nxt, dest):  # replaced before any read
                break
        loads.append(dict(at=i, load=text.split()[0] if "@" not in text else " ".join(
            text.split()[:2]), read_after=use))  # fmt: skip
    return dict(
        instructions=n,
        mma=sum("HMMA" in t or "HGMMA" in t for t in body),
        loads=loads,
    )


def issued_before_first_read(loads: list[dict]) -> int:
    """How many of `loads_report`'s loads are issued before the first read of any of them (in
    one pass through the body: a warp stalls at that read until its value arrives)."""
    reads = [ld["at"] + ld["read_after"] for ld in loads if ld["read_after"] is not None]
    first = min(reads, default=None)
    return sum(first is None or ld["at"] < first for ld in loads)


def loops_report(ins: list[tuple[int, str]], top: int = 12) -> list[dict]:
    """Every loop (a backward branch) in program order: its first and last instruction index,
    its length and its most frequent opcodes (modifiers dropped)."""
    out = []
    for first, last in sorted(_back_edges(ins)):
        ops = collections.Counter(_opcode(t).split(".")[0] for _, t in ins[first : last + 1])
        out.append(dict(first=first, last=last, instructions=last - first + 1,
                        opcodes=dict(ops.most_common(top))))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernel", choices=("up", "down", "tree", "merge"), default="up")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a constexpr of the kernel (repeatable), e.g. BM=16, DEPTH=2")  # fmt: skip
    ap.add_argument("--pairs", choices=("bf16", "fp32"), default="bf16",
                    help="--kernel down: its per-pair outputs' dtype (moe_v3 PAIRS)")  # fmt: skip
    ap.add_argument("--sass", default=None, help="also write the whole SASS here")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = {"True": True, "False": False}.get(value, None)
        if overrides[name] is None:
            overrides[name] = int(value)
    sass = compile_sass(args.kernel, overrides, args.pairs)
    if args.sass:
        Path(args.sass).write_text(sass)
    ins = parse(sass)
    if args.kernel == "tree":
        rep = dict(kernel="tree", overrides=overrides, instructions=len(ins),
                   loops=loops_report(ins))  # fmt: skip
        print(f"tree {overrides}: {len(ins)} instructions")
        for lp in rep["loops"]:
            ops = ", ".join(f"{k} {v}" for k, v in lp["opcodes"].items())
            print(f"  loop [{lp['first']}, {lp['last']}] {lp['instructions']} instructions: {ops}")
        if args.out:
            Path(args.out).write_text(json.dumps(rep, indent=1))
        return
    loop = main_loop(ins)
    first, last = loop if loop is not None else (0, len(ins) - 1)
    rep = dict(kernel=args.kernel, overrides=overrides, loop=loop is not None,
               **loads_report(ins, first, last, wrap=loop is not None))  # fmt: skip
    where = "main loop" if loop is not None else "straight-line kernel (no loop)"
    print(f"{args.kernel} {overrides}: {where} {rep['instructions']} instructions, "
          f"{rep['mma']} MMAs")  # fmt: skip
    for ld in rep["loads"]:
        print(
            f"  +{ld['at']:4d}  {ld['load']:<34} first read {ld['read_after']} instructions later"
        )
    rep["loads_before_first_read"] = issued_before_first_read(rep["loads"])
    print(f"  {rep['loads_before_first_read']} of {len(rep['loads'])} loads issued before the "
          f"first loaded value is read")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
