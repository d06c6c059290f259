"""GPU time of the fused decoder-layer elementwise ops vs the unfused sequences they replace.

Both sides are timed by CUDA-graph replay (`_util.time_ms`: captured once, median of do_bench with
L2 flushed), so the difference is kernel time plus the per-node gaps a captured step still pays.
Shapes are one rank of Kimi K2.6 at tp = 8: hidden 7168, q_lora 1536, kv_lora 512, rope 64,
8 heads of qk_nope 128; T in 1, 10, 170 tokens. Ops (unfused = what the model runs without
`fused.py`, batch-invariant mode, bf16; fp16 in the CPU smoke run):

- add_rms_norm 7168 / 1536: torch add + `invariant.rms_norm`
- mla_rope_cache: RoPE of q_pe and k_pe (torch elementwise ops, interleaved as K2.6), cat,
  kv_a_layernorm (`invariant.rms_norm`), cast, index_put into a 4096-slot latent pool
- silu_mul: F.silu(gate) * up for the shared expert (I 256), the dense MLP (I 2304) and the routed
  experts (I 2048, T * 8 rows)

Per (op, T): microseconds unfused / fused, the kernel launches of each (torch profiler, one eager
call) and whether the fused output equals the unfused one bit for bit (in the CPU smoke run
silu_mul's exp is numpy's, so a few of its elements may differ there by one ulp).

    python3 bench/bench_fused.py --out $OUT/fused.json      # GPU, < 60 s
    python3 bench/bench_fused.py --smoke                    # CPU, Triton interpreter, tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T_LIST = [1, 10, 170]
HIDDEN, Q_LORA, KV_LORA, ROPE, HEADS, NOPE, SLOTS = 7168, 1536, 512, 64, 8, 128, 4096
SMOKE = dict(hidden=96, q_lora=48, kv_lora=32, rope=16, heads=3, nope=8, slots=256)


def _launches(fn) -> int | None:
    """CUDA kernels one eager call of fn launches (None off CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def _cases(t: int, shape: dict, dev: str):
    """(name, unfused fn, fused fn) at T = t; each fn returns the tensors to compare."""
    import torch
    import torch.nn.functional as F

    from ddserve.kernels import fused, invariant
    from ddserve.kernels.fused_ref import mla_rope_cache_ref

    g = torch.Generator(device=dev).manual_seed(t)
    # fp16 on the CPU: the interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)

    cases = []
    for d in (shape["hidden"], shape["q_lora"]):
        x, r, w = rand(t, d), rand(t, d, scale=4.0), rand(d)
        cases.append((
            f"add_rms_norm {d}",
            lambda x=x, r=r, w=w: (x + r, invariant.rms_norm(x + r, w, 1e-6)),
            lambda x=x, r=r, w=w: fused.add_rms_norm(x, r, w, 1e-6),
        ))  # fmt: skip
    rank, p, h, nope = shape["kv_lora"], shape["rope"], shape["heads"], shape["nope"]
    q = rand(t, h * (nope + p)).view(t, h, nope + p)
    kv, nw = rand(t, rank + p), rand(rank)
    ang = torch.rand(t, p, generator=g, device=dev) * 100.0
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slots = torch.randperm(shape["slots"], generator=g, device=dev)[:t]
    pools = [torch.zeros(shape["slots"], rank + p, dtype=dtype, device=dev) for _ in "uf"]
    args = (q, kv, nw, 1e-6, cos, sin)
    cases.append((
        "mla_rope_cache",
        lambda: (mla_rope_cache_ref(*args, pools[0], slots, True, rms_norm=invariant.rms_norm),
                 pools[0]),
        lambda: (fused.mla_rope_cache(*args, pools[1], slots, True), pools[1]),
    ))  # fmt: skip
    for name, inner, rows in (("shared", 256, t), ("dense", 2304, t), ("routed", 2048, 8 * t)):
        inner = max(inner * shape["hidden"] // HIDDEN, 8)
        gu = rand(rows, 2 * inner, scale=3.0)
        cases.append((
            f"silu_mul {name} I={inner} rows={rows}",
            lambda gu=gu, i=inner: (F.silu(gu[:, :i]) * gu[:, i:],),
            lambda gu=gu: (fused.silu_mul(gu),),
        ))  # fmt: skip
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before ddserve's kernels are imported
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from _util import environment, time_ms, write_json

    from ddserve.kernels import backend

    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = SMOKE if args.smoke else dict(
        hidden=HIDDEN, q_lora=Q_LORA, kv_lora=KV_LORA, rope=ROPE, heads=HEADS, nope=NOPE,
        slots=SLOTS,
    )  # fmt: skip
    t0, results = time.time(), []
    with backend.invariant_mode(True), torch.no_grad():
        for t in T_LIST:
            for name, unfused, fused_fn in _cases(t, shape, dev):
                want, got = unfused(), fused_fn()
                equal = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
                rec = dict(
                    op=name, t=t, equal=equal,
                    unfused_us=time_ms(unfused) * 1e3, fused_us=time_ms(fused_fn) * 1e3,
                    unfused_launches=_launches(unfused), fused_launches=_launches(fused_fn),
                )  # fmt: skip
                results.append(rec)
                print(
                    f"{name:36s} T={t:4d}  unfused {rec['unfused_us']:8.1f} us"
                    f" ({rec['unfused_launches']} launches)  fused {rec['fused_us']:8.1f} us"
                    f" ({rec['fused_launches']})  equal={equal}",
                    flush=True,
                )
    out = dict(env=environment(), bench="fused", smoke=args.smoke, shape=shape, results=results)
    out["all_equal"] = all(r["equal"] for r in results)
    print(f"all equal: {out['all_equal']}  ({time.time() - t0:.0f} s)")
    write_json(args.out, out)


if __name__ == "__main__":
    main()
