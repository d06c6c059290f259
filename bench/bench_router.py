"""GPU time of the MoE router per layer: the fused Triton router vs the torch path it replaces.

Variants (each captured in a CUDA graph per (shape, T) and its replay timed with triton's do_bench:
median, L2 flushed between calls, so the fp32 gate streams from HBM as in a real forward):
- "fused": `router.route` (two launches: the gate GEMV partials, then per-token selection) with
  `router_config(E, D)`. With --sweep also "fused:BTxBExBKxU/S/W[:mma]": other tiles, splits,
  warps, and the tensor-core (tf32x3) form of the gate GEMV.
- "...:bf16": the same kernel reading the gate as bf16 (bf16 tensor-core products; what the
  model's Router passes when its gate holds bf16 values, as checkpoints store it). The gate's
  values are bf16 in every variant, so all of them route the same inputs.
- "torch_invariant": `route_ref` with `backend`'s linear / row_sum in batch-invariant mode (the
  tf32x3 gate matmul + split-K sum + torch's sigmoid, top-k, gather, normalise: what the
  engine's Router ran before the fused kernel).
- "torch": `route_ref` with cuBLAS fp32 (batch-invariant mode off).
Shapes: Kimi K2.6 (D 7168, E 384, top-8, one group, scale 2.827) and DeepSeek-V3's grouped
routing (E 256, 8 groups, best 4). T in 1, 5, 10, 17, 85, 170. Per (shape, variant, T):
microseconds, gate GB/s (4 E D bytes, 2 E D for bf16, / time), kernels per call
(torch profiler); per fused variant the T whose rows differ from the same rows at T = 170 (row
invariance: must be []); for torch_invariant how many of 170 tokens' ids differ from "fused".

    python3 bench/bench_router.py --out $OUT/router.json          # < 60 s on an H200
    python3 bench/bench_router.py --sweep --out $OUT/router.json  # + configuration sweep
    python3 bench/bench_router.py --smoke --out /tmp/router.json  # CPU, interpreter, tiny shapes
    python3 bench/bench_router.py --aot    # offline sm_90a compile: registers, spills (no GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SHAPES = {  # name -> (E, D, top_k, n_group, topk_group, norm, scaling)
    "k26 E384 top8": (384, 7168, 8, 1, 1, True, 2.827),
    "v3 E256 grouped 8/4": (256, 7168, 8, 8, 4, True, 2.5),
}
SMOKE_SHAPES = {
    "smoke E45": (45, 300, 6, 1, 1, True, 2.5),
    "smoke grouped": (42, 100, 5, 6, 3, True, 1.5),
}
T_LIST = [1, 5, 10, 17, 85, 170]
SWEEP = [  # (block_t, block_e, block_k, unroll, split or 0 for router_config's, warps, mma)
    (16, 8, 64, 4, 14, 4, False),
    (16, 8, 64, 2, 0, 4, False),
    (8, 8, 64, 4, 0, 4, False),
    (16, 16, 32, 4, 0, 4, False),
    (16, 8, 64, 4, 0, 8, False),
    (32, 8, 32, 4, 0, 8, False),
    (16, 16, 64, 2, 0, 4, True),
    (32, 16, 64, 2, 14, 4, True),
    (64, 32, 32, 4, 0, 4, True),
    (64, 32, 32, 4, 14, 4, True),
    (64, 32, 32, 4, 28, 4, True),
    (32, 32, 64, 4, 28, 4, True),
    (16, 32, 64, 4, 28, 4, True),
    (16, 16, 64, 4, 28, 4, True),
    (32, 32, 64, 2, 28, 8, True),
]
SWEEP_BF16 = [  # the mma configurations timed with the bf16 gate as well
    (64, 32, 32, 4, 0, 4, True),
    (64, 32, 64, 4, 0, 4, True),
    (64, 32, 32, 4, 14, 4, True),
    (64, 32, 64, 2, 28, 4, True),
    (32, 32, 64, 4, 28, 4, True),
    (16, 32, 64, 4, 28, 4, True),
    (16, 32, 64, 2, 56, 4, True),
    (16, 64, 64, 4, 28, 4, True),
]


def kernels_per_call(fn) -> int | None:
    """CUDA kernels one eager call launches (torch profiler), None when it cannot tell."""
    import torch

    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for ev in prof.events() if ev.device_type.name == "CUDA")
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def variants(args, e: int, d: int) -> dict:
    """name -> fn(x, w, b, p) -> (ids, weights)."""
    import torch.nn.functional as F

    from ddserve.kernels import backend, router
    from ddserve.kernels.router_ref import route_ref

    def invariant_ref(x, w, b, p):
        with backend.invariant_mode(True):
            return route_ref(x, w, b, p, linear=backend.linear, row_sum=backend.row_sum)

    out = {
        "fused": lambda x, w, b, p: router.route(x, w, b, p),
        "torch_invariant": invariant_ref,
        "torch": lambda x, w, b, p: route_ref(
            x, w, b, p, linear=F.linear, row_sum=lambda v: v.sum(-1, keepdim=True)
        ),
    }
    if not args.smoke:  # the interpreter's dot mis-reads bf16 operands (the tests patch it)
        out["fused:bf16"] = lambda x, w, b, p: router.route(x, w, b, p)
    sweep = [(c, "") for c in SWEEP] + [(c, ":bf16") for c in SWEEP_BF16]
    for (bt, be, bk, u, s, wp, mma), gate in sweep if args.sweep else []:
        split = s or router.router_config(e, d).split
        cfg = router.RouterConfig(bt, be, bk, u, split, wp, mma)
        name = f"fused:{bt}x{be}x{bk}x{u}/{split}/{wp}" + ":mma" * mma + gate
        out[name] = lambda x, w, b, p, cfg=cfg: router.route(x, w, b, p, cfg)
    return out


def run_shape(args, spec, dev: str) -> dict:
    import torch
    from _util import time_ms

    from ddserve.kernels import router
    from ddserve.kernels.router_ref import RoutingParams

    e, d, k, groups, topk_groups, norm, scaling = spec
    p = RoutingParams(k, groups, topk_groups, norm, scaling)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(max(T_LIST), d, generator=g, device=dev).bfloat16()
    w16 = (torch.randn(e, d, generator=g, device=dev) * (2.0 / d**0.5)).bfloat16()
    w32 = w16.float()  # bf16 values, as a checkpoint's gate
    b = torch.randn(e, generator=g, device=dev) * 0.05
    rec: dict = {"config": router.router_config(e, d)._asdict(), "variants": {}}
    fused_full = router.route(x, w32, b, p)
    for name, fn in variants(args, e, d).items():
        w = w16 if name.endswith(":bf16") else w32
        nbytes = w.numel() * w.element_size()
        res: dict = {"us": {}, "GBps": {}}
        try:
            if name.startswith("fused"):  # row invariance: each T's rows vs T = max
                full = fn(x, w, b, p)
                res["differing_t"] = [t for t in T_LIST if not all(map(torch.equal, fn(
                    x[:t], w, b, p), (full[0][:t], full[1][:t])))]  # fmt: skip
            for t in T_LIST:
                xt = x[:t].contiguous()
                us = 1e3 * time_ms(lambda xt=xt, fn=fn, w=w: fn(xt, w, b, p), graph=dev == "cuda")
                res["us"][t] = round(us, 2)
                res["GBps"][t] = round(nbytes / us / 1e3, 1)
            if dev == "cuda":
                res["kernels_per_call_t1"] = kernels_per_call(lambda fn=fn, w=w: fn(x[:1], w, b, p))
            if name in ("torch_invariant", "fused:bf16"):
                ids = fn(x, w, b, p)[0]
                res["tokens_with_other_ids_than_fused"] = int((ids != fused_full[0]).any(-1).sum())
        except Exception as ex:  # noqa: BLE001 - one broken configuration must not stop the run
            res["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        rec["variants"][name] = res
        shown = res.get("error") or " ".join(f"{t}:{us:.1f}" for t, us in res["us"].items())
        print(f"  {name:28s} us by T  {shown}", flush=True)
    return rec


def aot_report() -> None:
    """The gate kernel of every configuration (default and --sweep) at K2.6's gate compiled for
    sm_90a without a GPU: shared memory, registers, spill bytes (ptxas -v), cp.async count."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import router

    e, d = 384, 7168
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    cfgs = [router.router_config(e, d)] + [
        router.RouterConfig(bt, be, bk, u, s or router.router_config(e, d).split, wp, mma)
        for bt, be, bk, u, s, wp, mma in SWEEP
    ]
    for cfg in cfgs:
        chunk = cfg.block_k * cfg.unroll
        consts = dict(E=e, D=d, E_PAD=triton.cdiv(e, 16) * 16, BLOCK_T=cfg.block_t,
                      BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k, UNROLL=cfg.unroll,
                      SPLIT=cfg.split, MMA=cfg.mma, BF16=False,
                      K_PER=triton.cdiv(triton.cdiv(d, cfg.split), chunk) * chunk)  # fmt: skip
        sig = dict(x_ptr="*bf16", w_ptr="*fp32", part_ptr="*fp32", T="i32", sx="i32", sw="i32")
        sig.update(dict.fromkeys(consts, "constexpr"))
        div16 = [(list(sig).index(a),) for a in ("x_ptr", "w_ptr", "part_ptr", "sx", "sw")]
        attrs = {a: [["tt.divisibility", 16]] for a in div16}
        src = ASTSource(router._gate_partials_kernel, sig, constexprs=consts, attrs=attrs)
        opts = {"num_warps": cfg.warps}
        c = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(c.asm["ptx"])
            f.flush()
            cmd = [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull]
            log = subprocess.run(cmd, capture_output=True, text=True).stderr
        regs = re.findall(r"Used (\d+) registers", log) or ["?"]
        spill = re.findall(r"(\d+) bytes spill stores", log) or ["?"]
        print(f"{tuple(cfg)}: shared {c.metadata.shared} B, registers {regs[0]}, spill stores "
              f"{spill[0]} B, cp.async {c.asm['ptx'].count('cp.async')}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time other kernel configurations")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--aot", action="store_true", help="only compile the gate kernels for sm_90a")
    args = ap.parse_args()
    if args.aot:
        return aot_report()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        T_LIST[:] = [1, 5, 17]
    import torch
    from _util import environment, write_json

    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke)")
    t0 = time.time()
    out: dict = {"env": environment(), "t_list": T_LIST, "shapes": {}}
    if dev == "cuda":
        from _util import copy_bandwidth_gbs

        out["copy_GBps"] = round(copy_bandwidth_gbs(), 1)
    for name, spec in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        print(name, flush=True)
        rec = run_shape(args, spec, dev)
        if "copy_GBps" in out:
            rec["floor_us"] = round(4 * spec[0] * spec[1] / out["copy_GBps"] / 1e3, 2)
        out["shapes"][name] = rec
    out["seconds"] = round(time.time() - t0, 1)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
