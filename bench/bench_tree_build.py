"""DDTree builder (ddserve/ddtree/tree.py) on the device: time per step.

16 streams x budget 64 (and 16, 32), 15 draft depths, K2.6's vocabulary (163840). Reported as a
share of one verify step's floor: at 16 x 65 tokens a step touches essentially every routed expert,
so per rank at tp=8 it streams >= 60 MoE layers x 384 experts x one expert's INT4 bytes.

On CUDA `build_tree` takes the fused first stage (ddserve/kernels/draft_topk.py) and the fused
second stage (the tree from the top-k, ddserve/kernels/tree_beam.py; `fused_beam` in a row says
whether it ran); each row also times the builder on the torch first stage (`torch_stage_ms`: the
second stage as `tree_from_topk` chooses it) and the two first stages alone (graph replay), with
a check of the fused result against `draft_topk_ref`. `first_stage` repeats the first-stage
timings at 1 / 10 / 16 streams and k 16 / 64; `beam` times the second stage alone, the fused
kernel against the torch beam (`tree_from_topk_torch`) at 1 / 10 / 16 streams and budgets 16 /
32 / 64 (K = budget), with a bitwise check of the fused tree against the torch one. --sweep
times the fused first stage over launch shapes and the fused beam over warps.
"""

from __future__ import annotations

import argparse

import torch
from _util import copy_bandwidth_gbs, device, environment, time_ms, write_json

from ddserve.ddtree.tree import (
    MIN_LOGPROB,
    build_tree,
    log_softmax_topk,
    top_draft_tokens,
    tree_from_topk,
    tree_from_topk_torch,
)

# One K2.6 expert per rank at tp=8: w13 [512, 7168] + w2 [7168, 256] INT4 with bf16 group-32 scales.
EXPERT_BYTES = 512 * 7168 // 2 + 512 * 224 * 2 + 7168 * 256 // 2 + 7168 * 8 * 2
MOE_LAYERS, EXPERTS = 60, 384
SWEEP = [(seg, w, sw) for seg in (2048, 4096, 8192) for w in (2, 4) for sw in (4, 8, 16)]
BEAM_WARPS = (1, 2, 4, 8)
TREE_FIELDS = ("tokens", "parents", "depths", "visible", "scores")


def fused_module(logits: torch.Tensor, k: int):
    """ddserve.kernels.draft_topk where it serves these logits (what `build_tree` takes), else
    None."""
    if logits.device.type != "cuda":
        return None
    from ddserve.kernels import draft_topk

    return draft_topk if draft_topk.supports(logits, k) else None


def first_stage(logits: torch.Tensor, k: int) -> dict:
    """Torch and fused first stage (graph replay, ms) on `logits`, and whether the fused tokens
    are the reference's and its log-probs within 1e-5 of it (None where it does not run)."""
    rec = dict(torch_ms=time_ms(lambda: log_softmax_topk(logits, k)), fused_ms=None)
    kernels = fused_module(logits, k)
    if kernels is not None:
        rec["fused_ms"] = time_ms(lambda: kernels.draft_topk(logits, k, MIN_LOGPROB))
        lp, tok = kernels.draft_topk(logits, k, MIN_LOGPROB)
        ref_lp, ref_tok = kernels.draft_topk_ref(logits, k, MIN_LOGPROB)
        rec["tokens_equal_ref"] = bool(torch.equal(tok, ref_tok))
        rec["max_abs_lp_err"] = float((lp - ref_lp).abs().max())
    return rec


def beam_module(lp: torch.Tensor, tok: torch.Tensor, budget: int):
    """ddserve.kernels.tree_beam where it serves this top-k (what `tree_from_topk` takes), else
    None."""
    if lp.device.type != "cuda":
        return None
    from ddserve.kernels import tree_beam

    return tree_beam if tree_beam.supports(lp, tok, budget) else None


def beam_stage(lp: torch.Tensor, tok: torch.Tensor, budget: int) -> dict:
    """Torch and fused second stage (graph replay, ms) on one top-k, and whether the fused tree
    is the torch one bit for bit (None where the kernel does not run)."""
    rec = dict(torch_ms=time_ms(lambda: tree_from_topk_torch(lp, tok, budget)), fused_ms=None)
    kernels = beam_module(lp, tok, budget)
    if kernels is not None:
        rec["fused_ms"] = time_ms(lambda: kernels.tree_beam(lp, tok, budget))
        got, want = kernels.tree_beam(lp, tok, budget), tree_from_topk_torch(lp, tok, budget)
        rec["bitwise_equal"] = all(
            torch.equal(a.view(torch.uint8), getattr(want, n).view(torch.uint8))
            for a, n in zip(got, TREE_FIELDS, strict=True)
        )
    return rec


def beam_sweep(dev: torch.device, d: int, v: int) -> list[dict]:
    """The fused second stage at 16 streams and budget 64 over its warps."""
    from ddserve.kernels import tree_beam

    lp, tok = top_draft_tokens((torch.randn(16, d, v, device=dev) * 3).to(torch.bfloat16), 64)
    out = []
    for warps in BEAM_WARPS:
        ms = time_ms(lambda w=warps: tree_beam.tree_beam(lp, tok, 64, warps=w))
        out.append(dict(streams=16, budget=64, warps=warps, ms=ms))
        print(f"  beam sweep B=16 budget=64 warps={warps}: {ms * 1e3:.1f} us")
    return out


def sweep(dev: torch.device, d: int, v: int) -> list[dict]:
    """The fused stage at k 64 over (segment, warps, select warps), at 1 and 16 streams."""
    from ddserve.kernels import draft_topk

    out = []
    for b in (1, 16):
        logits = (torch.randn(b, d, v, device=dev) * 3).to(torch.bfloat16)
        for seg, w, sw in SWEEP:
            cfg = draft_topk.topk_config(v, 64, segment=seg, warps=w, select_warps=sw)
            ms = time_ms(lambda x=logits, c=cfg: draft_topk.draft_topk(x, 64, MIN_LOGPROB, c))
            out.append(dict(streams=b, config=cfg._asdict(), ms=ms))
            print(f"  sweep B={b} {cfg}: {ms * 1e3:.1f} us")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time the fused stage's launch shapes")
    args = ap.parse_args()
    dev = device()
    b, d, v = (4, 15, 512) if args.smoke else (16, 15, 163840)
    bw = copy_bandwidth_gbs()
    step_floor_ms = MOE_LAYERS * EXPERTS * EXPERT_BYTES / bw / 1e6
    res = dict(env=environment(), copy_gbs=bw, streams=b, depth=d, vocab=v,
               step_floor_ms=step_floor_ms, rows=[])  # fmt: skip
    for budget in (16, 32, 64):
        logits = (torch.randn(b, d, v, device=dev) * 3).to(torch.bfloat16)
        k = min(budget, v)  # the builder's first stage, as written and with top-k taken first
        row = dict(budget=budget, fused_first_stage=fused_module(logits, k) is not None)
        row["fused_beam"] = beam_module(*top_draft_tokens(logits, k), budget) is not None
        row["ms"] = time_ms(lambda logits=logits, budget=budget: build_tree(logits, budget))
        row["eager_ms"] = time_ms(
            lambda logits=logits, budget=budget: build_tree(logits, budget), graph=False
        )
        row["torch_stage_ms"] = time_ms(
            lambda logits=logits, k=k, budget=budget: tree_from_topk(
                *log_softmax_topk(logits, k), budget)
        )  # fmt: skip
        row["share_of_step_floor"] = row["ms"] / step_floor_ms
        row["logsoftmax_topk_ms"] = time_ms(
            lambda logits=logits, k=k: logits.float().log_softmax(-1).topk(k, dim=-1)
        )
        row["topk_then_lse_ms"] = time_ms(
            lambda logits=logits, k=k: (
                logits.topk(k, dim=-1)[0].float() - logits.float().logsumexp(-1, keepdim=True)
            )
        )
        row["first_stage_ms"] = time_ms(lambda logits=logits, k=k: top_draft_tokens(logits, k))
        res["rows"].append(row)
        print(f"B={b} budget={budget}: {row['ms'] * 1e3:.1f} us in a graph "
              f"({row['torch_stage_ms'] * 1e3:.1f} on the torch first stage), "
              f"{row['eager_ms'] * 1e3:.1f} us eager, {row['share_of_step_floor']:.2%} of a "
              f"{step_floor_ms:.2f} ms step floor")  # fmt: skip
    res["first_stage"] = []
    for streams in (1, 10) if args.smoke else (1, 10, 16):
        logits = (torch.randn(streams, d, v, device=dev) * 3).to(torch.bfloat16)
        for k in (16, 64):
            rec = dict(streams=streams, k=k, **first_stage(logits, k))
            res["first_stage"].append(rec)
            fused = "-" if rec["fused_ms"] is None else f"{rec['fused_ms'] * 1e3:.1f}"
            print(f"first stage B={streams} k={k}: torch {rec['torch_ms'] * 1e3:.1f} us, "
                  f"fused {fused} us")  # fmt: skip
    res["beam"] = []
    for streams in (1, 4) if args.smoke else (1, 10, 16):
        logits = (torch.randn(streams, d, v, device=dev) * 3).to(torch.bfloat16)
        for budget in (16, 32, 64):
            lp, tok = top_draft_tokens(logits, min(budget, v))
            rec = dict(streams=streams, budget=budget, **beam_stage(lp, tok, budget))
            res["beam"].append(rec)
            fused = "-" if rec["fused_ms"] is None else f"{rec['fused_ms'] * 1e3:.1f}"
            print(f"beam B={streams} budget={budget}: torch {rec['torch_ms'] * 1e3:.1f} us, "
                  f"fused {fused} us, bitwise equal {rec.get('bitwise_equal', '-')}")  # fmt: skip
    if args.sweep and dev.type == "cuda":
        res["fused_sweep"] = sweep(dev, d, v)
        res["beam_sweep"] = beam_sweep(dev, d, v)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
