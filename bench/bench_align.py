"""Expert alignment: the torch ops (`moe_align.align_by_expert`), the one-program sort it used
before (`align_sort.align_by_sort`) and the counting sort (`moe_align.align_by_expert_triton`),
CUDA-graph replays (do_bench medians), E=384, k=8, P = 8 .. 8192 pairs.

For each P and bm: the three times, whether the outputs equal the torch ones, the counting sort's
time with its base rows through memory instead of tl.gather, and (while the --budget lasts) its
time at every chunk size (64 .. 256; one chunk = one launch) and num_warps of `_place_kernel`.

    python3 bench/bench_align.py --out $OUT/align.json
    python3 bench/bench_align.py --smoke      # CPU, Triton interpreter, tiny
    python3 bench/bench_align.py --aot        # offline sm_90a compile: registers, spills, barriers
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIRS = [8, 80, 136, 680, 1360, 2720, 8192]  # 1360: DDTree budget 16 x 10 streams; 8192: a chunk
CHUNKS = [64, 128, 256]
WARPS = [1, 2, 4, 8, 16]


def _topk(t: int, k: int, e: int, gen):
    import torch

    scores = torch.rand(t, e, generator=gen, device=gen.device)  # [T, E]
    return scores.topk(k, dim=1).indices  # [T, k] distinct experts per token


def _case(p: int, k: int, e: int, bm: int, gen, sweep: bool) -> dict:
    import torch
    import triton
    from _util import time_ms
    from align_sort import align_by_sort

    from ddserve.kernels.moe_align import align_by_expert, align_by_expert_triton, chunk_size

    ids = _topk(p // k, k, e, gen)
    want = align_by_expert(ids, e, bm)

    def equal(fn) -> bool:
        return all(torch.equal(g, w) for g, w in zip(fn(), want, strict=True))

    fns = {
        "torch": lambda: align_by_expert(ids, e, bm),
        "sort": lambda: align_by_sort(ids, e, bm),
        "count": lambda: align_by_expert_triton(ids, e, bm),
        "count_memory": lambda: align_by_expert_triton(ids, e, bm, gather=False),
    }
    if sweep:
        for ch in CHUNKS:
            if ch != chunk_size(p) and p <= 32 * ch:  # <= 32 chunks (at most 256 at 8192 pairs)
                fns[f"count_chunk{ch}"] = lambda ch=ch: align_by_expert_triton(ids, e, bm, chunk=ch)
        nc2 = triton.next_power_of_2(triton.cdiv(p, chunk_size(p)))
        for w in WARPS:
            if nc2 == 1 or nc2 * 512 <= 2048 * w:  # <= 64 counts per thread (E2 = 512)
                fns[f"count_warps{w}"] = lambda w=w: align_by_expert_triton(ids, e, bm, num_warps=w)
    rec = dict(P=p, T=p // k, E=e, k=k, bm=bm, chunk=chunk_size(p))
    rec["equal"] = {name: equal(fn) for name, fn in fns.items()}
    rec["us"] = {name: time_ms(fn) * 1e3 for name, fn in fns.items()}
    us = rec["us"]
    swept = [f"{n[6:]}:{v:.1f}" for n, v in us.items() if n.startswith(("count_c", "count_w"))]
    print(
        f"P={p:5d} bm={bm:2d} torch {us['torch']:6.1f} us  sort {us['sort']:6.1f}  "
        f"count {us['count']:5.1f} (x{us['sort'] / us['count']:4.1f} vs sort)  "
        f"memory {us['count_memory']:5.1f}  "
        + " ".join(swept)
        + ("" if all(rec["equal"].values()) else f"  NOT EQUAL: {rec['equal']}"),
        flush=True,
    )
    return rec


def aot_report() -> None:
    """The counting sort's kernels as the launcher configures them for each P (bm 16, E = 384,
    tl.gather path), compiled for sm_90a without a GPU: registers and spill bytes (ptxas -v),
    barriers (bar.sync in the PTX). Needs no GPU."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import moe_align

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    sizes = dict(num_pairs="i32", num_experts="i32", num_blocks="i32", num_rows="i32")
    count_sig = dict(ids_ptr="*i64", counts_ptr="*i16", pairs_ptr="*i64", bexp_ptr="*i64", **sizes)
    place_sig = dict(ids_ptr="*i64", counts_ptr="*i16", scratch_ptr="*i16", pairs_ptr="*i64",
                     bexp_ptr="*i64", **sizes, num_chunks="i32")  # fmt: skip

    def report(kernel, sig: dict, meta: dict) -> str:
        consts = {k: v for k, v in meta.items() if k != "num_warps"}
        src = ASTSource(kernel, dict(sig, **dict.fromkeys(consts, "constexpr")), constexprs=consts)
        opts = {"num_warps": meta["num_warps"]}
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(c.asm["ptx"])
            f.flush()
            cmd = [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull]
            log = subprocess.run(cmd, capture_output=True, text=True).stderr
        regs = (re.findall(r"Used (\d+) registers", log) or ["?"])[0]
        spill = (re.findall(r"(\d+) bytes spill stores", log) or ["?"])[0]
        return (f"warps {meta['num_warps']:2d} registers {regs:>3s} spill stores {spill} B "
                f"bar.sync {c.asm['ptx'].count('bar.sync')}")  # fmt: skip

    for p in PAIRS:
        nc, _, count, place = moe_align.launch_plan(p, 384, 16)
        line = f"P={p:5d} chunk {place['CH']:3d} x {nc:2d}  place: "
        line += report(moe_align._place_kernel, place_sig, dict(place, GATHER=True))
        if nc > 1:
            line += "  count: " + report(moe_align._count_kernel, count_sig, count)
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the sweeps")
    ap.add_argument("--aot", action="store_true", help="only compile the kernels for sm_90a")
    args = ap.parse_args()
    if args.aot:
        return aot_report()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before ddserve's kernels are imported
    import torch
    from _util import environment, write_json

    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    pairs, e, k = ([8, 80, 136, 680], 64, 8) if args.smoke else (PAIRS, 384, 8)
    t0 = time.time()
    results = []
    for bm in (16, 8):
        for p in pairs:
            sweep = time.time() - t0 < args.budget
            results.append(_case(p, k, e, bm, gen, sweep))
    out = dict(env=environment(), bench="align", smoke=args.smoke, results=results)
    from ddserve.kernels import moe_align

    out["all_equal"] = all(all(r["equal"].values()) for r in results)
    out["gather_error"] = moe_align.GATHER_ERROR  # None: the tl.gather kernel compiled and ran
    print(f"all equal: {out['all_equal']}  ({time.time() - t0:.0f} s)")
    write_json(args.out, out)


if __name__ == "__main__":
    main()
