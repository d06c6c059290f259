"""MoE kernel time vs the weight-streaming floor, K2.6 expert shapes per rank at tp=8.

w13 [384, 512, 7168] and w2 [384, 7168, 256] INT4 (group 32, bf16 scales), top-8, hidden 7168.
T = ratio * 384 / 8 tokens per step for ratio = tokens per expert. Bytes = distinct experts touched
(measured from the routing) x one expert's packed weights and scales, + x read + output written.
Compared in the same run with `moe_ref` (the plain torch path: dequantize, then matmul).
"""

from __future__ import annotations

import argparse
import math

import torch
from _util import copy_bandwidth_gbs, device, environment, rel_err, time_ms, write_json

from ddserve.kernels.moe_ref import ExpertWeights, moe_ref
from ddserve.kernels.moe_triton import _pick_bm, align_by_expert, fused_moe

RATIOS = [8 / 384, 0.2, 0.5, 1, 2, 4, 8, 16]  # the first is one decode token (T = 1)
VARIANTS = [  # SWAP=False at BM=64 crashes Triton 3.6's TritonGPUOptimizeDotOperands pass
    {},
    {"BN1": 32},
    {"KW1": 16, "KW2": 16},
    {"BN1": 32, "KW1": 16, "KW2": 16},
    {"S1": 3, "S2": 3},
    {"BN2": 64, "BN1": 32},
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
    ap.add_argument("--sweep", action="store_true", help="also time the tile-config variants")
    ap.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    args = ap.parse_args()
    dev = device()
    e, h, i, k = (8, 256, 64, 2) if args.smoke else (384, 7168, 256, 8)
    torch.manual_seed(0)
    w = make_weights(e, h, i, dev)
    expert_bytes = sum(t[0].nbytes for t in (w.w13_packed, w.w13_scale, w.w2_packed, w.w2_scale))
    bw = copy_bandwidth_gbs()
    res = dict(env=environment(), copy_gbs=bw, shapes=dict(E=e, H=h, I=i, topk=k,
               w13=[e, 2 * i, h], w2=[e, h, i], expert_bytes=expert_bytes), rows=[])  # fmt: skip
    print(f"copy bandwidth {bw:.0f} GB/s; one expert {expert_bytes / 1e6:.3f} MB")
    for ratio in RATIOS[2:4] if args.smoke else RATIOS:
        t = max(1, round(ratio * e / k))
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices
        tw = torch.rand(t, k, device=dev)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * expert_bytes + 2 * t * h * 2
        ref = moe_ref(x, ids, tw, w)
        row = dict(tokens_per_expert=ratio, T=t, distinct_experts=distinct, bytes=nbytes)
        row["err"] = rel_err(fused_moe(x, ids, tw, w), ref)
        row["ms"] = time_ms(lambda x=x, ids=ids, tw=tw: fused_moe(x, ids, tw, w))
        bm = _pick_bm(t * k, e)
        row["align_ms"] = time_ms(lambda ids=ids, bm=bm: align_by_expert(ids, e, bm))
        if not args.no_torch:
            row["torch_ms"] = time_ms(
                lambda x=x, ids=ids, tw=tw: moe_ref(x, ids, tw, w), graph=False
            )
            row["speedup_vs_torch"] = row["torch_ms"] / row["ms"]
        if args.sweep:
            row["variants"] = []
            for cfg in VARIANTS:
                try:
                    err = rel_err(fused_moe(x, ids, tw, w, config=cfg), ref)
                    ms = time_ms(
                        lambda x=x, ids=ids, tw=tw, c=cfg: fused_moe(x, ids, tw, w, config=c)
                    )
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                    err, ms = repr(exc)[:160], float("inf")
                row["variants"].append(dict(config=cfg, ms=ms, err=err))
            best = min(row["variants"], key=lambda v: v["ms"])
            row["best_config"], row["best_ms"] = best["config"], best["ms"]
        row["gbs"] = nbytes / row["ms"] / 1e6
        row["frac_of_copy"] = row["gbs"] / bw
        res["rows"].append(row)
        print(f"T={t:5d} experts={distinct:3d} {row['ms'] * 1e3:8.1f} us {row['gbs']:7.0f} GB/s "
              f"({row['frac_of_copy']:.2f} of copy) best={row.get('best_ms', 0) * 1e3:7.1f} us "
              f"torch={row.get('torch_ms', 0):.2f} ms err={row['err']:.1e}")  # fmt: skip
    write_json(args.out, res)


if __name__ == "__main__":
    main()
