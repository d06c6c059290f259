"""Tree-verify MLA attention vs its byte and FLOP floors, and vs torch SDPA with an explicit mask.

Both kernel modes are timed: the default (tuned tiling) and `invariant=True` (canonical
position-order tiling, AR-consistent and batch-invariant). Every case also reports the relative
L2 error of each kernel mode AND of the SDPA path against the fp32 reference
(`tree_mla_attention_ref` on fp32 copies of the inputs), so a disagreement says which side is off.

Per rank at tp=8: 8 heads, latent 512 + rope 64, bf16. Streams x budgets x prefixes; each stream
verifies budget + 1 rows (root + tree) over a prefix of the given length, random tree shapes.
Floors: bytes = each stream's keys once (576 bf16 each) + queries + outputs + slot ids + mask;
FLOPs = 2 x (576 + 512) per (query row, head, key). Both ceilings are measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from _util import (
    copy_bandwidth_gbs,
    device,
    environment,
    matmul_tflops,
    rel_err,
    time_ms,
    write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from _tree_inputs import random_meta  # noqa: E402

from ddserve.kernels.tree_attn import TreeAttnMeta, tree_mla_attention_ref  # noqa: E402
from ddserve.kernels.tree_attn_invariant import (  # noqa: E402
    _tree_attn_inv_kernel,
    device_config,
)
from ddserve.kernels.tree_attn_triton import tree_mla_attention  # noqa: E402

SCALE = 0.144680
VARIANTS = [
    {},
    {"BN": 32},
    {"num_stages": 3},
    {"BN": 128},
    {"BM": 32, "BN": 64},
    {"BM": 16, "num_warps": 4, "num_stages": 3},
]
INV_VARIANTS = [{"SPLIT": 256}, {"SPLIT": 1024}, {"num_stages": 3}, {"num_stages": 1}]


def kernel_resources(fn, seen: set) -> list[dict]:
    """Registers, spills, shared memory of the compiled binaries of a Triton kernel not in `seen`
    (ptxas numbers, known once a binary has run)."""
    rows = []
    try:
        for caches in fn.device_caches.values():
            for key, k in caches[0].items():
                if key in seen:
                    continue
                seen.add(key)
                md = k.metadata
                rows.append(dict(n_regs=getattr(k, "n_regs", None),
                                 n_spills=getattr(k, "n_spills", None), shared=md.shared,
                                 num_warps=md.num_warps, num_stages=md.num_stages))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - triton internals differ between versions
        rows.append(dict(error=f"{exc!r}"[:200]))
    return rows


def case_inputs(nb: int, budget: int, pl: int, h: int, r: int, p: int, dev, pad_pow2=False):
    """One case: nb streams with prefix pl and a random tree of budget + 1 rows (1 row: decode).
    With pad_pow2 the prefix-slot table is as wide as the engine's CUDA graphs make it (the
    next power of two >= pl + 1, at least 256). Returns (rows per stream, rows, metadata,
    q_latent, q_rope, latent pool)."""
    ql = budget + 1 if budget else 1
    slots = nb * (pl + ql) + 64
    meta = random_meta([pl] * nb, [ql] * nb, slots, seed=nb * 1000 + ql).to(dev)
    if pad_pow2:
        width = 256
        while width < pl + 1:
            width *= 2
        pad = meta.prefix_slots.new_zeros(nb, width - meta.prefix_slots.shape[1])
        meta = dataclasses.replace(meta, prefix_slots=torch.cat([meta.prefix_slots, pad], 1))
    t = nb * ql
    q_lat = torch.randn(t, h, r, device=dev).to(torch.bfloat16)
    q_pe = torch.randn(t, h, p, device=dev).to(torch.bfloat16)
    kv = torch.randn(slots, r + p, device=dev).to(torch.bfloat16)
    return ql, t, meta, q_lat, q_pe, kv


def sdpa_path(q_lat, q_pe, kv, meta: TreeAttnMeta, r: int) -> torch.Tensor:
    """Plain torch: gather each stream's keys (prefix, then block), pad, SDPA with a bool mask."""
    b, p_max = meta.prefix_slots.shape
    q_max = meta.block_mask.shape[1]
    t, h = q_lat.shape[:2]
    dev = q_lat.device
    rows = (meta.q_starts[:, None] + torch.arange(q_max, device=dev)).clamp_max(t - 1)  # [B, Q]
    slots = torch.cat([meta.prefix_slots, meta.block_slots[rows]], dim=1)  # [B, L]
    keys = kv[slots]  # [B, L, R+P]
    q = torch.cat([q_lat, q_pe], dim=-1)[rows].transpose(1, 2)  # [B, H, Q, R+P]
    pre = torch.arange(p_max, device=dev)[None, None, :] < meta.prefix_lens[:, None, None]
    blk = meta.block_mask | torch.eye(q_max, dtype=torch.bool, device=dev)  # padded rows see self
    mask = torch.cat([pre.expand(b, q_max, p_max), blk], dim=2)[:, None]  # [B, 1, Q, L]
    k = keys[:, None].expand(b, h, *keys.shape[1:])
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, k[..., :r], attn_mask=mask, scale=SCALE
    )  # [B, H, Q, R]
    return out.transpose(1, 2)  # [B, Q, H, R]


def kernel_us(fn, reps: int = 20) -> dict[str, float]:
    """Mean device time per call of each kernel `fn` launches (torch profiler, eager calls):
    separates the attention kernel from the split merge."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            out[ev.key[:60]] = ev.device_time_total / reps
    return out


def run_case(nb, budget, pl, h, r, p, bw, peak, sweep, dev, splits=(), pad_pow2=False) -> dict:
    ql, t, meta, q_lat, q_pe, kv = case_inputs(nb, budget, pl, h, r, p, dev, pad_pow2)
    nbytes = nb * (pl + ql) * (r + p) * 2 + t * h * (r + p + r) * 2 + nb * (pl + ql) * 8
    flops = nb * ql * h * (pl + ql) * 2 * (r + p + r)
    floor_ms = max(nbytes / bw / 1e6, flops / peak / 1e9)
    row = dict(streams=nb, budget=budget, q_len=ql, prefix=pl, bytes=nbytes, flops=flops)
    row["floor_ms"] = floor_ms
    row["bound"] = "bytes" if nbytes / bw / 1e6 >= flops / peak / 1e9 else "flops"

    def triton_path(config=None, invariant=False):
        return tree_mla_attention(q_lat, q_pe, kv, meta, SCALE, config=config, invariant=invariant)

    ref32 = tree_mla_attention_ref(q_lat.float(), q_pe.float(), kv.float(), meta, SCALE)
    ref32 = ref32.view(nb, ql, h, r)  # [B, Q, H, R] fp32
    out = triton_path()
    row["ms"] = time_ms(triton_path)
    row["floor_over_time"] = floor_ms / row["ms"]
    row["err_vs_ref32"] = rel_err(out.view(nb, ql, h, r), ref32)
    try:
        out_inv = triton_path(invariant=True)
        row["inv_ms"] = time_ms(lambda: triton_path(invariant=True))
        row["inv_over_default"] = row["inv_ms"] / row["ms"]
        row["inv_err_vs_ref32"] = rel_err(out_inv.view(nb, ql, h, r), ref32)
    except Exception as exc:  # noqa: BLE001 - report and go on with the other measurements
        row["inv_error"] = f"{exc!r}"[:300]
        row["inv_ms"] = row["inv_over_default"] = row["inv_err_vs_ref32"] = float("nan")
    try:
        ref = sdpa_path(q_lat, q_pe, kv, meta, r)
        row["err_vs_sdpa"] = rel_err(out.view(nb, ql, h, r), ref)
        row["sdpa_err_vs_ref32"] = rel_err(ref, ref32)
        row["sdpa_ms"] = time_ms(lambda: sdpa_path(q_lat, q_pe, kv, meta, r))
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["ms"]
    except RuntimeError as e:  # e.g. out of memory for the padded torch path
        row["sdpa_error"] = str(e)[:200]
    if splits:  # the invariant kernel at each SPLIT (keys per split), its output vs the default
        row["inv_splits"] = []
        for sp in splits:
            cfg = parse_config(sp)
            try:
                o = triton_path(cfg, True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                row["inv_splits"].append(dict(config=cfg, ms=float("inf"), error=repr(exc)[:200]))
                continue
            ms = time_ms(lambda cfg=cfg: triton_path(cfg, True), rep=50)
            err = rel_err(o.view(nb, ql, h, r), ref32)
            per_kernel = kernel_us(lambda cfg=cfg: triton_path(cfg, True)) if o.is_cuda else {}
            row["inv_splits"].append(
                dict(config=cfg, ms=ms, err_vs_ref32=err, kernel_us=per_kernel)
            )
    if sweep:
        for key, variants, inv in (
            ("variants", VARIANTS, False),
            ("inv_variants", INV_VARIANTS, True),
        ):
            row[key] = []
            for c in variants:
                try:
                    ms = time_ms(lambda c=c, inv=inv: triton_path(c, inv), rep=50)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    ms = float("inf")
                    row.setdefault("variant_errors", []).append(f"{c}: {exc!r}"[:160])
                row[key].append(dict(config=c, ms=ms))
        best = min(row["variants"], key=lambda v: v["ms"])
        row["best_config"], row["best_ms"] = best["config"], best["ms"]
    return row


def parse_config(text: str) -> dict:
    """ "256" -> SPLIT 256; "256/64" -> SPLIT 256, BN 64; "SPLIT=256/num_stages=3" -> those keys."""
    cfg, plain = {}, iter(("SPLIT", "BN"))
    for part in text.split("/"):
        key, _, val = part.rpartition("=")
        cfg[key or next(plain)] = int(val)
    return cfg


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--prefixes", default="1024,8192,32768", help="comma-separated prefix lengths")
    ap.add_argument("--streams", default="1,5,10", help="comma-separated stream counts")
    ap.add_argument("--budgets", default="8,16,32,64", help="comma-separated budgets (0: decode)")
    ap.add_argument(
        "--splits",
        default="",
        help="time the invariant kernel at each configuration: SPLIT, SPLIT/BN or key=value/... "
        "(e.g. 128,256/64,SPLIT=256/num_stages=3/num_warps=4)",
    )
    ap.add_argument(
        "--pad-pow2",
        action="store_true",
        help="prefix-slot tables as wide as the engine's graphs (next power of 2)",
    )
    args = ap.parse_args()
    dev = device()
    h, r, p = (2, 32, 16) if args.smoke else (8, 512, 64)
    streams, budgets, prefixes = (
        ([2], [8], [64])
        if args.smoke
        else (_ints(args.streams), _ints(args.budgets), _ints(args.prefixes))
    )
    cases = [(b, q, pl) for b in streams for q in budgets for pl in prefixes]
    decode = [pl for pl in (1024, 8192, 32768) if pl in prefixes and 0 not in budgets]
    cases += [] if args.smoke else [(b, 0, pl) for b in (1, 10) for pl in decode]  # decode
    bw, peak = copy_bandwidth_gbs(), matmul_tflops()
    res = dict(env=environment(), copy_gbs=bw, bf16_tflops=peak, heads=h, latent=r, rope=p, rows=[])
    res["invariant_config"] = device_config(dev)
    print(f"copy {bw:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s")
    for nb, budget, pl in cases:
        row = run_case(nb, budget, pl, h, r, p, bw, peak, args.sweep, dev,
                       [x for x in args.splits.split(",") if x], args.pad_pow2)  # fmt: skip
        res["rows"].append(row)
        print(f"B={nb:2d} budget={budget:2d} prefix={pl:5d}: {row['ms'] * 1e3:8.1f} us "
              f"inv {row['inv_ms'] * 1e3:8.1f} us ({row['inv_over_default']:.2f}x) "
              f"floor {row['floor_ms'] * 1e3:7.1f} us ({row['bound']}, "
              f"{row['floor_over_time']:.2f}) "
              f"best {row.get('best_ms', 0) * 1e3:7.1f} sdpa {row.get('sdpa_ms', 0) * 1e3:8.1f} us "
              f"| err vs fp32 ref: kernel {row['err_vs_ref32']:.1e} "
              f"inv {row['inv_err_vs_ref32']:.1e} "
              f"sdpa {row.get('sdpa_err_vs_ref32', -1):.1e} (kernel vs sdpa "
              f"{row.get('err_vs_sdpa', -1):.1e})", flush=True)  # fmt: skip
        for v in row.get("inv_splits", []):
            print(f"    inv {v['config']}: {v['ms'] * 1e3:8.1f} us", flush=True)
    res["inv_resources"] = kernel_resources(_tree_attn_inv_kernel, set())
    write_json(args.out, res)


if __name__ == "__main__":
    main()
