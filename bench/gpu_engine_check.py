"""DDTree vs autoregressive greedy on a GPU, through the whole engine (Triton kernels included).

On the embedded tiny model (INT4 experts) with its random DFlash drafter and with a corrupted
oracle drafter (deep trees), for float32 and bfloat16 compute and several budgets, this records how
many of the streams' greedy outputs are token-for-token identical to plain AR decoding, and where
the first difference is when one is not. bf16 matmuls are not batch-invariant, so a near-tie can
flip a token; float32 should match everywhere. With --batch-invariant every decode/verify kernel
computes a row the same way whatever the batch, so bf16 should match everywhere too; that is the
engine's default and this script's (--no-batch-invariant runs the plain kernels). Writes one
JSON (a row per config: identical streams, first differing token of the others).

    python bench/gpu_engine_check.py --dtypes bfloat16 --out $OUT/x.json
    python bench/gpu_engine_check.py --no-batch-invariant --out results/plain_kernels.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ddserve.drafter.testing import OracleDrafter
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.model.tiny import make_tiny
from ddserve.sampling import SamplingParams

PROMPTS = [list(range(5 + 7 * i, 5 + 7 * i + 3 + 5 * i)) for i in range(8)]


def decode_all(runner: ModelRunner, max_tokens: int, speculative: bool, budget: int | None):
    params = SamplingParams(max_tokens=max_tokens)
    out: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        runner.add_stream(i, p, params)
    for sid, so in runner.prefill().items():
        out[sid] += so.tokens
    steps = stream_steps = 0
    while runner.streams:
        sids = list(runner.streams)
        res = runner.ddtree_step(sids, budget) if speculative else runner.ar_step(sids)
        steps, stream_steps = steps + 1, stream_steps + len(sids)
        for sid, so in res.items():
            out[sid] += so.tokens
    return [out[i] for i in range(len(PROMPTS))], steps, stream_steps


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--budgets", default="4,16,64")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--drafters", default="dflash,oracle-corrupt-0.3")
    ap.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.batch_invariant,
        help="EngineConfig.batch_invariant (default: the engine's default, on)",
    )
    ap.add_argument(
        "--ref",
        default="",
        help="comma list of kernels to force to the torch "
        "reference: attn, moe (to tell a kernel's effect from the engine's)",
    )
    args = ap.parse_args()
    from ddserve.kernels import backend
    from ddserve.kernels.moe_ref import moe_ref
    from ddserve.kernels.tree_attn import tree_mla_attention_ref

    if "attn" in args.ref:
        backend.tree_attention = lambda device_type: tree_mla_attention_ref
    if "moe" in args.ref:
        backend.moe = lambda device_type: moe_ref
    model = make_tiny(Path(tempfile.mkdtemp()) / "tiny", int4=True, seed=0)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for dtype in args.dtypes.split(","):
        cfg = EngineConfig(
            num_slots=8192, budget=max(budgets), dtype=dtype, batch_invariant=args.batch_invariant
        )
        ref, ar_steps, _ = decode_all(ModelRunner(model, engine_cfg=cfg, device=args.device),
                                   args.max_tokens, False, None)  # fmt: skip
        oracle = {tuple(p): r for p, r in zip(PROMPTS, ref, strict=True)}
        for kind in args.drafters.split(","):
            for budget in budgets:
                if kind == "dflash":
                    drafter = model / "drafter"
                else:
                    drafter = OracleDrafter(oracle, 264, depth=7, corrupt=0.3, seed=1)
                runner = ModelRunner(model, engine_cfg=cfg, drafter=drafter, device=args.device)
                t0 = time.perf_counter()
                got, steps, stream_steps = decode_all(runner, args.max_tokens, True, budget)
                diffs = [first_diff(g, r) for g, r in zip(got, ref, strict=True)]
                rows.append(dict(
                    ref_kernels=args.ref, batch_invariant=args.batch_invariant,
                    dtype=dtype, drafter=kind, budget=budget,
                    streams=len(PROMPTS),
                    identical=sum(d is None and len(g) == len(r)
                                  for d, g, r in zip(diffs, got, ref, strict=True)),
                    first_diff_positions=[d for d in diffs if d is not None],
                    ddtree_steps=steps, ar_steps=ar_steps,
                    # tokens a stream commits per DDTree step (its prefill token excluded)
                    tokens_per_stream_step=(sum(map(len, got)) - len(got)) / max(stream_steps, 1),
                    seconds=time.perf_counter() - t0,
                ))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    info = dict(device=name, torch=torch.__version__,
                max_tokens=args.max_tokens, rows=rows)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
