"""MoE kernel time vs the weight-streaming floor, K2.6 expert shapes per rank at tp=8.

w13 [384, 512, 7168] and w2 [384, 7168, 256] INT4 (group 32, bf16 scales), top-8, hidden 7168.
T = ratio * 384 / 8 tokens per step for ratio = tokens per expert. Bytes = distinct experts touched
(measured from the routing) x one expert's packed weights and scales, + x read + output written.
Times are CUDA-graph replays (do_bench medians, L2 flushed). With --variants every kernel variant
(v1, v2, invariant on/off, asm dequant on/off, split-K and tile configs) is timed at every ratio
in one run, most important variants first, within --budget seconds; `moe_ref` (the plain torch
path) is timed at two sizes at the end.

    cd bench && python3 bench_moe.py --variants --out $OUT/moe.json
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from _util import copy_bandwidth_gbs, device, environment, rel_err, time_ms, write_json

from ddserve.kernels.moe_ref import ExpertWeights, moe_ref
from ddserve.kernels.moe_triton import _pick_bm, align_by_expert, fused_moe

RATIOS = [8 / 384, 0.2, 0.5, 1, 2, 4, 8, 16]  # the first is one decode token (T = 1)
# (name, config, invariant), in priority order (a run out of budget drops the last ones)
VARIANTS = [
    ("v1", {"variant": "v1"}, False),
    ("v2", {"variant": "v2"}, False),
    ("v2-inv", {"variant": "v2"}, True),
    ("v2-noasm", {"variant": "v2", "ASM": False}, False),
    ("v2-inv-noasm", {"variant": "v2", "ASM": False}, True),
    ("v2-noprefetch", {"variant": "v2", "PREFETCH": False}, False),
    ("v2-inv-noprefetch", {"variant": "v2", "PREFETCH": False}, True),
    ("v2-split1", {"variant": "v2", "SPLIT": 1}, False),
    ("v2-split2", {"variant": "v2", "SPLIT": 2}, False),
    ("v2-split8", {"variant": "v2", "SPLIT": 8}, False),
    ("v2-inv-split8", {"variant": "v2", "SPLIT": 8}, True),
    ("v2-inv-kw32", {"variant": "v2", "KW1": 32}, True),
    ("v2-inv-s4", {"variant": "v2", "S1": 4, "S2": 3}, True),
    ("v2-inv-bn64-w8", {"variant": "v2", "BN1": 64, "W1": 8}, True),
    ("v2-inv-w8", {"variant": "v2", "W1": 8, "W2": 8}, True),
    ("v2-kw32-split8", {"variant": "v2", "KW1": 32, "SPLIT": 8}, False),
    ("v2-inv-bn2-128-kw2-16", {"variant": "v2", "BN2": 128, "KW2": 16}, True),
    ("v2-inv-bn2-128-kw2-32-w8", {"variant": "v2", "BN2": 128, "KW2": 32, "W2": 8}, True),
    ("v2-inv-kw32-w8", {"variant": "v2", "KW1": 32, "W1": 8}, True),
]


def make_weights(e: int, h: int, i: int, dev: torch.device) -> ExpertWeights:
    def packed(rows: int, cols: int):
        words = torch.randint(
            -(2**31), 2**31 - 1, (e, rows, cols // 8), dtype=torch.int32, device=dev
        )
        scale = (torch.rand(e, rows, cols // 32, device=dev) + 0.5) / (4.6 * math.sqrt(cols))
        return words, scale.to(torch.bfloat16)

    w13p, s13 = packed(2 * i, h)
    w2p, s2 = packed(h, i)
    return ExpertWeights(w13_packed=w13p, w13_scale=s13, w2_packed=w2p, w2_scale=s2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check)")
    ap.add_argument("--variants", action="store_true", help="time every variant, not just default")
    ap.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--budget", type=float, default=115.0, help="seconds for the kernel sweep")
    ap.add_argument("--rep", type=int, default=40, help="do_bench milliseconds per timing")
    args = ap.parse_args()
    start = time.perf_counter()
    dev = device()
    e, h, i, k = (8, 256, 64, 2) if args.smoke else (384, 7168, 256, 8)
    torch.manual_seed(0)
    w = make_weights(e, h, i, dev)
    expert_bytes = sum(t[0].nbytes for t in (w.w13_packed, w.w13_scale, w.w2_packed, w.w2_scale))
    bw = copy_bandwidth_gbs()
    res = dict(env=environment(), copy_gbs=bw, shapes=dict(E=e, H=h, I=i, topk=k,
               w13=[e, 2 * i, h], w2=[e, h, i], expert_bytes=expert_bytes), rows=[],
               variants=[dict(name=n, config=c, invariant=v) for n, c, v in VARIANTS])  # fmt: skip
    print(f"copy bandwidth {bw:.0f} GB/s; one expert {expert_bytes / 1e6:.3f} MB")
    rows = []
    for ratio in RATIOS[2:4] if args.smoke else RATIOS:
        t = max(1, round(ratio * e / k))
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices
        tw = torch.rand(t, k, device=dev)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * expert_bytes + 2 * t * h * 2
        bm = _pick_bm(t * k, e)
        row = dict(tokens_per_expert=ratio, T=t, distinct_experts=distinct, bytes=nbytes)
        row["align_ms"] = time_ms(lambda ids=ids, bm=bm: align_by_expert(ids, e, bm), rep=args.rep)
        row["results"] = {}
        rows.append((row, x, ids, tw, moe_ref(x, ids, tw, w)))
        res["rows"].append(row)
    for name, cfg, inv in VARIANTS if args.variants else VARIANTS[1:3]:
        for row, x, ids, tw, ref in rows:
            if time.perf_counter() - start > args.budget:
                row["results"][name] = dict(skipped="time budget")
                continue
            try:
                err = rel_err(fused_moe(x, ids, tw, w, config=cfg, invariant=inv), ref)
                call = lambda x=x, ids=ids, tw=tw, c=cfg, v=inv: fused_moe(  # noqa: E731
                    x, ids, tw, w, config=c, invariant=v
                )
                ms = time_ms(call, rep=args.rep)
                gbs = row["bytes"] / ms / 1e6
                r = dict(us=ms * 1e3, gbs=gbs, frac_of_copy=gbs / bw, err=err)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                r = dict(error=repr(exc)[:300])
            row["results"][name] = r
            msg = r.get("error") or r.get("skipped") or (
                f"{r['us']:8.1f} us {r['gbs']:6.0f} GB/s ({r['frac_of_copy']:.3f} of copy) "
                f"err {r['err']:.1e}"
            )  # fmt: skip
            print(f"{name:16s} T={row['T']:4d} experts={row['distinct_experts']:3d} {msg}")
    for row, *_ in rows:
        done = {n: r for n, r in row["results"].items() if "us" in r}
        if done:
            best = min(done, key=lambda n: done[n]["us"])
            row["best"], row["best_us"] = best, done[best]["us"]
            inv_done = {n: r for n, r in done.items() if VARIANTS_BY_NAME[n]["inv"]}
            if inv_done:
                bi = min(inv_done, key=lambda n: inv_done[n]["us"])
                row["best_invariant"], row["best_invariant_us"] = bi, inv_done[bi]["us"]
    if not args.no_torch:
        for row, x, ids, tw, _ in rows[:2]:
            if time.perf_counter() - start > args.budget + 10:
                break
            row["torch_ms"] = time_ms(
                lambda x=x, ids=ids, tw=tw: moe_ref(x, ids, tw, w), graph=False, rep=args.rep
            )
            print(f"torch reference T={row['T']}: {row['torch_ms']:.2f} ms")
    from ddserve.kernels import moe_triton_v2

    res["asm_error"] = moe_triton_v2.ASM_ERROR  # None unless the asm dequant failed to compile
    res["seconds"] = time.perf_counter() - start
    write_json(args.out, res)


VARIANTS_BY_NAME = {n: dict(config=c, inv=v) for n, c, v in VARIANTS}

if __name__ == "__main__":
    main()
