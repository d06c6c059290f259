"""Expert alignment: the torch ops (`moe_align.align_by_expert`) vs the one-launch Triton kernel
(`moe_align.align_by_expert_triton`), CUDA-graph replays (do_bench medians), E=384, k=8.

For each T and bm: both times, their ratio, whether the outputs are equal, the time of the Triton
fallback path (neighbours through memory, not tl.gather), and the Triton time at every num_warps
(1 .. 16; the default picks by P) while the --budget lasts.

    python3 bench/bench_align.py --out $OUT/align.json
    python3 bench/bench_align.py --smoke      # CPU, Triton interpreter, tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS = [1, 10, 48, 96, 192, 384, 768, 1024]
WARPS = [1, 2, 4, 8, 16]


def _topk(t: int, k: int, e: int, gen):
    import torch

    scores = torch.rand(t, e, generator=gen, device=gen.device)  # [T, E]
    return scores.topk(k, dim=1).indices  # [T, k] distinct experts per token


def _case(t: int, k: int, e: int, bm: int, gen, sweep: bool) -> dict:
    import torch
    from _util import time_ms

    from ddserve.kernels.moe_align import _num_warps, align_by_expert, align_by_expert_triton

    ids = _topk(t, k, e, gen)
    want = align_by_expert(ids, e, bm)
    got = align_by_expert_triton(ids, e, bm)
    equal = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    torch_ms = time_ms(lambda: align_by_expert(ids, e, bm))
    triton_ms = time_ms(lambda: align_by_expert_triton(ids, e, bm))
    memory_ms = time_ms(lambda: align_by_expert_triton(ids, e, bm, gather=False))
    p2 = max(16, 1 << (t * k - 1).bit_length())
    rec = dict(T=t, P=t * k, E=e, k=k, bm=bm, equal=equal, torch_ms=torch_ms, triton_ms=triton_ms,
               speedup=torch_ms / triton_ms, triton_memory_ms=memory_ms,
               default_warps=_num_warps(p2))  # fmt: skip
    if sweep:
        rec["triton_ms_by_warps"] = {
            w: time_ms(lambda w=w: align_by_expert_triton(ids, e, bm, num_warps=w))
            for w in WARPS
            if p2 <= 1024 * w  # <= 32 keys per thread (more spills and takes minutes to compile)
        }
    print(
        f"T={t:5d} P={t * k:5d} bm={bm:2d} equal={equal} torch {torch_ms * 1e3:7.1f} us  "
        f"triton {triton_ms * 1e3:7.1f} us  x{torch_ms / triton_ms:5.1f}  "
        f"(memory path {memory_ms * 1e3:7.1f} us)  "
        + " ".join(f"w{w}:{ms * 1e3:.1f}" for w, ms in rec.get("triton_ms_by_warps", {}).items()),
        flush=True,
    )
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the num_warps sweep")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before ddserve's kernels are imported
    import torch
    from _util import environment, write_json

    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    tokens, e, k = ([1, 10], 64, 8) if args.smoke else (TOKENS, 384, 8)
    t0 = time.time()
    results = []
    for bm in (16, 8):
        for t in tokens:
            sweep = not args.smoke and time.time() - t0 < args.budget
            results.append(_case(t, k, e, bm, gen, sweep))
    out = dict(env=environment(), bench="align", smoke=args.smoke, results=results)
    from ddserve.kernels import moe_align

    out["all_equal"] = all(r["equal"] for r in results)
    out["gather_error"] = moe_align.GATHER_ERROR  # None: the tl.gather kernel compiled and ran
    print(f"all equal: {out['all_equal']}  ({time.time() - t0:.0f} s)")
    write_json(args.out, out)


if __name__ == "__main__":
    main()
