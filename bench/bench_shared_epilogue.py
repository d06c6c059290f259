"""The shared expert's down projection with the MoE combine and the silu-mul folded in or not
(K2.6 rank shapes: I = 256, H = 7168, top-8), CUDA-graph replay times in us, one JSON."""

import argparse
import json

import torch
import triton

from ddserve.kernels import backend
from ddserve.kernels.config import KernelConfig
from ddserve.kernels.fused import silu_mul
from ddserve.kernels.invariant import linear
from ddserve.kernels.moe_reduce import _combine_kernel

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
args = ap.parse_args()
dev, H, I, K = "cuda", 7168, 256, 8
w = (torch.randn(H, I, device=dev) / I**0.5).bfloat16()
res = {}
with backend.kernel_mode(KernelConfig(batch_invariant=True)):
    for t in (1, 10, 170):
        gu = torch.randn(t, 2 * I, device=dev).bfloat16()
        pairs = torch.randn(t * K, H, device=dev) * 0.1

        def combine():
            out = torch.empty(t, H, dtype=torch.bfloat16, device=dev)
            _combine_kernel[(t, triton.cdiv(H, 1024))](
                pairs, out, H, pairs.stride(0), out.stride(0), TOPK=K, BC=1024, PDL=False
            )
            return out

        fns = dict(
            separate=lambda: linear(silu_mul(gu), w, combine()),
            topk_only=lambda: linear(silu_mul(gu), w, pairs, add_topk=K),
            gated_only=lambda: linear(gu, w, combine(), gated=True),
            both=lambda: linear(gu, w, pairs, add_topk=K, gated=True),
        )
        ref = fns["separate"]()
        row = {}
        for name, fn in fns.items():
            assert torch.equal(fn(), ref), name
            row[name] = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
        res[t] = row
        print(t, {k: round(v, 1) for k, v in row.items()}, flush=True)
json.dump(res, open(args.out, "w"), indent=1)
