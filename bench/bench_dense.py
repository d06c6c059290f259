"""GPU time of the batch-invariant dense ops vs torch, by CUDA-graph replay (GPU time only).

The engine replays captured CUDA graphs, so launch overhead does not count; each op is captured
once per (variant, M) and its replay timed with triton's do_bench (median, L2 flushed between
calls, as a real forward streams its weights from HBM). Shapes are one rank of Kimi K2.6 at
tp = 8: MLA q_a / kv_a / q_b / o_proj, the absorbed per-head matmuls (8 heads, 128 x 512 both
ways), the shared expert, the first layer's dense MLP, the fp32 Router gate, the lm_head slice
and the three RMSNorm widths. Variants: torch, the Triton kernels with the configurations of
`invariant_configs` ("triton"), and the 16-bit matmuls with the prompt-chunk configuration
("triton:prefill", inside `backend.prefill_phase()`). Per (op, variant, M): microseconds, weight
GB/s, TFLOP/s; per Triton variant: whether every timed M gave the same rows as the largest M (row
invariance) and the max error vs torch (the Router: vs float64).

`--preset splitk` picks the K split of the decode configuration: the matmuls of one K2.6 rank
step (q_a, q_b, kv_a, o_proj, the shared expert's gate / up (also merged), down, the absorbed
per-head matmuls, the Router gate) at M = 1, 10, 17, 170, with the production path ("triton":
split-K partials summed in-kernel), the same configuration with the sum as a second launch
("triton:2launch", `invariant._launch(two_launch=True)`, bench-only), and every split of
--splits both ways ("triton:split=S", "triton:2launch:split=S"). `split_summary` in the JSON:
per op and M, the microseconds of each and the fastest split; each in-kernel variant also lists
the Ms where its bits differ from the two-launch sum ("differs_from_2launch_at_m", must be []).

    python3 bench/bench_dense.py --out $OUT/dense.json                     # < 90 s
    python3 bench/bench_dense.py --preset splitk --out $OUT/splitk.json    # < 300 s
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch
from _util import capture_graph, environment, write_json

from ddserve.kernels import backend, invariant_configs
from ddserve.kernels.invariant_ref import (
    bmm_heads_ref,
    fixed_order_sum,
    linear_ref,
    rms_norm_ref,
)

M_LIST = [1, 8, 17, 40, 85, 136, 170, 330, 520, 650]
H, D = 8, 7168  # heads per rank, hidden size
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1
# name -> (kind, N, K); linear weights are [N, K]; "bmm_uk" x [T, H, 128] @ [H, 128, 512],
# "bmm_uv" x [T, H, 512] @ [H, 128, 512]^T; "rms" has width K ("rms_strided": rows of a
# [M, K + 64] tensor, like MLA's c_kv); "rowsum" sums K fp32 values per row.
OPS = {
    "q_a 7168->1536": ("linear", 1536, D),
    "kv_a 7168->576": ("linear", 576, D),
    "q_b 1536->1536": ("linear", 1536, 1536),
    "absorb_uk 8x128->512": ("bmm_uk", 512, 128),
    "absorb_uv 8x512->128": ("bmm_uv", 128, 512),
    "o_proj 1024->7168": ("linear", D, 1024),
    "shared gate|up 7168->256": ("linear", 256, D),  # gate or up (two matmuls)
    "shared gate+up 7168->512": ("linear", 512, D),  # the two as one matmul
    "shared down 256->7168": ("linear", D, 256),
    "dense gate|up 7168->2304": ("linear", 2304, D),
    "dense down 2304->7168": ("linear", D, 2304),
    "router fp32 7168->384": ("router", 384, D),
    "lm_head 7168->20480": ("linear", 20480, D),
    "rms_norm 7168": ("rms", 0, D),
    "rms_norm 1536": ("rms", 0, 1536),
    "rms_norm 512 (strided)": ("rms_strided", 0, 512),
    "router top-8 sum fp32": ("rowsum", 0, 8),  # torch: fixed_order_sum (3 elementwise adds)
}


SPLITK_OPS = [
    "q_a 7168->1536", "q_b 1536->1536", "kv_a 7168->576", "o_proj 1024->7168",
    "shared gate|up 7168->256", "shared gate+up 7168->512", "shared down 256->7168",
    "absorb_uk 8x128->512", "absorb_uv 8x512->128", "router fp32 7168->384",
]  # fmt: skip
SPLITK_M = [1, 10, 17, 170]


def is_matmul(kind: str) -> bool:
    return kind in ("linear", "router", "bmm_uk", "bmm_uv")


def make_inputs(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, tuple]:
    """x [650, ...] and the op's other arguments, on CUDA."""
    mmax, dt = max(M_LIST), torch.bfloat16

    def r(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

    if kind == "linear":
        return r(mmax, k), (r(n, k, scale=k**-0.5),)
    if kind == "router":
        return r(mmax, k, dtype=torch.float32), (r(n, k, dtype=torch.float32, scale=k**-0.5),)
    if kind == "bmm_uk":
        return r(mmax, H, k), (r(H, k, n, scale=k**-0.5),)
    if kind == "bmm_uv":
        return r(mmax, H, k), (r(H, n, k, scale=k**-0.5).transpose(1, 2),)
    if kind == "rowsum":
        return r(mmax, k, dtype=torch.float32).abs(), ()
    x = r(mmax, k + 64, scale=3.0)[:, :k] if kind == "rms_strided" else r(mmax, k, scale=3.0)
    return x, (r(k), 1e-6)


def fns(kind: str) -> tuple[Callable, Callable]:
    from ddserve.kernels import invariant

    if kind in ("linear", "router"):
        return invariant.linear, linear_ref
    if kind.startswith("bmm"):
        return invariant.bmm_heads, bmm_heads_ref
    if kind == "rowsum":
        return invariant.row_sum8, fixed_order_sum
    return invariant.rms_norm, rms_norm_ref


def variant_fn(kind: str, split: int | None, two_launch: bool) -> Callable:
    """The Triton matmul with the configuration's K split replaced by `split` (None: kept) and
    the split-K sum in-kernel or as a second launch: `invariant._launch`'s bench-only knobs."""
    from ddserve.kernels import invariant

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        heads = 1 if x.dim() == 2 else x.shape[1]
        n = w.shape[0] if heads == 1 else w.shape[2]
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)  # [M, (H,) N]
        strides = (0, w.stride(1), w.stride(0)) if heads == 1 else w.stride()
        invariant._launch(x, w, y, strides, heads, variant_cfg(kind, n, x, split), two_launch)
        return y

    return run


def variant_cfg(kind: str, n: int, x: torch.Tensor, split: int | None):
    heads = H if kind.startswith("bmm") else 1
    cfg = invariant_configs.mm_config(n, x.shape[-1], x.dtype, heads)
    return cfg if split is None else cfg._replace(split=split)


def variants(preset: str, splits: list[int]) -> list[tuple[str, str | None, int | None, bool]]:
    """(name, phase or None for torch, split override, two_launch), outermost loop of the run."""
    if preset != "splitk":
        return [("torch", None, None, False), ("triton", "decode", None, False),
                ("triton:prefill", "prefill", None, False)]  # fmt: skip
    out = [("torch", None, None, False), ("triton", "decode", None, False),
           ("triton:2launch", "decode", None, True)]  # fmt: skip
    for s in splits:
        out.append((f"triton:split={s}", "decode", s, False))
        if s > 1:
            out.append((f"triton:2launch:split={s}", "decode", s, True))
    return out


def graph_us(fn: Callable[[], torch.Tensor]) -> float:
    """Median GPU microseconds of one replay of fn captured in a CUDA graph."""
    import triton.testing

    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    g = capture_graph(fn)
    ms = triton.testing.do_bench(g.replay, warmup=5, rep=12, return_mode="median")
    del g
    return ms * 1000


def op_cost(kind: str, n: int, k: int, m: int, w: torch.Tensor | None) -> tuple[int, int]:
    """(bytes that must move at least once, flops) for M rows."""
    if not is_matmul(kind):
        return 2 * m * k * (4 if kind == "rowsum" else 2), 0
    heads = H if kind.startswith("bmm") else 1
    return w.numel() * w.element_size(), 2 * m * n * k * heads


def run_variant(name, kind, n, k, x, args, fn, ref_full, deadline, twin=None) -> dict:
    """Times fn at every M; checks rows vs the largest-M run and the error vs the reference;
    with `twin` (the same matmul with the two-launch split-K sum), the Ms whose bits differ."""
    full = fn(x, *args)
    res: dict = {"us": {}, "GBps": {}, "TFLOPs": {}, "differing_m": []}
    if twin is not None:
        res["differs_from_2launch_at_m"] = []
    err_ref = ref_full.double() if kind != "router" else (x.double() @ args[0].double().T)
    res["max_abs_err"] = float((full.double() - err_ref).abs().max())
    for m in M_LIST:
        if time.time() > deadline:
            res["skipped_m"] = [mm for mm in M_LIST if mm not in res["us"]]
            break
        xm = x[:m]
        if not torch.equal(fn(xm, *args), full[:m]):
            res["differing_m"].append(m)
        if twin is not None and not torch.equal(fn(xm, *args), twin(xm, *args)):
            res["differs_from_2launch_at_m"].append(m)
        us = graph_us(lambda xm=xm: fn(xm, *args))
        nbytes, flops = op_cost(kind, n, k, m, args[0] if args else None)
        res["us"][m] = round(us, 2)
        res["GBps"][m] = round(nbytes / us / 1e3, 1)
        res["TFLOPs"][m] = round(flops / us / 1e6, 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="", help="comma-separated substrings of op names")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds; later work is skipped (default 85, splitk 280)")  # fmt: skip
    ap.add_argument("--m", default="", help="comma-separated row counts (default: the K2.6 list)")
    ap.add_argument("--preset", choices=["", "splitk"], default="")
    ap.add_argument("--splits", default="1,2,4,8,16", help="splitk: K splits to time")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.preset == "splitk":
        M_LIST[:] = SPLITK_M
    if a.m:
        M_LIST[:] = [int(m) for m in a.m.split(",")]
    t0 = time.time()
    deadline = t0 + (a.budget or (280.0 if a.preset else 85.0))
    pool = SPLITK_OPS if a.preset == "splitk" else list(OPS)
    wanted = [o for o in pool if not a.ops or any(p in o for p in a.ops.split(","))]
    g = torch.Generator(device=DEV).manual_seed(0)
    inputs = {o: make_inputs(OPS[o][0], OPS[o][1], OPS[o][2], g) for o in wanted}
    refs = {o: fns(OPS[o][0])[1](inputs[o][0], *inputs[o][1]) for o in wanted}
    out: dict = {"env": environment(), "m_list": M_LIST, "configs": {}, "ops": {}}
    # variants outermost, so a budget cut leaves whole variants comparable
    for vname, sel, split, two in variants(a.preset, [int(s) for s in a.splits.split(",")]):
        for o in wanted:
            kind, n, k = OPS[o]
            if sel == "prefill" and not (is_matmul(kind) and kind != "router"):
                continue  # the phase changes the 16-bit matmuls only
            if (split or two) and not is_matmul(kind):
                continue
            rec = out["ops"].setdefault(o, {"kind": kind, "n": n, "k": k})
            if time.time() > deadline:
                rec.setdefault("skipped", []).append(vname)
                continue
            x, args = inputs[o]
            custom = split is not None or two  # else the public op, as the model calls it
            fast = variant_fn(kind, split, two) if custom else fns(kind)[0]
            phase = backend.prefill_phase() if sel == "prefill" else contextlib.nullcontext()
            with phase:
                if sel and is_matmul(kind):
                    cfg = variant_cfg(kind, n, x, split)
                    out["configs"].setdefault(vname, {})[o] = cfg._asdict()
                checked = a.preset == "splitk" and sel == "decode" and not two
                twin = variant_fn(kind, split, True) if checked else None
                try:
                    rec[vname] = run_variant(o, kind, n, k, x, args, fast if sel else fns(kind)[1],
                                             refs[o], deadline, twin)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - one broken config must not stop the sweep
                    rec[vname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            r = rec[vname]
            print(f"{o:28s} {vname:24s} " + (r.get("error") or " ".join(
                f"{m}:{us:.1f}" for m, us in r["us"].items())), flush=True)  # fmt: skip
    picks = (1, 136, 520) if not a.preset else tuple(M_LIST)
    out["summary"] = summary(out["ops"], picks)
    if a.preset == "splitk":
        out["split_summary"] = split_summary(out["ops"])
    out["seconds"] = round(time.time() - t0, 1)
    write_json(a.out, out)


def summary(ops: dict, picks: tuple[int, ...]) -> dict:
    """op -> variant -> 'us at each M of picks (x torch)' for a quick read."""
    res = {}
    for o, rec in ops.items():
        base = rec.get("torch", {}).get("us", {})
        row = {}
        for v, r in rec.items():
            if not isinstance(r, dict) or "us" not in r:
                continue
            parts = []
            for m in picks:
                if m in r["us"]:
                    ratio = r["us"][m] / base[m] if base.get(m) else float("nan")
                    parts.append(f"M{m} {r['us'][m]:.1f}us x{ratio:.2f}")
            inv = "" if v == "torch" or not r["differing_m"] else f" DIFFERS at {r['differing_m']}"
            row[v] = "; ".join(parts) + inv
        res[o] = row
    return res


def split_summary(ops: dict) -> dict:
    """op -> M -> {"us": {variant: us} for the Triton variants, "fastest_split": the in-kernel
    split with the least us, "default_vs_2launch": the production path's us / the same
    configuration's two-launch us}."""
    res = {}
    for o, rec in ops.items():
        per_m = {}
        for m in M_LIST:
            timed = {v: r for v, r in rec.items() if v.startswith("triton") and "us" in r}
            us = {v: r["us"][m] for v, r in timed.items() if m in r["us"]}
            fused = {
                int(v.split("=")[1]): t for v, t in us.items() if v.startswith("triton:split=")
            }
            row: dict = {"us": us}
            if fused:
                row["fastest_split"] = min(fused, key=fused.get)
            if us.get("triton") and us.get("triton:2launch"):
                row["default_vs_2launch"] = round(us["triton"] / us["triton:2launch"], 3)
            per_m[m] = row
        res[o] = per_m
    return res


if __name__ == "__main__":
    main()
