"""DDTree builder (the torch ops in ddserve/ddtree/tree.py) on the device: time per step.

16 streams x budget 64 (and 16, 32), 15 draft depths, K2.6's vocabulary (163840). Reported as a
share of one verify step's floor: at 16 x 65 tokens a step touches essentially every routed expert,
so per rank at tp=8 it streams >= 60 MoE layers x 384 experts x one expert's INT4 bytes.
"""

from __future__ import annotations

import argparse

import torch
from _util import copy_bandwidth_gbs, device, environment, time_ms, write_json

from ddserve.ddtree.tree import build_tree

# One K2.6 expert per rank at tp=8: w13 [512, 7168] + w2 [7168, 256] INT4 with bf16 group-32 scales.
EXPERT_BYTES = 512 * 7168 // 2 + 512 * 224 * 2 + 7168 * 256 // 2 + 7168 * 8 * 2
MOE_LAYERS, EXPERTS = 60, 384


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = device()
    b, d, v = (4, 15, 512) if args.smoke else (16, 15, 163840)
    bw = copy_bandwidth_gbs()
    step_floor_ms = MOE_LAYERS * EXPERTS * EXPERT_BYTES / bw / 1e6
    res = dict(env=environment(), copy_gbs=bw, streams=b, depth=d, vocab=v,
               step_floor_ms=step_floor_ms, rows=[])  # fmt: skip
    for budget in (16, 32, 64):
        logits = (torch.randn(b, d, v, device=dev) * 3).to(torch.bfloat16)
        row = dict(budget=budget)
        row["ms"] = time_ms(lambda logits=logits, budget=budget: build_tree(logits, budget))
        row["eager_ms"] = time_ms(
            lambda logits=logits, budget=budget: build_tree(logits, budget), graph=False
        )
        row["share_of_step_floor"] = row["ms"] / step_floor_ms
        k = min(budget, v)  # the builder's first stage, as written and with top-k taken first
        row["logsoftmax_topk_ms"] = time_ms(
            lambda logits=logits, k=k: logits.float().log_softmax(-1).topk(k, dim=-1)
        )
        row["topk_then_lse_ms"] = time_ms(
            lambda logits=logits, k=k: (
                logits.topk(k, dim=-1)[0].float() - logits.float().logsumexp(-1, keepdim=True)
            )
        )
        res["rows"].append(row)
        print(f"B={b} budget={budget}: {row['ms'] * 1e3:.1f} us in a graph, "
              f"{row['eager_ms'] * 1e3:.1f} us eager, {row['share_of_step_floor']:.2%} of a "
              f"{step_floor_ms:.2f} ms step floor")  # fmt: skip
    write_json(args.out, res)


if __name__ == "__main__":
    main()
