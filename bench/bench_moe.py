"""MoE kernel time vs the weight-streaming floor, K2.6 expert shapes per rank at tp=8.

w13 [384, 512, 7168] and w2 [384, 7168, 256] INT4 (group 32, bf16 scales), top-8, hidden 7168.
T = ratio * 384 / 8 tokens per step for ratio = tokens per expert. Bytes = distinct experts touched
(measured from the routing) x one expert's packed weights and scales, + x read + output written.
Times are CUDA-graph replays (do_bench medians, L2 flushed). With --variants every kernel variant
(v3 and v2 tile configs, asm dequant on/off, split-K) is timed at every ratio in one run, most
important variants first, within --budget seconds; `moe_ref` (the plain torch path) is timed at
two sizes at the end.

    cd bench && python3 bench_moe.py --variants --out $OUT/moe.json

SiLU-and-mul in the up launch vs its own launch (v3's FUSED_SILU, the same bits either way):
    cd bench && python3 bench_moe.py --only v3-silu-fused,v3-silu-2launch --breakdown
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from _util import copy_bandwidth_gbs, device, environment, rel_err, time_ms, write_json

from ddserve.kernels import moe_triton_v2, moe_v3
from ddserve.kernels.moe_align import align_by_expert
from ddserve.kernels.moe_ref import ExpertWeights, moe_ref
from ddserve.kernels.moe_triton import fused_moe

RATIOS = [8 / 384, 0.2, 0.5, 1, 2, 4, 8, 16]  # the first is one decode token (T = 1)
# (name, config, invariant), in priority order (a run out of budget drops the last ones)
V2 = {"variant": "v2"}
V3 = {"variant": "v3"}
VARIANTS = [  # v3 default: W=4 NREP=2 SPLIT=4 DEPTH=1, BM NT UNROLL PFA "auto" (the same bits)
    ("v3", V3, True),
    ("v3-silu-fused", {**V3, "FUSED_SILU": True}, True),  # one launch fewer (same bits)
    ("v3-silu-2launch", {**V3, "FUSED_SILU": False}, True),
    ("v3-rolled", {**V3, "UNROLL": False}, True),  # the step loop never unrolled (same bits)
    ("v3-depth2", {**V3, "DEPTH": 2}, True),  # two weight steps in flight (same bits)
    ("v3-pfa0", {**V3, "PFA": 0}, True),  # no L2 asks ahead at any T (same bits)
    ("v3-pfa2", {**V3, "PFA": 2}, True),  # each up step asks L2 for step + 2's lines (same bits)
    ("v3-pfa3", {**V3, "PFA": 3}, True),
    ("v3-pfa4", {**V3, "PFA": 4}, True),
    ("v3-pfa6", {**V3, "PFA": 6}, True),
    ("v3-pairs-fp32", {**V3, "PAIRS": "fp32"}, True),  # fp32 per-pair outputs (other bits)
    ("v3-bm8", {**V3, "BM": 8}, True),
    ("v3-bm16", {**V3, "BM": 16}, True),
    ("v3-bm32", {**V3, "BM": 32}, True),
    ("v3-nt1", {**V3, "NT": 1}, True),
    ("v3-nt4", {**V3, "NT": 4}, True),
    ("v3-split8", {**V3, "SPLIT": 8}, True),  # different sums from the default
    ("v3-split2", {**V3, "SPLIT": 2}, True),
    ("v3-nrep1-bm32", {**V3, "NREP": 1, "BM": 32}, True),
    ("v2-inv", V2, True),  # v2's fixed config (dense experts, non-bf16 scales, v3's fallback)
    ("v2-inv-noasm", {**V2, "ASM": False}, True),
    ("v2-inv-bn32-w4", {**V2, "BN1": 32, "W1": 4}, True),
    ("v2-inv-split2", {**V2, "SPLIT": 2}, True),
    ("v2-inv-split8", {**V2, "SPLIT": 8}, True),
    ("v2-inv-kw32", {**V2, "KW1": 32}, True),
    ("v2-inv-bn32-kw32-w4", {**V2, "BN1": 32, "KW1": 32, "W1": 4}, True),
    ("v2-inv-bn32-kw64-w8", {**V2, "BN1": 32, "KW1": 64, "W1": 8}, True),
    ("v2-inv-bn128-w8", {**V2, "BN1": 128, "W1": 8}, True),
    ("v2-inv-s4", {**V2, "S1": 4, "S2": 3}, True),
    ("v2-inv-w2-8", {**V2, "BN2": 128, "KW2": 32, "W2": 8}, True),
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


def kernel_breakdown(call, n: int = 10) -> dict:
    """Mean microseconds per call of each CUDA kernel (torch profiler, eager calls); {} when
    the profiler cannot trace (e.g. no CUPTI)."""
    if not torch.cuda.is_available():
        return {}
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                call()
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us:
                key = ev.key if len(ev.key) < 60 else ev.key[:57] + "..."
                out[key] = out.get(key, 0.0) + us / n
        return out
    except Exception as exc:  # noqa: BLE001 - profiler unavailable in this runtime
        return {"error": repr(exc)[:200]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check)")
    ap.add_argument("--variants", action="store_true", help="time every variant, not just default")
    ap.add_argument("--only", default=None, help="comma list of variant names to time")
    ap.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--budget", type=float, default=115.0, help="seconds for the kernel sweep")
    ap.add_argument("--breakdown", action="store_true", help="kernel times of the first variant")
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
    for ratio in RATIOS[1:3] if args.smoke else RATIOS:
        t = max(1, round(ratio * e / k))
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices
        tw = torch.rand(t, k, device=dev)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * expert_bytes + 2 * t * h * 2
        bm = moe_v3.pick_bm(t * k, e)
        row = dict(
            tokens_per_expert=ratio,
            T=t,
            distinct_experts=distinct,
            bytes=nbytes,
            up_bytes=distinct * (w.w13_packed[0].nbytes + w.w13_scale[0].nbytes),
            down_bytes=distinct * (w.w2_packed[0].nbytes + w.w2_scale[0].nbytes),
        )
        row["align_ms"] = time_ms(lambda ids=ids, bm=bm: align_by_expert(ids, e, bm), rep=args.rep)
        row["results"] = {}
        rows.append((row, x, ids, tw, moe_ref(x, ids, tw, w)))
        res["rows"].append(row)
    todo = VARIANTS if args.variants else [v for v in VARIANTS if v[0] in ("v3", "v2-inv")]
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - set(VARIANTS_BY_NAME)
        if unknown:
            ap.error(f"--only: unknown variants {sorted(unknown)}")
        todo = [v for v in VARIANTS if v[0] in names]
    for name, cfg, inv in todo:
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
                v3 = cfg.get("variant") == "v3"
                launches = moe_v3.LAST_LAUNCH if v3 else moe_triton_v2.LAST_LAUNCH
                r["launch"] = {n: dict(v) for n, v in launches.items()}
                if args.breakdown and name == todo[0][0]:
                    r["kernels_us"] = kernel_breakdown(call)
                    print(f"  kernels (us): {r['kernels_us']}")
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                r = dict(error=repr(exc)[:300])
            row["results"][name] = r
            msg = r.get("error") or r.get("skipped") or (
                f"{r['us']:8.1f} us {r['gbs']:6.0f} GB/s ({r['frac_of_copy']:.3f} of copy) "
                f"err {r['err']:.1e}"
            )  # fmt: skip
            print(f"{name:16s} T={row['T']:4d} experts={row['distinct_experts']:3d} {msg}")
            if "launch" in r:
                print(f"  launch: {r['launch']}")
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
    res["asm_error"] = moe_triton_v2.ASM_ERROR  # None unless the asm dequant failed to compile
    res["seconds"] = time.perf_counter() - start
    write_json(args.out, res)


VARIANTS_BY_NAME = {n: dict(config=c, inv=v) for n, c, v in VARIANTS}

if __name__ == "__main__":
    main()
