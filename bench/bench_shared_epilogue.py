"""The shared expert's down matmul with the MoE's top-k combine in its own launch or in the
matmul's epilogue (`invariant.linear(..., add_topk=k)`), K2.6 rank shapes (intermediate 256,
hidden 7168, top-8), at several token counts and for bf16 and fp32 pair outputs (`moe_v3`
PAIRS): CUDA-graph replay times in us, one JSON. The two give the same bits (asserted);
`moe_triton.PAIRS_MAX_TOKENS` is chosen from these times.

    python3 bench/bench_shared_epilogue.py --out shared_epilogue.json
    python3 bench/bench_shared_epilogue.py --prefill --tokens 17,128,512 --out prefill.json
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import triton

from ddserve.kernels import backend
from ddserve.kernels.config import KernelConfig
from ddserve.kernels.fused import silu_mul
from ddserve.kernels.invariant import linear
from ddserve.kernels.moe_reduce import _combine_kernel

HIDDEN, INTER, TOPK = 7168, 256, 8


def time_tokens(t: int, w: torch.Tensor, pair_dtype: torch.dtype) -> dict[str, float]:
    dev = w.device
    gu = torch.randn(t, 2 * INTER, device=dev).bfloat16()  # the gate/up matmul's output
    pairs = (torch.randn(t * TOPK, HIDDEN, device=dev) * 0.1).to(pair_dtype)  # weighted outputs

    def combine() -> torch.Tensor:
        out = torch.empty(t, HIDDEN, dtype=torch.bfloat16, device=dev)
        _combine_kernel[(t, triton.cdiv(HIDDEN, 1024))](
            pairs, out, HIDDEN, pairs.stride(0), out.stride(0), TOPK=TOPK, BC=1024, PDL=False
        )
        return out

    fns = {
        "separate": lambda: linear(silu_mul(gu), w, combine()),
        "topk_epilogue": lambda: linear(silu_mul(gu), w, pairs, add_topk=TOPK),
    }
    ref = fns["separate"]()
    row = {}
    for name, fn in fns.items():
        assert torch.equal(fn(), ref), name
        row[name] = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,10,16,17,32,64,170", help="comma-separated T")
    ap.add_argument("--pairs", default="bf16,fp32", help="comma-separated pair dtypes")
    ap.add_argument(
        "--prefill", action="store_true", help="the prompt chunks' matmul configuration"
    )
    ap.add_argument("--out", required=True, help="JSON output path")
    args = ap.parse_args()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    pair_dtypes = args.pairs.split(",")
    if set(pair_dtypes) - set(dtypes):
        ap.error(f"--pairs: choose from {sorted(dtypes)}")
    w = (torch.randn(HIDDEN, INTER, device="cuda") / INTER**0.5).bfloat16()
    res = {}
    phase = backend.prefill_phase() if args.prefill else contextlib.nullcontext()
    with backend.kernel_mode(KernelConfig(batch_invariant=True)), phase:
        for t in (int(x) for x in args.tokens.split(",")):
            for name in pair_dtypes:
                row = time_tokens(t, w, dtypes[name])
                res.setdefault(t, {}).update({f"{k}[{name}]": v for k, v in row.items()})
            print(t, {k: round(v, 1) for k, v in res[t].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
