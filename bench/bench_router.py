"""GPU time of the MoE router per layer: the fused Triton router vs the torch path it replaces.

Variants (each captured in a CUDA graph per (shape, T) and its replay timed with triton's do_bench:
median, L2 flushed between calls, so the fp32 gate streams from HBM as in a real forward):
- "fused": `router.route` (one launch: the gate GEMV partials, then each token tile's last
  program selects its tokens' experts) with `router_config(E, D)`. With --sweep also
  "fused:BTxBExBKxU/S/W[:mma]": other tiles, splits, warps, and the tensor-core (tf32x3) form
  of the gate GEMV; and "fused:selN": N tokens x padded experts per selection step (SEL_T).
- "two_launch": the same configuration with `fused=False` (the selection as a second launch,
  one program per token): the same bits ("bitwise_equal_to_fused" at T = 170).
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
(torch profiler); per fused / two_launch variant the T whose rows differ from the same rows at
T = 170 (row invariance: must be []); for torch_invariant and two_launch how many of 170 tokens'
ids differ from "fused".

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

SWEEP_SEL = [512, 1024, 4096]  # RouterConfig.sel_elems: SEL_T 1, 2, 8 at K2.6 (default 4)


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

    two = router.router_config(e, d)._replace(fused=False)
    out = {
        "fused": lambda x, w, b, p: router.route(x, w, b, p),
        "two_launch": lambda x, w, b, p: router.route(x, w, b, p, two),
        "torch_invariant": invariant_ref,
        "torch": lambda x, w, b, p: route_ref(
            x, w, b, p, linear=F.linear, row_sum=lambda v: v.sum(-1, keepdim=True)
        ),
    }
    if not args.smoke:  # the interpreter's dot mis-reads bf16 operands (the tests patch it)
        out["fused:bf16"] = lambda x, w, b, p: router.route(x, w, b, p)
        out["two_launch:bf16"] = lambda x, w, b, p: router.route(x, w, b, p, two)
    sweep = [(c, "") for c in SWEEP] + [(c, ":bf16") for c in SWEEP_BF16]
    for (bt, be, bk, u, s, wp, mma), gate in sweep if args.sweep else []:
        split = s or router.router_config(e, d).split
        cfg = router.RouterConfig(bt, be, bk, u, split, wp, mma)
        name = f"fused:{bt}x{be}x{bk}x{u}/{split}/{wp}" + ":mma" * mma + gate
        out[name] = lambda x, w, b, p, cfg=cfg: router.route(x, w, b, p, cfg)
    for n, gate in [(n, g) for n in SWEEP_SEL for g in ("", ":bf16")] if args.sweep else []:
        cfg = router.router_config(e, d)._replace(sel_elems=n)
        out[f"fused:sel{n}{gate}"] = lambda x, w, b, p, cfg=cfg: router.route(x, w, b, p, cfg)
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
            if name.startswith(("fused", "two_launch")):  # rows at each T vs T = max
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
            if name in ("torch_invariant", "fused:bf16", "two_launch", "two_launch:bf16"):
                ids, wts = fn(x, w, b, p)
                res["tokens_with_other_ids_than_fused"] = int((ids != fused_full[0]).any(-1).sum())
            if name.startswith("two_launch"):  # vs the one-launch form on the same gate
                one_ids, one_wts = router.route(x, w, b, p)
                res["bitwise_equal_to_fused"] = torch.equal(ids, one_ids) and torch.equal(
                    wts, one_wts
                )
        except Exception as ex:  # noqa: BLE001 - one broken configuration must not stop the run
            res["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        rec["variants"][name] = res
        shown = res.get("error") or " ".join(f"{t}:{us:.1f}" for t, us in res["us"].items())
        print(f"  {name:28s} us by T  {shown}", flush=True)
    return rec


def _launch_args(e: int, d: int, p, cfg, bf16: bool) -> tuple[dict, dict]:
    """(signature, constexprs) of `_gate_partials_kernel` as `router.route` launches it on an
    sm_90 device (PDL, gate prefetch) for a bf16 x and a bf16 or fp32 gate."""
    import triton

    from ddserve.kernels import router

    chunk = cfg.block_k * cfg.unroll
    k_per = triton.cdiv(triton.cdiv(d, cfg.split), chunk) * chunk
    step = 64 if bf16 else 32
    eg = e // p.n_group
    n = triton.next_power_of_2(p.n_group) * triton.next_power_of_2(eg)
    consts = dict(E=e, D=d, E_PAD=triton.cdiv(e, 16) * 16, BLOCK_T=cfg.block_t,
                  BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k, UNROLL=cfg.unroll, SPLIT=cfg.split,
                  K_PER=k_per, MMA=cfg.mma, BF16=bf16, PDL=True, PF_STEP=step,
                  PF_LINES=min(triton.next_power_of_2(triton.cdiv(k_per, step)),
                               router.GATE_PREFETCH_BYTES // (128 * cfg.block_e)),
                  FUSED=cfg.fused, SEL_T=min(max(cfg.sel_elems // n, 1), cfg.block_t),
                  G=p.n_group, G_PAD=triton.next_power_of_2(p.n_group), EG=eg,
                  EG_PAD=triton.next_power_of_2(eg), TOPK_GROUP=p.topk_group, TOPK=p.top_k,
                  TOPK_PAD=triton.next_power_of_2(p.top_k), NORM=p.norm_topk_prob)  # fmt: skip
    sig = dict(x_ptr="*bf16", w_ptr="*bf16" if bf16 else "*fp32", part_ptr="*fp32",
               bias_ptr="*fp32", ids_ptr="*i64", wts_ptr="*fp32", ticket_ptr="*i32", T="i32",
               sx="i32", sw="i32", scaling="fp32")  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    return sig, consts


def _compile(kernel, sig: dict, consts: dict, warps: int) -> str:
    """Shared memory, registers, spill bytes (ptxas -v) and cp.async count of one sm_90a
    compile, pointers and strides 16-divisible."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    div16 = [(list(sig).index(a),) for a in sig if sig[a].startswith("*") or a in ("sx", "sw")]
    attrs = {a: [["tt.divisibility", 16]] for a in div16}
    src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": warps, "launch_pdl": True}
    c = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(c.asm["ptx"])
        f.flush()
        cmd = [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull]
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", log) or ["?"]
    spill = re.findall(r"(\d+) bytes spill stores", log) or ["?"]
    return (f"shared {c.metadata.shared} B, registers {regs[0]}, spill stores {spill[0]} B, "
            f"cp.async {c.asm['ptx'].count('cp.async')}")  # fmt: skip


def aot_report() -> None:
    """The router's kernels compiled for sm_90a without a GPU, at K2.6's gate (and the fused
    kernel at DeepSeek-V3's grouped routing): the one-launch kernel and the two-launch pair of
    the default configuration with a bf16 and an fp32 gate, then the gate kernel of every
    --sweep configuration. Shared memory, registers, spill bytes (ptxas -v), cp.async count."""
    from ddserve.kernels import router
    from ddserve.kernels.router_ref import RoutingParams

    d = 7168
    base = router.router_config(384, d)
    cases = [(f"{name}, {'bf16' if bf16 else 'fp32'} gate, fused={fused}", e, p,
              base._replace(fused=fused), bf16)
             for name, e, p in [("k26", 384, RoutingParams(8, 1, 1, True, 2.827)),
                                ("v3 grouped", 256, RoutingParams(8, 8, 4, True, 2.5))]
             for bf16 in (True, False) for fused in (True, False)]  # fmt: skip
    cases += [(str(tuple(router.RouterConfig(bt, be, bk, u, s or base.split, wp, mma))), 384,
               cases[0][2], router.RouterConfig(bt, be, bk, u, s or base.split, wp, mma), False)
              for bt, be, bk, u, s, wp, mma in SWEEP]  # fmt: skip
    for label, e, p, cfg, bf16 in cases:
        sig, consts = _launch_args(e, d, p, cfg, bf16)
        print(f"{label}: gate {_compile(router._gate_partials_kernel, sig, consts, cfg.warps)}",
              flush=True)  # fmt: skip
        if not cfg.fused and label.startswith(("k26", "v3")):
            sel = ("E_PAD", "SPLIT", "G", "G_PAD", "EG", "EG_PAD", "TOPK_GROUP", "TOPK",
                   "TOPK_PAD", "NORM", "PDL")  # fmt: skip
            sc = {c: consts[c] for c in sel}
            ss = dict(part_ptr="*fp32", bias_ptr="*fp32", ids_ptr="*i64", wts_ptr="*fp32",
                      T="i32", scaling="fp32", **dict.fromkeys(sc, "constexpr"))  # fmt: skip
            print(f"  + select {_compile(router._select_kernel, ss, sc, 1)}", flush=True)


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
